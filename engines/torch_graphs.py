"""torch executor: replays the torch.export programs saved by `trtspec build --backend torch`.

It runs exactly the graphs that the ONNX and TensorRT backends are compiled from, in PyTorch,
so it is both the reference for the compiled backends and the fallback where neither is
installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from trtspec.engines.executor import ProfileKey
from trtspec.export.bindings import GraphSpec


class TorchExecutor:
    backend = "torch"

    def __init__(self, graphs: Mapping[str, Path], device: torch.device, specs: Mapping[str, GraphSpec]):
        self.device = device
        self.modules = {name: torch.export.load(str(path)).module().to(device) for name, path in graphs.items()}
        self.specs = specs

    def run(self, graph: str, profile: ProfileKey, inputs: Mapping[str, torch.Tensor],
            outputs: Mapping[str, torch.Tensor]) -> None:
        with torch.inference_mode():
            spec = self.specs[graph]
            results = self.modules[graph](*(inputs[t.name] for t in spec.inputs))
        for t, result in zip(spec.outputs, results, strict=True):
            outputs[t.name].copy_(result)

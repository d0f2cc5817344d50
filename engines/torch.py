"""torch executor: replays the torch.export programs saved by `trtspec build --backend torch`.

It runs exactly the graphs that the ONNX and TensorRT backends are compiled from, in PyTorch,
so it is both the reference for the compiled backends and the fallback where neither is
installed. On a GPU, with `cuda_graphs`, each decode-cycle run over fixed bindings is captured
once as a CUDA graph and replayed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping

import torch

from trtspec.engines.capture import CudaGraphs, binding_key
from trtspec.engines.executor import PREFILL, ProfileKey
from trtspec.export.bindings import GraphSpec


class TorchExecutor:
    backend = "torch"

    def __init__(self, modules: Mapping[str, Callable[..., tuple]], device: torch.device,
                 specs: Mapping[str, GraphSpec], cuda_graphs: bool = False):
        """Run `modules` (graph name -> callable with the graph's inputs and outputs, in spec order):
        the loaded programs, or the eager step modules they were exported from."""
        self.device = device
        self.modules = dict(modules)
        self.specs = specs
        # Decode-cycle runs over fixed bindings are captured once and replayed (CUDA only).
        self.cuda_graphs = CudaGraphs(device) if cuda_graphs and device.type == "cuda" else None

    @classmethod
    def load(cls, graphs: Mapping[str, Path], device: torch.device, specs: Mapping[str, GraphSpec],
             cuda_graphs: bool = False) -> "TorchExecutor":
        """The programs that `trtspec build --backend torch` saved, on `device`."""
        modules = {name: torch.export.load(str(path)).module().to(device) for name, path in graphs.items()}
        return cls(modules, device, specs, cuda_graphs=cuda_graphs)

    def run(self, graph: str, profile: ProfileKey, inputs: Mapping[str, torch.Tensor],
            outputs: Mapping[str, torch.Tensor]) -> None:
        def launch() -> None:
            with torch.inference_mode():
                spec = self.specs[graph]
                results = self.modules[graph](*(inputs[t.name] for t in spec.inputs))
                for t, result in zip(spec.outputs, results, strict=True):
                    outputs[t.name].copy_(result)

        if self.cuda_graphs is None or profile == PREFILL:
            launch()
        else:
            self.cuda_graphs.run(binding_key(graph, profile, inputs, outputs), launch)

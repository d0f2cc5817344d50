"""torch executors: the torch.export programs of `trtspec build --backend torch`, and the same
programs compiled ahead of time by AOTInductor (`--backend inductor`).

The torch backend runs exactly the graphs that the ONNX and TensorRT backends are compiled from,
in PyTorch, so it is both the reference for the compiled backends and the fallback where neither
is installed. The inductor backend needs nothing beyond torch either: its packages hold generated
C++ (CPU) or Triton (CUDA) kernels. On a GPU, with `cuda_graphs`, each decode-cycle run over fixed
bindings is captured once as a CUDA graph and replayed.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Callable, Mapping

import torch

from trtspec.engines.capture import CudaGraphs, binding_key
from trtspec.engines.executor import PREFILL, ProfileKey
from trtspec.errors import TrtspecError
from trtspec.export.bindings import GraphSpec


# Modules of the programs this process has loaded, by (file SHA-256, device), while something holds them.
_LOADED: "weakref.WeakValueDictionary[tuple[str, str], torch.nn.Module]" = weakref.WeakValueDictionary()


def load_module(path: Path, device: torch.device, sha256: str | None = None) -> torch.nn.Module:
    """A saved program's module on `device`. A program of the same bytes that this process already
    runs on that device (a build's self-check, then the user's open of the engine) is shared rather
    than loaded again: `torch.export.load` takes seconds per graph, as it re-derives every node's
    metadata (~5 s for a 13.5M-parameter target's graph on a CPU). The modules are pure functions of their inputs,
    so engines sharing one never see each other's state."""
    key = (sha256, str(device))
    module = _LOADED.get(key) if sha256 else None
    if module is None:
        module = torch.export.load(str(path)).module().to(device)
        if sha256:
            _LOADED[key] = module
    return module


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
             cuda_graphs: bool = False, digests: Mapping[str, str] | None = None) -> "TorchExecutor":
        """The programs that `trtspec build --backend torch` saved, on `device` (`digests`: their
        files' SHA-256, verified by the caller, so a program this process holds is shared)."""
        modules = {name: load_module(path, device, (digests or {}).get(name)) for name, path in graphs.items()}
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


class InductorExecutor(TorchExecutor):
    backend = "inductor"

    @classmethod
    def load(cls, graphs: Mapping[str, Path], device: torch.device, specs: Mapping[str, GraphSpec],
             cuda_graphs: bool = False) -> "InductorExecutor":
        """The AOTInductor packages that `trtspec build --backend inductor` compiled for `device`'s kind."""
        from torch._inductor import aoti_load_package

        modules = {}
        for name, path in graphs.items():
            try:
                modules[name] = aoti_load_package(str(path), device_index=device.index if device.index is not None
                                                  else (torch.cuda.current_device() if device.type == "cuda" else -1))
            except Exception as error:  # noqa: BLE001 - a package for another device or torch: one line
                raise TrtspecError(f"{path}: cannot load this AOTInductor package on {device} ({type(error).__name__}: "
                                   f"{str(error).splitlines()[0] if str(error) else ''}); packages run on the kind of "
                                   "device and the torch version they were compiled with: rebuild the engine here "
                                   "(trtspec build --backend inductor)") from None
        return cls(modules, device, specs, cuda_graphs=cuda_graphs)


def compile_package(program: "Path | torch.export.ExportedProgram", package: Path) -> None:
    """Compile a torch.export program (or one saved at a path) with AOTInductor into `package`
    (minutes for a large graph; the build caches it per machine, see `compiled_for`)."""
    import logging
    import warnings

    from torch._inductor import aoti_compile_and_package

    logging.getLogger("torch._inductor").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if isinstance(program, Path):
            program = torch.export.load(str(program))
        aoti_compile_and_package(program, package_path=str(package))


def compiled_for(device: torch.device) -> str:
    """What AOTInductor's generated code depends on beyond the graph: the CPU's vector ISA, or the GPU."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda sm_{major}{minor} {torch.cuda.get_device_name(device)} {torch.version.cuda}"
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    import platform

    return f"cpu {platform.machine()} {pick_vec_isa()}"

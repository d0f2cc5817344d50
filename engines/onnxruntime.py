"""ONNX Runtime executor: one InferenceSession per graph, inputs and outputs bound in place.

IOBinding points ONNX Runtime at the caller's tensors (CPU or CUDA memory alike), so KV-cache
keys/values are written straight into the runtime's cache buffers and nothing is copied or
allocated per call. The CPU execution provider is the default; with onnxruntime-gpu and a CUDA
device the CUDA execution provider is used, and with `cuda_graphs` it captures each decode-cycle
binding as a CUDA graph (one `gpu_graph_id` each) and replays it.

The backend's 4-bit weight format (`trtspec build --weights int4`, MatMulNBits) is written by
`trtspec.engines.int4`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from trtspec.engines.capture import BindingKey, binding_key
from trtspec.engines.executor import PREFILL, ProfileKey
from trtspec.export.bindings import TARGET
from trtspec.errors import TrtspecError

NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}


def _import_onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise TrtspecError("the onnxruntime backend needs onnxruntime: pip install 'trtspec[onnx]' "
                           "(or 'trtspec[gpu]' for the CUDA execution provider)") from None
    return onnxruntime


def version() -> str:
    return _import_onnxruntime().__version__


def available() -> bool:
    try:
        _import_onnxruntime()
    except TrtspecError:
        return False
    return True


def _options(ort, threads: int, spinning: bool):
    """A session's options. Each session has its own pool of intra-op threads. The target's pool
    spins while it waits for work, so its parallel sections start at once (its graph is most of a
    cycle's time); the drafter's pool sleeps, or the target's spinning threads and its own would take
    turns on the same cores between the two graphs. Measured on a 2-core host (docs/engines.md,
    "Threads"): the target spinning alone took AR 5% faster and speculation 2%, both pools spinning
    speculation 27% slower."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    # Errors only: the float graphs are exported unfolded (export_onnx), and the CPU provider's
    # constant folding says, per node, which CastLike it leaves to run time.
    options.log_severity_level = 3
    return options


class OnnxRuntimeExecutor:
    backend = "onnxruntime"

    def __init__(self, graphs: Mapping[str, Path], device: torch.device, threads: int | None = None,
                 cuda_graphs: bool = False):
        ort = _import_onnxruntime()
        self.device = device
        threads = threads or torch.get_num_threads()
        if device.type == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise TrtspecError("CUDA device requested but this onnxruntime has no CUDA execution provider "
                                   "(install onnxruntime-gpu: pip install 'trtspec[gpu]')")
            cuda_options = {"device_id": device.index or 0}
            if cuda_graphs:
                cuda_options["enable_cuda_graph"] = "1"
            providers = [("CUDAExecutionProvider", cuda_options)]
        else:
            providers = ["CPUExecutionProvider"]
        try:
            self.sessions = {name: ort.InferenceSession(str(path), _options(ort, threads, spinning=name == TARGET),
                                                        providers=providers)
                             for name, path in graphs.items()}
        except Exception as error:  # e.g. a graph with nodes ONNX Runtime keeps on the CPU cannot be captured
            raise TrtspecError(f"ONNX Runtime cannot open the engine's graphs: {error}") from None
        # CUDA graphs: one gpu_graph_id per distinct decode-cycle binding (block size, context count),
        # each with its IOBinding kept, since a captured graph replays on the addresses it was bound to;
        # prefill runs uncaptured (id -1).
        self._graph_ids: dict[BindingKey, tuple] | None = None
        self._uncaptured = None
        if cuda_graphs and device.type == "cuda":
            self._graph_ids = {}
            self._uncaptured = ort.RunOptions()
            self._uncaptured.add_run_config_entry("gpu_graph_id", "-1")
        self._ort = ort
        # One IOBinding per (graph, profile), reused: each run rebinds only the tensors whose shape
        # or address changed (the caches and the slots new keys/values go to), which saves most of
        # the per-tensor binding cost in a decode cycle.
        self._bindings: dict[tuple, tuple] = {}
        self._device_type = "cuda" if device.type == "cuda" else "cpu"
        self._device_id = device.index or 0

    def run(self, graph: str, profile: ProfileKey, inputs: Mapping[str, torch.Tensor],
            outputs: Mapping[str, torch.Tensor]) -> None:
        session = self.sessions[graph]
        if self._graph_ids is not None and profile != PREFILL:
            key = binding_key(graph, profile, inputs, outputs)
            if key not in self._graph_ids:
                options = self._ort.RunOptions()
                options.add_run_config_entry("gpu_graph_id", str(len(self._graph_ids) + 1))
                self._graph_ids[key] = (self._bind(inputs, outputs, session.io_binding(), {}), options)
            binding, options = self._graph_ids[key]
            session.run_with_iobinding(binding, options)
            return
        if (graph, profile) not in self._bindings:
            self._bindings[graph, profile] = (session.io_binding(), {})
        binding, bound = self._bindings[graph, profile]
        session.run_with_iobinding(self._bind(inputs, outputs, binding, bound), self._uncaptured)

    def _bind(self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor], binding, bound: dict):
        """Point `binding` at the caller's tensors; `bound` (what it points at now, by name) lets
        only the tensors that moved be rebound."""
        for names, bind in ((inputs, binding.bind_input), (outputs, binding.bind_output)):
            for name, tensor in names.items():
                where = (tensor.dtype, tuple(tensor.shape), _address(tensor))
                if bound.get(name) != where:
                    bind(name, self._device_type, self._device_id, NUMPY_DTYPES[tensor.dtype], where[1], where[2])
                    bound[name] = where
        return binding


def _address(tensor: torch.Tensor) -> int:
    if not tensor.is_contiguous():
        raise ValueError("ONNX Runtime binds contiguous tensors only")
    return tensor.data_ptr()

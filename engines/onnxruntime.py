"""ONNX Runtime executor: one InferenceSession per graph, inputs and outputs bound in place.

IOBinding points ONNX Runtime at the caller's tensors (CPU or CUDA memory alike), so KV-cache
keys/values are written straight into the runtime's cache buffers and nothing is copied or
allocated per call. The CPU execution provider is the default; with onnxruntime-gpu and a CUDA
device the CUDA execution provider is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from trtspec.engines.executor import ProfileKey
from trtspec.errors import TrtspecError

NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}


def _import_onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise TrtspecError("the onnxruntime backend needs onnxruntime: pip install 'trtspec[onnx]' "
                           "(or 'trtspec[gpu]' for the CUDA execution provider)") from None
    return onnxruntime


def available() -> bool:
    try:
        _import_onnxruntime()
    except TrtspecError:
        return False
    return True


class OnnxRuntimeExecutor:
    backend = "onnxruntime"

    def __init__(self, graphs: Mapping[str, Path], device: torch.device, threads: int | None = None):
        ort = _import_onnxruntime()
        self.device = device
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or torch.get_num_threads()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if device.type == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise TrtspecError("CUDA device requested but this onnxruntime has no CUDA execution provider "
                                   "(install onnxruntime-gpu: pip install 'trtspec[gpu]')")
            providers = [("CUDAExecutionProvider", {"device_id": device.index or 0})]
        else:
            providers = ["CPUExecutionProvider"]
        self.sessions = {name: ort.InferenceSession(str(path), options, providers=providers)
                         for name, path in graphs.items()}
        self._device_type = "cuda" if device.type == "cuda" else "cpu"
        self._device_id = device.index or 0

    def run(self, graph: str, profile: ProfileKey, inputs: Mapping[str, torch.Tensor],
            outputs: Mapping[str, torch.Tensor]) -> None:
        session = self.sessions[graph]
        binding = session.io_binding()
        for name, tensor in inputs.items():
            binding.bind_input(name, self._device_type, self._device_id, NUMPY_DTYPES[tensor.dtype],
                               tuple(tensor.shape), _address(tensor))
        for name, tensor in outputs.items():
            binding.bind_output(name, self._device_type, self._device_id, NUMPY_DTYPES[tensor.dtype],
                                tuple(tensor.shape), _address(tensor))
        session.run_with_iobinding(binding)


def _address(tensor: torch.Tensor) -> int:
    if not tensor.is_contiguous():
        raise ValueError("ONNX Runtime binds contiguous tensors only")
    return tensor.data_ptr()

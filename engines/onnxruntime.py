"""ONNX Runtime executor: one InferenceSession per graph, inputs and outputs bound in place.

IOBinding points ONNX Runtime at the caller's tensors (CPU or CUDA memory alike), so KV-cache
keys/values are written straight into the runtime's cache buffers and nothing is copied or
allocated per call. The CPU execution provider is the default; with onnxruntime-gpu and a CUDA
device the CUDA execution provider is used, and with `cuda_graphs` it captures each decode-cycle
binding as a CUDA graph (one `gpu_graph_id` each) and replays it.

`quantize_weights` is the backend's 4-bit weight format (`trtspec build --weights int4`): ONNX
Runtime's own quantizer rewrites a float graph's constant MatMul weights as MatMulNBits nodes.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from trtspec.engines.capture import BindingKey, binding_key
from trtspec.engines.executor import PREFILL, ProfileKey
from trtspec.errors import TrtspecError

NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}
# What `--weights int4` means: 4-bit weights in blocks of 32 input rows, each block with its own
# scale and zero point (asymmetric, as GGUF's Q4_1), multiplied by MatMulNBits' int8 kernels
# (accuracy level 4: activations quantized to int8 per block, VNNI dot products). Recorded in the
# manifest and in the quantized graph's cache key.
INT4 = {"format": "int4", "bits": 4, "block_size": 32, "symmetric": False, "accuracy_level": 4}


def _import_onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise TrtspecError("the onnxruntime backend needs onnxruntime: pip install 'trtspec[onnx]' "
                           "(or 'trtspec[gpu]' for the CUDA execution provider)") from None
    return onnxruntime


def quantize_weights(source: Path, destination: Path) -> None:
    """Write `source` (a float32 graph) to `destination` with every constant MatMul weight as 4-bit
    blocks (`INT4`), by onnxruntime's `MatMulNBitsQuantizer` (round to nearest per block); the
    embedding table (a Gather) and everything else stay float32."""
    _import_onnxruntime()
    import onnx

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization import matmul_nbits_quantizer
    root.handlers[:], root.level = handlers, level  # its import configures the root logger (INFO, stderr): undone

    model = onnx.load(str(source))
    _untie_transposed_weights(model.graph)
    quantizer = matmul_nbits_quantizer.MatMulNBitsQuantizer(
        model, bits=INT4["bits"], block_size=INT4["block_size"], is_symmetric=INT4["symmetric"],
        accuracy_level=INT4["accuracy_level"], op_types_to_quantize=("MatMul",))
    previous = matmul_nbits_quantizer.logger.level
    matmul_nbits_quantizer.logger.setLevel(logging.WARNING)  # a line per node otherwise
    try:
        quantizer.process()
    finally:
        matmul_nbits_quantizer.logger.setLevel(previous)
    onnx.save_model(quantizer.model.model, str(destination))


def _untie_transposed_weights(graph) -> None:
    """Give a MatMul that multiplies by Transpose(initializer) a transposed copy of its own: a head
    tied to the embedding table is exported that way (the table is also a Gather's input), and the
    quantizer quantizes only a MatMul's constant weights. The table itself stays float32 for the Gather."""
    from onnx import numpy_helper

    initializers = {tensor.name: tensor for tensor in graph.initializer}
    producers = {output: node for node in graph.node for output in node.output}
    for node in graph.node:
        transpose = producers.get(node.input[1]) if node.op_type == "MatMul" else None
        if transpose is None or transpose.op_type != "Transpose" or transpose.input[0] not in initializers:
            continue
        weight = numpy_helper.to_array(initializers[transpose.input[0]])
        perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), None)
        if weight.ndim != 2 or perm not in (None, [1, 0]):
            continue
        name = f"{transpose.input[0]}.transposed"
        if name not in initializers:
            initializers[name] = numpy_helper.from_array(weight.T.copy(), name)
            graph.initializer.append(initializers[name])
        node.input[1] = name
    read = {name for node in graph.node for name in node.input} | {output.name for output in graph.output}
    for node in [n for n in graph.node if n.op_type == "Transpose" and not set(n.output) & read]:
        graph.node.remove(node)  # the transposes the copies replace


def quantizer_identity() -> dict:
    """What a quantized graph depends on besides its float graph: the format, ONNX Runtime's
    quantizer (its version) and this module's code (a cache key's part)."""
    return {**INT4, "onnxruntime": version(), "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}


def version() -> str:
    return _import_onnxruntime().__version__


def available() -> bool:
    try:
        _import_onnxruntime()
    except TrtspecError:
        return False
    return True


class OnnxRuntimeExecutor:
    backend = "onnxruntime"

    def __init__(self, graphs: Mapping[str, Path], device: torch.device, threads: int | None = None,
                 cuda_graphs: bool = False):
        ort = _import_onnxruntime()
        self.device = device
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or torch.get_num_threads()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Idle pool threads sleep rather than spin: between graph runs the decode loop's host work
        # (controller, torch ops) needs those cores, and spinning threads take them (how much:
        # docs/benchmarks.md, "A new user's bench").
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # Errors only: the float graphs are exported unfolded (export_onnx), and the CPU provider's
        # constant folding says, per node, which CastLike it leaves to run time.
        options.log_severity_level = 3
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
            self.sessions = {name: ort.InferenceSession(str(path), options, providers=providers)
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

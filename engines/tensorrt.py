"""TensorRT: one engine per graph with one optimization profile per block size, and its executor.

The profile table is plain data computed from the graph bindings; it is written to the manifest
and unit-tested everywhere. Building and running need the `tensorrt` package (TensorRT 10/11) and
a CUDA GPU; without them `available()` is False and nothing here is called.

Target profiles: "prefill" (any prompt length, nothing cached), 1 (autoregressive step) and one
per block size B with the token axis pinned to B (min = opt = max), so TensorRT tunes kernels for
exactly the shapes each block size replays. Draft profiles: one per block size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from trtspec.engines.capture import CudaGraphs, binding_key
from trtspec.engines.executor import PREFILL, ProfileKey
from trtspec.errors import TrtspecError
from trtspec.export.bindings import DRAFT, MAX_BLOCK_SIZE, TARGET, GraphSpec

PREFILL_OPT_TOKENS = 256


def available() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def profile_keys(block_sizes: list[int]) -> dict[str, list[ProfileKey]]:
    """The ordered profiles of each graph: their index is the TensorRT profile index."""
    return {TARGET: [PREFILL, 1, *block_sizes], DRAFT: list(block_sizes)}


def _axis_ranges(graph: str, key: ProfileKey, max_context: int, max_batch: int) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of each dynamic axis under one profile. Prefill (a chunk of a prompt, maybe
    after earlier chunks; short prompts of one length together) and decode calls batch up to
    `max_batch` requests; the cache buffers hold `max_batch` slots."""
    capacity = max_context + MAX_BLOCK_SIZE
    half = max(1, max_context // 2)
    batch = (1, max(1, max_batch // 2), max_batch)
    slots = {"slots": (1, max_batch, max_batch)}
    if graph == TARGET and key == PREFILL:
        tokens = (1, min(PREFILL_OPT_TOKENS, max_context), max_context)
        return {"batch": (1, 1, max_batch), "tokens": tokens, "past": (0, 0, capacity),
                "positions": (1, tokens[1], max_batch * max_context), "scored": (1, 1, max_batch * max_context),
                **slots}
    if graph == TARGET:  # a decode call computes and scores the same positions
        positions = (1, batch[1] * key, max_batch * key)
        return {"batch": batch, "tokens": (key, key, key), "past": (1, half, capacity),
                "positions": positions, "scored": positions, **slots}
    return {"batch": batch, "block": (key, key, key), "context": (1, key, max_context), "past": (0, half, capacity),
            **slots}


def profile_table(specs: Mapping[str, GraphSpec], block_sizes: list[int], max_context: int,
                  max_batch: int = 1) -> dict:
    """{graph: [{"key", "shapes": {input: {"min", "opt", "max"}}}]} for every dynamic input."""
    table = {}
    for graph, keys in profile_keys(block_sizes).items():
        spec, profiles = specs[graph], []
        for key in keys:
            axes = _axis_ranges(graph, key, max_context, max_batch)
            shapes = {}
            for tensor in spec.inputs:
                if any(isinstance(d, str) for d in tensor.dims):
                    shapes[tensor.name] = {
                        bound: [axes[d][i] if isinstance(d, str) else d for d in tensor.dims]
                        for i, bound in enumerate(("min", "opt", "max"))}
            profiles.append({"key": key, "shapes": shapes})
        table[graph] = profiles
    return table


def _import_tensorrt():
    try:
        import tensorrt
    except ImportError:
        raise TrtspecError("the tensorrt backend needs TensorRT 10+ and a CUDA GPU: pip install 'trtspec[tensorrt]'") from None
    if not torch.cuda.is_available():
        raise TrtspecError("the tensorrt backend needs a CUDA GPU; none is visible")
    return tensorrt


def build_plan(onnx_path: Path, plan_path: Path, profiles: list[dict], timing_cache: Path | None = None) -> None:
    """Compile one ONNX graph into a serialized engine with the given optimization profiles.

    The network is strongly typed: precisions are the ONNX graph's (exported in the engine dtype),
    not chosen by TensorRT. A timing cache, when given, is read and written back so rebuilds
    (other block sizes, other checkpoints of the same shapes) skip kernel timing.
    """
    trt = _import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise TrtspecError(f"TensorRT cannot parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    cache_bytes = timing_cache.read_bytes() if timing_cache is not None and timing_cache.is_file() else b""
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, ignore_mismatch=True)
    for entry in profiles:
        profile = builder.create_optimization_profile()
        for name, shape in entry["shapes"].items():
            profile.set_shape(name, shape["min"], shape["opt"], shape["max"])
        config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise TrtspecError(f"TensorRT failed to build {onnx_path.name} (see the log above)")
    plan_path.write_bytes(bytes(serialized))
    if timing_cache is not None:
        timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))


class TensorRTExecutor:
    """One execution context per optimization profile, all on one non-default CUDA stream."""

    backend = "tensorrt"

    def __init__(self, plans: Mapping[str, Path], device: torch.device, profiles: Mapping[str, list[ProfileKey]],
                 cuda_graphs: bool = False):
        trt = _import_tensorrt()
        self.device = device
        # One captured graph per (profile, bindings): a context per profile, so each block size's
        # draft and verify replay their own graph.
        self.cuda_graphs = CudaGraphs(device) if cuda_graphs else None
        self.stream = torch.cuda.Stream(device)
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engines, self.contexts = {}, {}
        for graph, path in plans.items():
            engine = self._runtime.deserialize_cuda_engine(Path(path).read_bytes())
            if engine is None:
                raise TrtspecError(f"TensorRT cannot load {path} (built by another TensorRT version or GPU?); "
                                   "rebuild the engine")
            contexts = {}
            for index, key in enumerate(profiles[graph]):
                context = engine.create_execution_context()
                context.set_optimization_profile_async(index, self.stream.cuda_stream)
                contexts[key] = context
            self.engines[graph], self.contexts[graph] = engine, contexts
        self.stream.synchronize()

    def run(self, graph: str, profile: ProfileKey, inputs: Mapping[str, torch.Tensor],
            outputs: Mapping[str, torch.Tensor]) -> None:
        context = self.contexts[graph][profile]
        for name, tensor in inputs.items():
            context.set_input_shape(name, tuple(tensor.shape))
            context.set_tensor_address(name, tensor.data_ptr())
        for name, tensor in outputs.items():
            context.set_tensor_address(name, tensor.data_ptr())
        if self.cuda_graphs is not None and profile != PREFILL:
            def launch() -> None:  # on the current stream: the side stream while warming up, then the capture's
                if not context.execute_async_v3(torch.cuda.current_stream(self.device).cuda_stream):
                    raise RuntimeError(f"TensorRT failed to run {graph} under profile {profile!r}")

            self.cuda_graphs.run(binding_key(graph, profile, inputs, outputs), launch)
            return
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError(f"TensorRT failed to run {graph} under profile {profile!r}")
        caller.wait_stream(self.stream)

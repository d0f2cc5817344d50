"""The decode loop's runner over an engine's compiled step graphs (ONNX Runtime, TensorRT, torch.export).

It offers the same calls as the eager runner (reset / prefill / verify / draft / rollback) and
turns each into one graph run. It owns the KV caches: position-major buffers allocated once
at their full size, whose valid prefix is passed as `past_*` and whose next slots receive the
graph's `new_*` outputs directly, so rolling back is just remembering a shorter length.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trtspec.engines.executor import PREFILL, TORCH_DTYPES, Executor, ProfileKey
from trtspec.errors import TrtspecError
from trtspec.export.bindings import DRAFT, MAX_BLOCK_SIZE, PREFILL_LOGITS, TARGET, GraphSpec
from trtspec.engines.manifest import Manifest, read_manifest
from trtspec.runtime.memory import cache_bytes, check_cache_fits


class CompiledRunner:
    def __init__(self, executor: Executor, manifest: Manifest, static: bool = False):
        self.executor, self.manifest = executor, manifest
        # Static mode, for CUDA-graph replay: every decode-cycle binding keeps one address. `past` is
        # the whole fixed-size cache (stale slots are masked), inputs are copied into buffers kept per
        # (graph, block size, context count), and new keys/values are staged, then copied into place.
        self.static = static
        self._bound: dict[tuple, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
        self._buffers: dict[int, tuple[torch.Tensor, int]] = {}  # block buffers seen: (tensor, length)
        self.device = executor.device
        self.dtype = TORCH_DTYPES[manifest.dtype]
        self.max_context = manifest.max_context
        self.block_sizes = tuple(manifest.block_sizes)
        self.mask_token_id: int | None = manifest.drafter.mask_token_id
        self.specs: dict[str, GraphSpec] = manifest.specs()
        capacity = manifest.max_context + MAX_BLOCK_SIZE
        # One request: the graphs' batch and slot axes are 1 (trtspec.runtime.runners.batched runs many).
        shapes = {graph: (capacity, 1, *spec.input("past_k").dims[2:]) for graph, spec in self.specs.items()}
        check_cache_fits(1, cache_bytes(shapes.values(), self.dtype), manifest.max_context, self.device)
        self._caches = {graph: [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2)]
                        for graph, shape in shapes.items()}
        self._length = {TARGET: 0, DRAFT: 0}
        self._start = torch.zeros(1, dtype=torch.long, device=self.device)
        self._slot = torch.zeros(1, dtype=torch.long, device=self.device)
        self._count = torch.zeros(1, dtype=torch.long, device=self.device)
        # On the CPU the start position is written through a numpy view: a torch call per graph run
        # costs more than the rest of the cycle's bookkeeping.
        self._start_host = self._start.numpy() if self.device.type == "cpu" else None
        self._count_host = self._count.numpy() if self.device.type == "cpu" else None
        self._outputs: dict[tuple[str, ProfileKey], dict[str, torch.Tensor]] = {}

    def without_drafter(self) -> "CompiledRunner":
        """The same graphs and buffers used autoregressively (the AR baseline)."""
        baseline = CompiledRunner.__new__(CompiledRunner)
        baseline.__dict__.update(self.__dict__)
        baseline.mask_token_id = None
        return baseline

    def reset(self, positions: int) -> None:
        if positions > self.max_context:
            raise TrtspecError(f"a request of {positions} positions does not fit the engine's context "
                               f"of {self.max_context}")
        self._length = {TARGET: 0, DRAFT: 0}

    def _run(self, graph: str, profile: ProfileKey, start: int, count: int, sizes: dict[str, int],
             inputs: dict[str, torch.Tensor], into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Run `graph` for `count` new cache positions written at `start` (static output buffers per
        shape, or the caller's tensors named in `into`)."""
        if self.static and profile != PREFILL:
            return self._run_static(graph, profile, start, count, sizes, inputs)
        spec = self.specs[graph]
        cache_k, cache_v = self._caches[graph]
        cached = self._length[graph]
        if self._start_host is not None:
            self._start_host[0] = start
        else:
            self._start.fill_(start)
        inputs = {**inputs, "starts": self._start, "slots": self._slot, "past_k": cache_k[:cached],
                  "past_v": cache_v[:cached]}
        # Output shapes are fixed per profile (B tokens, B-1 proposals), so each profile keeps one
        # set of buffers; a prompt's length varies, so prefill outputs are allocated per request.
        outputs = self._outputs.get((graph, profile))
        if outputs is None:
            outputs = {t.name: torch.empty(t.shape(sizes), dtype=TORCH_DTYPES.get(t.dtype, self.dtype),
                                           device=self.device)
                       for t in spec.outputs if not t.name.startswith("new_")}
            if profile != PREFILL:
                self._outputs[(graph, profile)] = outputs
        outputs = {**outputs, **(into or {}), "new_k": _as_row(cache_k[cached:cached + count]),
                   "new_v": _as_row(cache_v[cached:cached + count])}
        self.executor.run(graph, profile, inputs, outputs)
        self._length[graph] = cached + count
        return outputs

    def _run_static(self, graph: str, profile: ProfileKey, start: int, count: int, sizes: dict[str, int],
                    inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`_run` over fixed addresses: what the executor's CUDA graphs capture once and replay."""
        cache_k, cache_v = self._caches[graph]
        key = (graph, profile, count)
        if key not in self._bound:
            static_inputs = {name: torch.empty_like(tensor) for name, tensor in inputs.items()}
            static_inputs.update(starts=self._start, slots=self._slot, past_k=cache_k, past_v=cache_v)
            outputs = {t.name: torch.empty(t.shape(sizes), dtype=TORCH_DTYPES.get(t.dtype, self.dtype),
                                           device=self.device) for t in self.specs[graph].outputs}
            self._bound[key] = static_inputs, outputs
        static_inputs, outputs = self._bound[key]
        for name, tensor in inputs.items():
            static_inputs[name].copy_(tensor, non_blocking=True)
        self._start.fill_(start)
        self.executor.run(graph, profile, static_inputs, outputs)
        first = self._length[graph]
        _as_row(cache_k[first:first + count]).copy_(outputs["new_k"])
        _as_row(cache_v[first:first + count]).copy_(outputs["new_v"])
        self._length[graph] = first + count
        return outputs

    def _tokens(self, tokens: list[int] | torch.Tensor) -> tuple[torch.Tensor, int]:
        """Contiguous token ids on the engine's device (such a tensor is used in place) and their count.

        The decode loop passes the same block buffers every cycle, so a buffer's check is kept: on
        a CPU cycle, each torch call costs about as much as the controller's whole step.
        """
        known = self._buffers.get(id(tokens))
        if known is not None and known[0] is tokens:
            return tokens, known[1]
        on_device = torch.as_tensor(tokens, dtype=torch.long, device=self.device).contiguous()
        if on_device is tokens:
            if len(self._buffers) >= 8:
                self._buffers.clear()
            self._buffers[id(tokens)] = (tokens, len(tokens))
        return on_device, len(on_device)

    def prefill(self, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of the last PREFILL_LOGITS prompt positions [<=PREFILL_LOGITS, V] and the drafter
        features of every prompt position [P, F]."""
        tokens, size = self._tokens(prompt)
        out = self._run(TARGET, PREFILL, 0, size, _ONE | {"tokens": size}, {"tokens": tokens[None]})
        return out["logits"][0, -PREFILL_LOGITS:], out["features"][0]

    def verify(self, block: list[int] | torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, V] and drafter features [B, F] of `block` placed at start..start+B-1."""
        if start != self._length[TARGET]:
            raise ValueError(f"verify at {start} but the target cache holds {self._length[TARGET]} positions")
        tokens, size = self._tokens(block)
        out = self._run(TARGET, size, start, size, _ONE | {"tokens": size}, {"tokens": tokens[None]})
        return out["logits"][0], out["features"][0]

    def draft(self, context_features: torch.Tensor, block: list[int] | torch.Tensor, start: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy proposals [B-1] for block positions 1..B-1, written into `out` when given (the graph
        writes them there directly when `out` is a contiguous tensor on the engine's device)."""
        count = context_features.shape[0]
        if start - count != self._length[DRAFT]:
            raise ValueError(f"context starts at {start - count} but the drafter cache holds {self._length[DRAFT]}")
        tokens, size = self._tokens(block)
        direct = out is not None and not self.static and self._tokens(out)[0] is out
        if self._count_host is not None:
            self._count_host[0] = count
        else:
            self._count.fill_(count)
        sizes = _ONE | {"context": count, "proposals": size - 1}
        inputs = {"context": context_features[None], "counts": self._count, "block": tokens[None]}
        drafts = self._run(DRAFT, size, start, count, sizes, inputs, {"drafts": out[None]} if direct else None)["drafts"][0]
        return out.copy_(drafts) if out is not None and not direct else drafts

    def rollback(self, length: int) -> None:
        """Forget target cache entries at positions >= length (rejected drafts)."""
        if not 0 <= length <= self._length[TARGET]:
            raise ValueError(f"cannot roll the target cache of length {self._length[TARGET]} back to {length}")
        self._length[TARGET] = length


_ONE = {"batch": 1, "slots": 1}


def _as_row(positions: torch.Tensor) -> torch.Tensor:
    """Cache positions [T, 1, ...] of the one slot as the graphs' new keys/values [1, T, ...] (same memory)."""
    return positions.view(1, positions.shape[0], *positions.shape[2:])


def open_runner(directory: str | Path, device: torch.device, threads: int | None = None,
                cuda_graphs: bool = False) -> CompiledRunner:
    """Load a built engine directory (manifest verified) onto `device` with its backend's executor;
    with `cuda_graphs` on a CUDA device, decode cycles replay captured CUDA graphs."""
    cuda_graphs = cuda_graphs and device.type == "cuda"
    directory = Path(directory)
    manifest = read_manifest(directory)
    graphs = {graph: directory / info["file"] for graph, info in manifest.graphs.items()}
    if manifest.backend == "onnxruntime":
        from trtspec.engines.onnxruntime import OnnxRuntimeExecutor
        executor = OnnxRuntimeExecutor(graphs, device, threads, cuda_graphs=cuda_graphs)
    elif manifest.backend == "tensorrt":
        from trtspec.engines.tensorrt import TensorRTExecutor
        executor = TensorRTExecutor(graphs, device, manifest.profiles, cuda_graphs=cuda_graphs)
    elif manifest.backend == "torch":
        from trtspec.engines.torch import TorchExecutor
        executor = TorchExecutor.load(graphs, device, manifest.specs(), cuda_graphs=cuda_graphs)
    else:
        raise TrtspecError(f"engine {directory}: unknown backend {manifest.backend!r}")
    return CompiledRunner(executor, manifest, static=cuda_graphs)

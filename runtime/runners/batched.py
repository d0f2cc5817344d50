"""The batched runner: one draft or verify call for a group of requests, each in its own cache slot.

It runs the same step graphs as the single-request runners (`trtspec.export.steps`), through any
executor: the eager step modules (`TorchExecutor` over them, so eager and compiled batching share
every line), or a built engine's ONNX Runtime / TensorRT / torch.export graphs. The KV caches are
preallocated once, [positions, slots, layers, kv_heads, head_dim] per graph; a request owns a
slot from admission to its end, and what its slot holds is implied by its position: the target
cache is valid below the request's start, the drafter cache below the start of the context it
has not seen yet. So nothing is ever rolled back: rejected drafts' keys are simply overwritten.
"""

from __future__ import annotations

import torch

from trtspec.engines.executor import PREFILL, TORCH_DTYPES, Executor, ProfileKey
from trtspec.export.bindings import DRAFT, MAX_BLOCK_SIZE, TARGET, GraphSpec
from trtspec.runtime.memory import cache_bytes, check_cache_fits

SHORT_CONTEXT = 32  # draft rows with at most this many new context entries share a (padded) call


class BatchRunner:
    def __init__(self, executor: Executor, specs: dict[str, GraphSpec], dtype: torch.dtype, slots: int,
                 max_context: int, block_sizes: tuple[int, ...] | None, mask_token_id: int | None,
                 static: bool = False):
        self.executor, self.specs, self.dtype, self.slots = executor, specs, dtype, slots
        # Static mode, for CUDA-graph replay: decode calls read the whole cache buffer as `past` (stale
        # entries are masked) and their inputs are copied into buffers kept per shape, so every
        # binding of a (graph, block size, batch, context width) call keeps its address.
        self.static = static
        self._static_inputs: dict[tuple, dict[str, torch.Tensor]] = {}
        self.device = executor.device
        self.max_context, self.block_sizes, self.mask_token_id = max_context, block_sizes, mask_token_id
        capacity = max_context + MAX_BLOCK_SIZE
        shapes = {graph: (capacity, slots, *spec.input("past_k").dims[2:]) for graph, spec in specs.items()}
        check_cache_fits(slots, cache_bytes(shapes.values(), dtype) // slots, max_context, self.device)
        self._caches = {graph: [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(2)]
                        for graph, shape in shapes.items()}
        self._outputs: dict[tuple, dict[str, torch.Tensor]] = {}

    @classmethod
    def eager(cls, target, drafter, slots: int, cuda_graphs: bool = False,
              max_context: int | None = None) -> "BatchRunner":
        """The PyTorch modules, batched: the step modules the engines are exported from, run as they are
        (caches for `max_context` positions per slot; default: the target's maximum)."""
        from trtspec.engines.torch import TorchExecutor
        from trtspec.export.bindings import draft_graph, target_graph
        from trtspec.export.steps import DraftStep, TargetStep

        layers = tuple(drafter.config.target_layer_ids) if drafter is not None else ()
        modules = {TARGET: TargetStep(target, layers).eval()}
        specs = {TARGET: target_graph(target.config, len(layers))}
        if drafter is not None:
            modules[DRAFT], specs[DRAFT] = DraftStep(drafter).eval(), draft_graph(drafter.config)
        executor = TorchExecutor(modules, target.device, specs, cuda_graphs=cuda_graphs)
        return cls(executor, specs, target.dtype, slots, max_context or target.config.max_position_embeddings, None,
                   drafter.config.mask_token_id if drafter is not None else None,
                   static=cuda_graphs and target.device.type == "cuda")

    @classmethod
    def compiled(cls, runner, slots: int) -> "BatchRunner":
        """A built engine's graphs (the executor a `CompiledRunner` opened), batched."""
        return cls(runner.executor, runner.specs, runner.dtype, slots, runner.max_context, runner.block_sizes,
                   runner.mask_token_id, static=runner.static)

    def _run(self, graph: str, profile: ProfileKey, sizes: dict[str, int], past: int,
             inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        cache_k, cache_v = self._caches[graph]
        key = (graph, profile, tuple(sorted(sizes.items())))
        outputs = self._outputs.get(key)
        if outputs is None:
            outputs = {t.name: torch.empty(t.shape(sizes), dtype=TORCH_DTYPES.get(t.dtype, self.dtype),
                                           device=self.device) for t in self.specs[graph].outputs}
            if profile != PREFILL:  # decode shapes recur; prompt chunks vary
                self._outputs[key] = outputs
        if self.static and profile != PREFILL:
            bound = self._static_inputs.get(key)
            if bound is None:
                bound = self._static_inputs[key] = {name: torch.empty_like(t) for name, t in inputs.items()}
            for name, tensor in inputs.items():
                bound[name].copy_(tensor, non_blocking=True)
            inputs, past = bound, cache_k.shape[0]
        inputs = {**inputs, "past_k": cache_k[:past], "past_v": cache_v[:past]}
        self.executor.run(graph, profile, inputs, outputs)
        return outputs

    def _store(self, graph: str, positions: torch.Tensor, slots: torch.Tensor, outputs: dict[str, torch.Tensor],
               keep: torch.Tensor | None = None) -> None:
        """Write the new keys/values [b, n, ...] at positions [b, n] of slots [b] (rows where `keep`)."""
        cache_k, cache_v = self._caches[graph]
        rows = slots[:, None].expand_as(positions)
        new_k, new_v = outputs["new_k"], outputs["new_v"]
        if keep is not None:
            positions, rows, new_k, new_v = positions[keep], rows[keep], new_k[keep], new_v[keep]
        cache_k[positions, rows] = new_k
        cache_v[positions, rows] = new_v

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def prefill(self, slots: list[int], chunks: list[list[int]], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk of each row's prompt, all of one length T, at its start (earlier chunks already
        cached): logits [b, T, V] and drafter features [b, T, F]."""
        tokens, start_ids, slot_ids = self._long(chunks), self._long(starts), self._long(slots)
        batch, count = tokens.shape
        out = self._run(TARGET, PREFILL, {"batch": batch, "tokens": count, "slots": self.slots}, max(starts),
                        {"tokens": tokens, "starts": start_ids, "slots": slot_ids})
        self._store(TARGET, start_ids[:, None] + torch.arange(count, device=self.device), slot_ids, out)
        return out["logits"], out["features"]

    def verify(self, slots: list[int], blocks: torch.Tensor, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [b, B, V] and drafter features [b, B, F] of each row's block at its start (B = 1: AR steps)."""
        batch, size = blocks.shape
        slot_ids, start_ids = self._long(slots), self._long(starts)
        out = self._run(TARGET, size, {"batch": batch, "tokens": size, "slots": self.slots}, max(starts),
                        {"tokens": blocks.to(self.device), "starts": start_ids, "slots": slot_ids})
        self._store(TARGET, start_ids[:, None] + torch.arange(size, device=self.device), slot_ids, out)
        return out["logits"], out["features"]

    def draft(self, slots: list[int], contexts: list[torch.Tensor], blocks: torch.Tensor,
              starts: list[int]) -> torch.Tensor:
        """Greedy proposals [b, B-1]. Row r's context [n_r, F] holds the features of the n_r positions
        before its start that its drafter cache lacks (a first cycle: the whole prompt)."""
        counts = [len(c) for c in contexts]
        short = [r for r, n in enumerate(counts) if n <= SHORT_CONTEXT]
        if len(short) == len(counts) or len(counts) == 1:
            return self._draft(slots, contexts, blocks, starts)
        drafts = torch.empty(blocks.shape[0], blocks.shape[1] - 1, dtype=torch.long, device=self.device)
        groups = ([short] if short else []) + [[r] for r in range(len(counts)) if counts[r] > SHORT_CONTEXT]
        for rows in groups:  # a long context (a prompt) is drafted alone rather than padding every row to it
            drafts[rows] = self._draft([slots[r] for r in rows], [contexts[r] for r in rows], blocks[rows],
                                       [starts[r] for r in rows])
        return drafts

    def _draft(self, slots: list[int], contexts: list[torch.Tensor], blocks: torch.Tensor,
               starts: list[int]) -> torch.Tensor:
        batch, size = blocks.shape
        counts = [len(c) for c in contexts]
        width = max(counts)
        padded = contexts[0].new_zeros(batch, width, contexts[0].shape[-1])
        for row, context in enumerate(contexts):
            padded[row, width - len(context):] = context
        slot_ids, start_ids, count_ids = self._long(slots), self._long(starts), self._long(counts)
        sizes = {"batch": batch, "context": width, "block": size, "proposals": size - 1, "slots": self.slots}
        out = self._run(DRAFT, size, sizes, max(s - n for s, n in zip(starts, counts)),
                        {"context": padded, "counts": count_ids, "block": blocks.to(self.device),
                         "starts": start_ids, "slots": slot_ids})
        offsets = torch.arange(width, device=self.device)
        self._store(DRAFT, start_ids[:, None] - width + offsets, slot_ids, out,
                    keep=offsets[None, :] >= (width - count_ids)[:, None])
        return out["drafts"]

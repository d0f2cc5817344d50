"""The runner: one draft or verify call for a group of requests, each in its own cache slot.

It runs the step graphs (`trtspec.export.steps`) through any executor: the eager step modules
(`TorchExecutor` over them, so eager and compiled decoding share every line), or a built engine's
ONNX Runtime / TensorRT / torch.export / AOTInductor graphs (`BatchRunner.open`). The KV caches are
preallocated once, [positions, slots, layers, kv_heads, head_dim] per graph (an ONNX Runtime CPU
target's per layer instead, updated in place by the graph: `export.ort_target`, `_target_in_place`);
a request owns a slot from admission to its end, and what its slot holds is implied by its
position: the target cache is valid below the request's start, the drafter cache below the start
of the context it has not seen yet. So nothing is ever rolled back: rejected drafts' keys are simply overwritten.

Every call, of one request or of many, takes the same path. Its index and token inputs are
staged in buffers kept per shape (on the CPU written through numpy views: for a small model a
torch call per input costs about as much as the controller's whole step), and decode outputs
are buffers kept per shape too, so a cycle allocates nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from trtspec.engines.executor import PREFILL, TORCH_DTYPES, Executor, ProfileKey
from trtspec.errors import TrtspecError
from trtspec.export.bindings import DRAFT, IN_PLACE, MAX_BLOCK_SIZE, SHARED, TARGET, GraphSpec
from trtspec.runtime.memory import cache_bytes, check_cache_fits

PACKING = ("computed", "scored")  # the target's index inputs into its own positions (not per row)
SHORT_CONTEXT = 32  # draft rows with at most this many new context entries share a (padded) call
# Static mode pads a call's batch to one of these (vLLM's and SGLang's capture sizes), so one CUDA
# graph per (graph, block size, bucket) serves every batch; beyond the last, multiples of it.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket(count: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int:
    """The smallest bucket that holds `count` (a multiple of the largest beyond it)."""
    for size in buckets:
        if count <= size:
            return size
    return -(-count // buckets[-1]) * buckets[-1]


def context_bucket(count: int) -> int:
    """A draft call's context width in static mode: the next power of two, so the widths a request
    meets (1..B after its first cycle, its prompt once) take a handful of graphs."""
    return 1 << max(count - 1, 0).bit_length()


def _cache_shape(spec: GraphSpec, capacity: int, slots: int) -> tuple[int, ...]:
    """A graph's key (and value) buffer: shared, [capacity, slots, layers, kv_heads, head_dim]; in
    place, [layers, slots, kv_heads, capacity, head_dim] (each layer's [slots, ...] a block of rows
    that a call's contiguous slots are bound to as they lie)."""
    if spec.cache == SHARED:
        return (capacity, slots, *spec.input("past_k").dims[2:])
    layers = sum(t.name.startswith("past_k.") for t in spec.inputs)
    _, kv_heads, _, head_dim = spec.input("past_k.0").dims
    return (layers, slots, kv_heads, capacity, head_dim)


def _built_draft_ids(directory: Path, manifest) -> torch.Tensor | None:
    """The ids a built draft graph proposes among (its draft vocabulary), from the counts shipped
    with it, checked against the digest the graph was built with; None: the whole vocabulary."""
    info = manifest.draft_vocab
    if not info:
        return None
    from trtspec.models.draft_vocab import ids_sha256, load_counts

    ids = load_counts(directory / info["dir"], manifest.target.vocab_size).top_ids(info["size"])
    if ids_sha256(ids) != info["ids_sha256"]:
        raise TrtspecError(f"{directory}: the draft vocabulary's counts do not give the ids its draft graph "
                           "was built with (manifest draft_vocab.ids_sha256); rebuild the engine")
    return ids


class BatchRunner:
    def __init__(self, executor: Executor, specs: dict[str, GraphSpec], dtype: torch.dtype, slots: int,
                 max_context: int, block_sizes: tuple[int, ...] | None, mask_token_id: int | None,
                 static: bool = False, manifest=None, draft_ids: torch.Tensor | None = None):
        self.executor, self.specs, self.dtype, self.slots = executor, specs, dtype, slots
        # the full-vocabulary ids of the draft graph's proposal logits (its draft vocabulary; None: all)
        self.draft_ids = None if draft_ids is None else draft_ids.to(executor.device)
        self.manifest = manifest  # a built engine's (trtspec.engines.manifest), None for eager modules
        # Static mode, for CUDA-graph replay: decode calls read the whole cache buffer as `past` (stale
        # entries are masked), their rows are padded to a batch bucket and a draft's context to a
        # power-of-two width, and their inputs are copied into buffers kept per shape, so every
        # binding of a (graph, block size, batch bucket, context width) call keeps its address: one
        # graph captured (lazily, at its first call) per such shape. Prompt chunks run uncaptured.
        self.static = static
        self._static_inputs: dict[tuple, dict[str, torch.Tensor]] = {}
        self.device = executor.device
        self.max_context, self.block_sizes, self.mask_token_id = max_context, block_sizes, mask_token_id
        capacity = max_context + MAX_BLOCK_SIZE
        shapes = {graph: _cache_shape(spec, capacity, slots) for graph, spec in specs.items()}
        check_cache_fits(slots, cache_bytes(shapes.values(), dtype) // slots, max_context, self.device)
        self._caches = {graph: [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(2)]
                        for graph, shape in shapes.items()}
        # the shared caches as [slots, positions, ...] views: where a one-slot graph writes its new keys/values
        self._by_slot = {graph: [cache.transpose(0, 1) for cache in caches] for graph, caches in self._caches.items()
                         if specs[graph].cache == SHARED}
        self._in_place = specs[TARGET].cache == IN_PLACE
        self.ragged = self._in_place  # a verify call's shorter rows cost only their own positions (attention too)
        self._layer_views: dict[tuple[int, int], tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
        self._outputs: dict[tuple, dict[str, torch.Tensor]] = {}
        self._staged: dict[tuple, tuple[torch.Tensor, np.ndarray | None]] = {}
        self._cpu = self.device.type == "cpu"

    # ---- making one --------------------------------------------------------------------------------

    @classmethod
    def eager(cls, target, drafter, slots: int, cuda_graphs: bool | None = None,
              max_context: int | None = None) -> "BatchRunner":
        """The PyTorch modules: the step modules the engines are exported from, run as they are
        (caches for `max_context` positions per slot; default: the target's maximum); on a CUDA
        device decode calls are replayed from CUDA graphs unless `cuda_graphs` is False."""
        from trtspec.engines.torch import TorchExecutor
        from trtspec.export.bindings import draft_graph, target_graph
        from trtspec.export.steps import DraftStep, TargetStep

        layers = tuple(drafter.config.target_layer_ids) if drafter is not None else ()
        modules = {TARGET: TargetStep(target, layers).eval()}
        specs = {TARGET: target_graph(target.config, len(layers))}
        if drafter is not None:
            modules[DRAFT], specs[DRAFT] = DraftStep(drafter).eval(), draft_graph(drafter.config, drafter.draft_vocab_size)
        cuda_graphs = target.device.type == "cuda" and cuda_graphs is not False
        executor = TorchExecutor(modules, target.device, specs, cuda_graphs=cuda_graphs)
        return cls(executor, specs, target.dtype, slots, max_context or target.config.max_position_embeddings, None,
                   drafter.config.mask_token_id if drafter is not None else None,
                   static=cuda_graphs, draft_ids=drafter.draft_ids if drafter is not None else None)

    @classmethod
    def open(cls, directory: str | Path, device: torch.device, slots: int = 1, threads: int | None = None,
             cuda_graphs: bool | None = None, max_context: int | None = None) -> "BatchRunner":
        """Load a built engine directory (manifest verified) onto `device` with its backend's executor
        (caches for `max_context` positions per slot, at most the engine's; default: the engine's).
        On a CUDA device decode cycles replay captured CUDA graphs: by default for every backend but
        ONNX Runtime (whose own graph capture refuses graphs with CPU nodes; ask with `cuda_graphs`)."""
        from trtspec.engines.manifest import read_manifest

        directory = Path(directory)
        manifest = read_manifest(directory)
        if cuda_graphs is None:
            cuda_graphs = manifest.backend != "onnxruntime"
        cuda_graphs = cuda_graphs and device.type == "cuda"
        graphs = {graph: directory / info["file"] for graph, info in manifest.graphs.items()}
        if manifest.backend == "onnxruntime":
            from trtspec.engines.onnxruntime import OnnxRuntimeExecutor
            executor = OnnxRuntimeExecutor(graphs, device, threads, cuda_graphs=cuda_graphs)
        elif manifest.backend == "tensorrt":
            from trtspec.engines.tensorrt import TensorRTExecutor
            executor = TensorRTExecutor(graphs, device, manifest.profiles, cuda_graphs=cuda_graphs)
        elif manifest.backend == "torch":
            from trtspec.engines.torch import TorchExecutor
            executor = TorchExecutor.load(graphs, device, manifest.specs(), cuda_graphs=cuda_graphs, digests={
                graph: manifest.artifacts[info["file"]]["sha256"] for graph, info in manifest.graphs.items()})
        elif manifest.backend == "inductor":
            from trtspec.engines.torch import InductorExecutor
            executor = InductorExecutor.load(graphs, device, manifest.specs(), cuda_graphs=cuda_graphs)
        else:
            raise TrtspecError(f"engine {directory}: unknown backend {manifest.backend!r}")
        context = min(max_context, manifest.max_context) if max_context else manifest.max_context
        return cls(executor, manifest.specs(), TORCH_DTYPES[manifest.dtype], slots, context,
                   tuple(manifest.block_sizes), manifest.drafter.mask_token_id, static=cuda_graphs, manifest=manifest,
                   draft_ids=_built_draft_ids(directory, manifest))

    def with_slots(self, slots: int, max_context: int | None = None, drafter: bool = True) -> "BatchRunner":
        """Another runner over the same executor (graphs loaded once) with caches of its own:
        `slots` requests of up to `max_context` positions; without the `drafter`, autoregressive."""
        return BatchRunner(self.executor, self.specs, self.dtype, slots, max_context or self.max_context,
                           self.block_sizes, self.mask_token_id if drafter else None, self.static, self.manifest,
                           self.draft_ids)

    @property
    def host_threads(self) -> int | None:
        """torch's thread count for the decode loop's own work beside this runner's graphs: 1 beside an
        ONNX Runtime engine on a CPU, whose spinning pool owns the cores (torch's pool woken beside it
        stalls both: docs/engines.md, "Threads"); None (the caller's) for eager modules, which compute
        with torch's threads, and on a GPU."""
        return 1 if self._cpu and self.executor.backend == "onnxruntime" else None

    def verify_widths(self, widest: int) -> list[int]:
        """The widths up to `widest` a verify call can run: every one for the eager modules and an
        ONNX Runtime engine (dynamic shapes), else 1 and the block sizes the engine was built for
        (TensorRT's optimization profiles, captured CUDA graphs)."""
        if self.block_sizes is None or (self.executor.backend == "onnxruntime" and not self.static):
            return list(range(1, widest + 1))
        return [1] + [size for size in self.block_sizes if 1 < size <= widest]

    # ---- running a graph ---------------------------------------------------------------------------

    def _run(self, graph: str, profile: ProfileKey, sizes: dict[str, int], past: int, inputs: dict[str, torch.Tensor],
             slots: list[int], new_at: list[int], keep: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Run `graph` over the first `past` cache positions and store its new keys/values [b, n, ...]
        at positions new_at[r]..new_at[r]+n-1 of row r's slot (the rows' positions where `keep`). In
        static mode a decode call's rows are padded to their batch bucket (the padding rows read the
        cache and their outputs are dropped: nothing they compute is stored)."""
        cache_k, cache_v = self._caches[graph]
        rows = sizes["batch"]
        replayed = self.static and profile != PREFILL
        if replayed:
            sizes = {**sizes, "batch": bucket(rows)}
        if replayed and "scored" in sizes:  # a replayed call scores every position of its padded batch
            sizes["scored"] = sizes["batch"] * sizes["tokens"]
        key = (graph, profile, sizes["batch"], sizes.get("context", 0), sizes.get("scored", 0))
        outputs = self._outputs.get(key)
        if outputs is None:
            outputs = {t.name: torch.empty(t.shape(sizes), dtype=TORCH_DTYPES.get(t.dtype, self.dtype),
                                           device=self.device) for t in self.specs[graph].outputs}
            if profile != PREFILL:  # decode shapes recur; prompt chunks vary
                self._outputs[key] = outputs
        if replayed:
            bound = self._static_inputs.get(key)
            if bound is None:  # padding rows: slot 0, start 0, one (zero) context entry
                bound = self._static_inputs[key] = {
                    name: (torch.ones if name == "counts" else torch.zeros)(
                        (sizes["batch"], *t.shape[1:]), dtype=t.dtype, device=self.device)
                    for name, t in inputs.items() if name not in PACKING}
                for name in PACKING:  # a replayed call computes and scores every position of its padded batch
                    if name in inputs:
                        bound[name] = torch.arange(sizes["batch"] * sizes["tokens"], device=self.device)
            for name, tensor in inputs.items():
                if name not in PACKING:
                    bound[name][:rows].copy_(tensor, non_blocking=True)
            inputs, past = dict(bound), cache_k.shape[0]
        inputs["past_k"], inputs["past_v"] = cache_k[:past], cache_v[:past]
        if self.slots == 1 and not replayed and keep is None:
            # One slot: the graph writes its new keys/values into the cache itself, no copy after (a
            # host cost that shows on a small model's batch-1 decode, where a graph takes ~0.25 ms).
            start, end = new_at[0], new_at[0] + outputs["new_k"].shape[1]
            slot_k, slot_v = self._by_slot[graph]
            outputs = {**outputs, "new_k": slot_k[:, start:end], "new_v": slot_v[:, start:end]}
            self.executor.run(graph, profile, inputs, outputs)
            return outputs
        self.executor.run(graph, profile, inputs, outputs)
        if replayed and sizes["batch"] > rows:  # logits are [batch x tokens, V]
            outputs = {name: tensor[:rows * sizes["tokens"] if name == "logits" else rows]
                       for name, tensor in outputs.items()}
        self._store(graph, new_at, slots, outputs, keep)
        return outputs

    def _target_in_place(self, profile: ProfileKey, tokens: torch.Tensor, starts: list[int], slots: list[int],
                         lengths: list[int], scored: list[range]) -> tuple[torch.Tensor, torch.Tensor]:
        """The target on in-place caches (`export.ort_target`) for rows of `lengths` real tokens (the
        rest of tokens [b, T] padding, never run): logits [sum of len(scored), V] of each row's
        `scored` positions, row by row, and features [b, T, F] (zeros at the padding). One call over
        the block of slots from the rows' lowest to their highest, in slot order; a slot in between
        that is not in the call is skipped (no tokens), so its cache is left as it is."""
        batch, width = tokens.shape
        low = min(slots)
        block = max(slots) - low + 1
        row_at = [None] * block  # the caller's row in each slot of the block
        for row, slot in enumerate(slots):
            row_at[slot - low] = row
        reordered = row_at != list(range(batch))
        if reordered:  # not the rows as given: laid out in slot order, gaps skipped
            rows = torch.tensor([r if r is not None else 0 for r in row_at], device=self.device)
            tokens = tokens.index_select(0, rows)
            starts = [starts[r] if r is not None else 0 for r in row_at]
            lengths = [lengths[r] if r is not None else 0 for r in row_at]
        first = np.cumsum([0] + lengths)  # each slot's first packed position
        order = {row: i for i, row in enumerate(row_at) if row is not None}
        picked = [range(first[order[r]] + s.start, first[order[r]] + s.stop) for r, s in enumerate(scored)]
        out = self._call_in_place(profile, tokens, self._long("starts", starts), self._long("lengths", lengths),
                                  self._index("computed", [range(n) for n in lengths], width),
                                  self._index("scored", picked, 0), low)
        features = out["features"]
        if reordered:  # back to the caller's rows
            features = features.index_select(0, torch.tensor([order[r] for r in range(batch)], device=self.device))
        return out["logits"], features

    def _call_in_place(self, profile: ProfileKey, tokens: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                       computed: torch.Tensor, scored: torch.Tensor, slot: int) -> dict[str, torch.Tensor]:
        """One target call for rows in slots slot..slot+b-1: each layer's cache block bound as both its
        past and its present (outputs kept per shape, like `_run`'s)."""
        rows, count = tokens.shape
        key = (TARGET, profile, rows, count, scored.shape[0])
        outputs = self._outputs.get(key)
        if outputs is None:
            sizes = {"batch": rows, "tokens": count, "scored": scored.shape[0]}
            outputs = {t.name: torch.empty(t.shape(sizes), dtype=self.dtype, device=self.device)
                       for t in self.specs[TARGET].outputs if not t.name.startswith("present_")}
            if profile != PREFILL:
                self._outputs[key] = outputs
        bound = self._layer_views.get((slot, rows))
        if bound is None:  # each layer's block of the rows' slots, named as the graph's past and present
            cache_k, cache_v = self._caches[TARGET]
            views = {f"{kind}.{i}": cache[i, slot:slot + rows] for i in range(cache_k.shape[0])
                     for kind, cache in (("k", cache_k), ("v", cache_v))}
            bound = self._layer_views[slot, rows] = ({f"past_{n}": t for n, t in views.items()},
                                                     {f"present_{n}": t for n, t in views.items()})
        past, present = bound
        self.executor.run(TARGET, profile, {"tokens": tokens, "starts": starts, "lengths": lengths,
                                            "computed": computed, "scored": scored, **past}, {**outputs, **present})
        return outputs

    def _store(self, graph: str, starts: list[int], slots: list[int], outputs: dict[str, torch.Tensor],
               keep: torch.Tensor | None = None) -> None:
        """Write the new keys/values [b, count, ...] at positions start..start+count-1 of each row's slot
        (rows' positions where `keep`)."""
        cache_k, cache_v = self._caches[graph]
        new_k, new_v = outputs["new_k"], outputs["new_v"]
        count = new_k.shape[1]
        if len(slots) == 1 and keep is None:  # one strided copy
            start, slot = starts[0], slots[0]
            cache_k[start:start + count, slot].copy_(new_k[0])
            cache_v[start:start + count, slot].copy_(new_v[0])
            return
        positions = self._long("starts", starts)[:, None] + torch.arange(count, device=self.device)
        rows = self._long("slots", slots)[:, None].expand_as(positions)
        if keep is not None:
            positions, rows, new_k, new_v = positions[keep], rows[keep], new_k[keep], new_v[keep]
        cache_k[positions, rows] = new_k
        cache_v[positions, rows] = new_v

    def _long(self, name: str, values: Sequence[int] | Sequence[np.ndarray]) -> torch.Tensor:
        """`values` (integers, or equal-length rows of them) as an int64 tensor on the device, in a
        buffer kept per (name, shape): on the CPU written through a numpy view (a torch call per
        input costs more than the copy)."""
        shape = (len(values), *getattr(values[0], "shape", ()))  # np.shape costs more than the copy
        known = self._staged.get((name, shape))
        if known is None:
            tensor = torch.zeros(shape, dtype=torch.long, device=self.device)
            known = self._staged[name, shape] = tensor, tensor.numpy() if self._cpu else None
        tensor, host = known
        if host is not None:
            if len(values) == 1:
                host[0] = values[0]
            else:
                host[:] = values
        else:
            tensor.copy_(torch.from_numpy(np.asarray(values, dtype=np.int64)), non_blocking=True)
        return tensor

    def _staged_context(self, batch: int, width: int, like: torch.Tensor) -> torch.Tensor:
        """A draft call's context buffer [batch, width, F], kept per shape like the index inputs (its
        address stays put, so an executor need not bind it again)."""
        key = ("context", (batch, width), like.dtype)
        known = self._staged.get(key)
        if known is None:
            known = self._staged[key] = like.new_empty(batch, width, like.shape[-1]), None
        return known[0]

    # ---- the step functions ------------------------------------------------------------------------

    def prefill(self, slots: list[int], chunks: list[list[int]], starts: list[int],
                tail: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk of each row's prompt, all of one length T, at its start (earlier chunks already
        cached): the logits of each row's last min(T, tail) positions [b, min(T, tail), V] (the LM
        head runs on those alone) and drafter features [b, T, F]."""
        tokens = torch.tensor(chunks, dtype=torch.long, device=self.device)
        batch, count = tokens.shape
        scored = min(count, tail)
        if self._in_place:
            last = [range(count - scored, count)] * batch
            logits, features = self._target_in_place(PREFILL, tokens, starts, slots, [count] * batch, last)
            return logits.view(batch, scored, -1), features
        out = self._run(TARGET, PREFILL, {"batch": batch, "tokens": count, "slots": self.slots, "scored": batch * scored},
                        max(starts), {"tokens": tokens, "starts": self._long("starts", starts),
                                      "slots": self._long("slots", slots),
                                      "computed": self._computed([count] * batch, count),
                                      "scored": self._index("scored", [range(count - scored, count)] * batch, count)},
                        slots, starts)
        return out["logits"].view(batch, scored, -1), out["features"]

    def _index(self, name: str, rows: list[range], width: int) -> torch.Tensor:
        """Flat positions (row * width + t for t in rows[row]) as an int64 tensor, kept per content:
        the index inputs of the target graph, whose few shapes recur."""
        key = (name, width, tuple((r.start, r.stop) for r in rows))
        known = self._staged.get(key)
        if known is None:
            if len(self._staged) > 4096:  # shapes recur; mixes of lengths need not: bound what is kept
                self._staged = {k: v for k, v in self._staged.items() if k[0] not in PACKING}
            flat = np.concatenate([row * width + np.arange(r.start, r.stop) for row, r in enumerate(rows)])
            known = self._staged[key] = torch.from_numpy(flat).to(self.device), None
        return known[0]

    def _computed(self, lengths: list[int], width: int) -> torch.Tensor | None:
        """The target graph's `computed` input: the flat positions (row * width + t) of each row's
        first lengths[r] tokens, the rest padding. None for the eager modules when nothing is padded:
        they then run every position without the gathers (dispatch is most of a small model's step)."""
        if self.manifest is None and all(n == width for n in lengths):
            return None
        return self._index("computed", [range(n) for n in lengths], width)

    def verify(self, slots: list[int], blocks: Sequence[np.ndarray],
               starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [b, B, V] and drafter features [b, B, F] of each row's block [B] (int64: the bonus,
        then the drafts) at its start (B = 1: AR steps). Both are buffers the next call of this shape
        overwrites. Blocks shorter than the longest are padded (with their last token), and the
        target computes the real positions only (`computed`: an AR row beside B = 8 ones costs its
        attention over 8 positions, not 8 positions' projections; padding logits are zeros). A row's
        logits at its own positions do not see later ones, and the keys/values the padding writes lie
        past what the row can commit, overwritten before anything reads them."""
        lengths = [len(block) for block in blocks]
        width = max(lengths)
        if any(n != width for n in lengths):
            blocks = [np.pad(block, (0, width - len(block)), mode="edge") for block in blocks]
        tokens = self._long("blocks", blocks)
        batch, size = tokens.shape
        computed, real = self._computed(lengths, width), sum(lengths)
        if self._in_place:
            logits, features = self._target_in_place(size, tokens, starts, slots, lengths, [range(n) for n in lengths])
        else:
            scored = None if computed is None else self._index("scored", [range(real)], 0)  # every computed position
            out = self._run(TARGET, size, {"batch": batch, "tokens": size, "slots": self.slots, "scored": real},
                            max(starts), {"tokens": tokens, "starts": self._long("starts", starts),
                                          "slots": self._long("slots", slots), "computed": computed, "scored": scored},
                            slots, starts)
            logits, features = out["logits"], out["features"]
        if logits.shape[0] == batch * size:  # nothing padded (or a replayed call, which computes the padding)
            return logits.view(batch, size, -1), features
        padded = logits.new_zeros(batch * size, logits.shape[-1]).index_copy_(0, computed, logits)
        return padded.view(batch, size, -1), features

    def draft(self, slots: list[int], contexts: list[torch.Tensor], blocks: Sequence[np.ndarray],
              starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy proposals [b, B-1] and the proposal logits [b, B-1, K] they are the argmax of
        (over `draft_ids`; buffers the next call of this shape overwrites). Row r's context [n_r, F]
        holds the features of the n_r positions before its start that its drafter cache lacks (a
        first cycle: the whole prompt); its block [B] is int64: the bonus, then MASK x (B-1)."""
        staged = self._long("draft_blocks", blocks)
        if len(contexts) == 1:
            return self._draft(slots, contexts, staged, starts)
        counts = [c.shape[0] for c in contexts]
        short = [r for r, n in enumerate(counts) if n <= SHORT_CONTEXT]
        # a long context (a prompt) is drafted alone rather than padding every row to it
        groups = ([short] if short else []) + [[r] for r, n in enumerate(counts) if n > SHORT_CONTEXT]
        if len(groups) == 1:
            return self._draft(slots, contexts, staged, starts)
        drafts = logits = None
        for rows in groups:
            some, their_logits = self._draft([slots[r] for r in rows], [contexts[r] for r in rows], staged[rows],
                                             [starts[r] for r in rows])
            if drafts is None:
                drafts = some.new_empty(staged.shape[0], *some.shape[1:])
                logits = their_logits.new_empty(staged.shape[0], *their_logits.shape[1:])
            drafts[rows], logits[rows] = some, their_logits
        return drafts, logits

    def _draft(self, slots: list[int], contexts: list[torch.Tensor], blocks: torch.Tensor,
               starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        batch, size = blocks.shape
        counts = [c.shape[0] for c in contexts]
        width = context_bucket(max(counts)) if self.static else max(counts)
        keep = None  # the rows' positions to store: not their left padding, when they are padded to the width
        if len(contexts) == 1 and counts[0] == width and contexts[0].is_contiguous():
            padded = contexts[0][None]  # as it is (a view of the verify's features): no copy on the batch-1 path
        elif all(n == width for n in counts):
            padded = self._staged_context(batch, width, contexts[0])
            torch.stack(contexts, out=padded)
        else:
            padded = self._staged_context(batch, width, contexts[0]).zero_()
            for row, context in enumerate(contexts):
                padded[row, width - len(context):] = context
            keep = torch.arange(width, device=self.device)[None, :] >= (width - self._long("counts", counts))[:, None]
        sizes = {"batch": batch, "context": width, "block": size, "proposals": size - 1, "slots": self.slots}
        first = [s - n for s, n in zip(starts, counts)]  # where each row's new context begins
        result = self._run(DRAFT, size, sizes, max(first),
                           {"context": padded, "counts": self._long("counts", counts), "block": blocks,
                            "starts": self._long("starts", starts), "slots": self._long("slots", slots)},
                           slots, [s - width for s in starts], keep)
        return result["drafts"], result["proposal_logits"]

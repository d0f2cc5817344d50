"""The step graphs' inputs and outputs, declared once.

The exporter names graph tensors from these specs, the manifest records them, the TensorRT profile
table reads their dynamic dimensions, and the executors allocate output buffers from them. A
dimension is either a fixed size or the name of a dynamic axis ("tokens", "past", ...); the
runtime gives each dynamic axis its value per call.

Two graphs cover the whole decode loop, for a batch of requests at once:

* `target` runs T tokens per request, row r at positions starts[r]..starts[r]+T-1 over the
  positions its cache slot `slots[r]` holds. One request from position 0 is a prefill (or, from
  a later position, one chunk of it); T = B is verify(B); T = 1 is an autoregressive step.
  Rows of shorter blocks (an AR row beside B = 8 ones) are padded to T, and `computed` lists the
  real positions (flat, row * T + t): the stack runs on those alone, packed (attention alone sees
  the padded rows). `scored` picks, among the computed positions (indices into `computed`), those
  whose logits the call returns, [scored, vocab]: every one for verify, the last for a prompt
  chunk (the LM head over a whole prompt would be a fifth of a small model's prefill).
* `draft` projects each request's new context features into the drafter's cache and proposes
  B-1 tokens for its block [bonus, MASK x (B-1)] starting at starts[r]. Context rows are
  left-padded to the batch's longest: row r's last counts[r] entries are real.

Caches are position-major ([positions, slots, layers, kv_heads, head_dim]): every request owns a
slot, and the valid prefix of the preallocated buffer (up to the longest request) is one
contiguous slice that the graphs read in place. Row r sees only its own slot's positions below
starts[r] (target) or below its context (draft); the rest is masked out, so the graphs also
accept the whole fixed-size buffer, which is what CUDA-graph replay needs. The graphs return
only the keys/values of the new positions; the runtime writes them into the buffer.

ONNX Runtime on the CPU runs the target from a graph written for it instead (`export.ort_target`):
its cache is `in_place`, one buffer per layer, [batch, kv_heads, capacity, head_dim], that the
graph's attention reads and writes where it lies (`target_graph_in_place`).
"""

from __future__ import annotations

from dataclasses import dataclass

from trtspec.limits import MAX_BLOCK_SIZE  # noqa: F401 - the largest block any engine or decode call accepts
from trtspec.models.config import DFlashConfig, Qwen3Config

Dim = int | str
MAX_BATCH = 64  # requests one graph call (and one runtime's cache) may hold
PREFILL_LOGITS = 64  # prefill returns the logits of the prompt's last this-many positions (BlockPilot reads them)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # "int64", "float32" or "model" (the engine's compute dtype)
    dims: tuple[Dim, ...]

    def shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        return tuple(sizes[d] if isinstance(d, str) else d for d in self.dims)


SHARED, IN_PLACE = "shared", "in_place"  # the two KV-cache layouts a graph can read (module docstring)


@dataclass(frozen=True)
class GraphSpec:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    cache: str = SHARED

    def input(self, name: str) -> TensorSpec:
        return next(t for t in self.inputs if t.name == name)

    def to_dict(self) -> dict:
        def tensors(specs):
            return [{"name": t.name, "dtype": t.dtype, "dims": list(t.dims)} for t in specs]
        layout = {} if self.cache == SHARED else {"cache": self.cache}  # shared graphs' cache keys stay as they were
        return {"inputs": tensors(self.inputs), "outputs": tensors(self.outputs), **layout}


TARGET, DRAFT = "target", "draft"


def _cache(config: Qwen3Config) -> tuple[Dim, ...]:
    """A KV cache buffer: [positions, slots, layers, kv_heads, head_dim] (its valid prefix is `past`)."""
    return ("past", "slots", config.num_hidden_layers, config.num_key_value_heads, config.head_dim)


def target_graph(config: Qwen3Config, num_features: int) -> GraphSpec:
    cache = _cache(config)
    new = ("batch", "tokens") + cache[2:]
    return GraphSpec(TARGET, inputs=(
        TensorSpec("tokens", "int64", ("batch", "tokens")),
        TensorSpec("starts", "int64", ("batch",)),
        TensorSpec("slots", "int64", ("batch",)),
        TensorSpec("past_k", "model", cache),
        TensorSpec("past_v", "model", cache),
        TensorSpec("computed", "int64", ("positions",)),
        TensorSpec("scored", "int64", ("scored",)),
    ), outputs=(
        TensorSpec("logits", "model", ("scored", config.vocab_size)),
        TensorSpec("features", "model", ("batch", "tokens", num_features * config.hidden_size)),
        TensorSpec("new_k", "model", new),
        TensorSpec("new_v", "model", new),
    ))


def target_graph_in_place(config: Qwen3Config, num_features: int) -> GraphSpec:
    """The target step of `export.ort_target`: per-layer caches [batch, kv_heads, capacity, head_dim]
    that the graph updates in place (each past_*.i and present_*.i bound to the same buffer); each
    row's real token count in `lengths` (0: a slot the call skips), their flat positions in
    `computed`, and `scored` indexing `computed`, as in the exported graph."""
    cache = ("batch", config.num_key_value_heads, "capacity", config.head_dim)
    layers = range(config.num_hidden_layers)
    return GraphSpec(TARGET, inputs=(
        TensorSpec("tokens", "int64", ("batch", "tokens")),
        TensorSpec("starts", "int64", ("batch",)),
        TensorSpec("lengths", "int64", ("batch",)),
        TensorSpec("computed", "int64", ("positions",)),
        TensorSpec("scored", "int64", ("scored",)),
        *(TensorSpec(f"past_{kind}.{i}", "model", cache) for i in layers for kind in "kv"),
    ), outputs=(
        TensorSpec("logits", "model", ("scored", config.vocab_size)),
        TensorSpec("features", "model", ("batch", "tokens", num_features * config.hidden_size)),
        *(TensorSpec(f"present_{kind}.{i}", "model", cache) for i in layers for kind in "kv"),
    ), cache=IN_PLACE)


def draft_graph(config: DFlashConfig, draft_vocab: int | None = None) -> GraphSpec:
    """`draft_vocab`: K, the ids proposals come from (None: the whole vocabulary)."""
    cache = _cache(config)
    new = ("batch", "context") + cache[2:]
    return GraphSpec(DRAFT, inputs=(
        TensorSpec("context", "model", ("batch", "context", config.num_features * config.hidden_size)),
        TensorSpec("counts", "int64", ("batch",)),
        TensorSpec("block", "int64", ("batch", "block")),
        TensorSpec("starts", "int64", ("batch",)),
        TensorSpec("slots", "int64", ("batch",)),
        TensorSpec("past_k", "model", cache),
        TensorSpec("past_v", "model", cache),
    ), outputs=(
        TensorSpec("drafts", "int64", ("batch", "proposals")),  # proposals = block - 1
        TensorSpec("proposal_logits", "model", ("batch", "proposals", draft_vocab or config.vocab_size)),
        TensorSpec("new_k", "model", new),
        TensorSpec("new_v", "model", new),
    ))


def graph_specs(target: Qwen3Config, drafter: DFlashConfig, draft_vocab: int | None = None) -> dict[str, GraphSpec]:
    return {TARGET: target_graph(target, drafter.num_features), DRAFT: draft_graph(drafter, draft_vocab)}

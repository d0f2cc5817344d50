"""The step graphs' inputs and outputs, declared once.

The exporter names graph tensors from these specs, the manifest records them, the TensorRT profile
table reads their dynamic dimensions, and the executors allocate output buffers from them. A
dimension is either a fixed size or the name of a dynamic axis ("tokens", "past", ...); the
runtime gives each dynamic axis its value per call.

Two graphs cover the whole decode loop:

* `target` runs T tokens at positions start..start+T-1 over `past` cached positions. With past 0
  it is the prefill; with T = B it is verify(B); with T = 1 it is an autoregressive step.
* `draft` projects the new context features into the drafter's cache and proposes B-1 tokens
  for a block [bonus, MASK x (B-1)] starting at `start`.

Caches are position-major ([positions, layers, kv_heads, head_dim]) so that the valid prefix of
a preallocated buffer is one contiguous slice: the graphs read `past` in place and return only
the keys/values of the new positions, which the runtime writes straight into the buffer.
Slots at or after `start` (target) / the context start (draft) are masked out, so the graphs
also accept a whole fixed-size buffer, which is what CUDA-graph replay needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from trtspec.limits import MAX_BLOCK_SIZE  # noqa: F401 - the largest block any engine or decode call accepts
from trtspec.models.config import DFlashConfig, Qwen3Config

Dim = int | str
PREFILL_LOGITS = 64  # prefill returns the logits of the prompt's last this-many positions (BlockPilot reads them)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # "int64", "float32" or "model" (the engine's compute dtype)
    dims: tuple[Dim, ...]

    def shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        return tuple(sizes[d] if isinstance(d, str) else d for d in self.dims)


@dataclass(frozen=True)
class GraphSpec:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def input(self, name: str) -> TensorSpec:
        return next(t for t in self.inputs if t.name == name)

    def to_dict(self) -> dict:
        def tensors(specs):
            return [{"name": t.name, "dtype": t.dtype, "dims": list(t.dims)} for t in specs]
        return {"inputs": tensors(self.inputs), "outputs": tensors(self.outputs)}


TARGET, DRAFT = "target", "draft"


def target_graph(config: Qwen3Config, num_features: int) -> GraphSpec:
    cache = ("past", config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    new = ("tokens",) + cache[1:]
    return GraphSpec(TARGET, inputs=(
        TensorSpec("tokens", "int64", ("tokens",)),
        TensorSpec("start", "int64", (1,)),
        TensorSpec("past_k", "model", cache),
        TensorSpec("past_v", "model", cache),
    ), outputs=(
        TensorSpec("logits", "float32", ("tokens", config.vocab_size)),
        TensorSpec("features", "model", ("tokens", num_features * config.hidden_size)),
        TensorSpec("new_k", "model", new),
        TensorSpec("new_v", "model", new),
    ))


def draft_graph(config: DFlashConfig) -> GraphSpec:
    cache = ("past", config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    new = ("context",) + cache[1:]
    return GraphSpec(DRAFT, inputs=(
        TensorSpec("context", "model", ("context", config.num_features * config.hidden_size)),
        TensorSpec("block", "int64", ("block",)),
        TensorSpec("start", "int64", (1,)),
        TensorSpec("past_k", "model", cache),
        TensorSpec("past_v", "model", cache),
    ), outputs=(
        TensorSpec("drafts", "int64", ("proposals",)),  # proposals = block - 1
        TensorSpec("new_k", "model", new),
        TensorSpec("new_v", "model", new),
    ))


def graph_specs(target: Qwen3Config, drafter: DFlashConfig) -> dict[str, GraphSpec]:
    return {TARGET: target_graph(target, drafter.num_features), DRAFT: draft_graph(drafter)}

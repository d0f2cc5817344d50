"""The decode loop: prefill, then cycles of draft -> verify -> accept -> commit.

Autoregressive decoding is the same loop with a block of one token and no drafter, so both
modes share every line of bookkeeping (stops, limits, statistics) and are compared like for like.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

import torch

from trtspec.export.bindings import MAX_BLOCK_SIZE
from trtspec.policy import AUTO, BlockPilot
from trtspec.errors import TrtspecError
from trtspec.runtime.sampling import Sampler, SamplingConfig, accepted_length
from trtspec.runtime.stats import DecodeStats


@dataclass(frozen=True)
class GenerationConfig:
    """What one request asks for. block_size 1 means autoregressive (target only); AUTO (0) lets
    the BlockPilot policy choose once after prefill."""

    block_size: int = 16
    max_new_tokens: int = 256
    stop_ids: tuple[int, ...] = ()
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        if not (self.block_size == AUTO or 1 <= self.block_size <= MAX_BLOCK_SIZE):
            raise TrtspecError(f"block size must be in [2, {MAX_BLOCK_SIZE}] (or 1 for autoregressive, "
                               f"or auto), got {self.block_size}")
        if self.max_new_tokens < 1:
            raise TrtspecError(f"max new tokens must be >= 1, got {self.max_new_tokens}")

    def with_stop_ids(self, extra: tuple[int, ...]) -> "GenerationConfig":
        """This config with `extra` stop ids added (e.g. the tokenizer's EOS ids)."""
        return replace(self, stop_ids=tuple(dict.fromkeys(self.stop_ids + tuple(extra))))


@dataclass
class Generation:
    tokens: list[int]
    stats: DecodeStats


class _Output:
    """Committed tokens with the stop rules applied: truncate after the first stop id or at the limit."""

    def __init__(self, limit: int, stop_ids: tuple[int, ...], on_commit: Callable[[list[int]], None] | None):
        self.tokens: list[int] = []
        self.limit, self.stop_ids, self.on_commit = limit, set(stop_ids), on_commit
        self.finish_reason = ""

    def commit(self, tokens: list[int]) -> None:
        kept = []
        for token in tokens:
            kept.append(token)
            if token in self.stop_ids:
                self.finish_reason = "stop"
                break
            if len(self.tokens) + len(kept) == self.limit:
                self.finish_reason = "length"
                break
        self.tokens.extend(kept)
        if self.on_commit is not None:
            self.on_commit(kept)


class DecodeEngine(Protocol):
    """What the loop needs from a backend (eager modules or compiled graphs)."""

    device: torch.device
    max_context: int
    mask_token_id: int | None           # None: no drafter, autoregressive only
    block_sizes: tuple[int, ...] | None  # None: any block size

    def reset(self, positions: int) -> None: ...
    def prefill(self, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]: ...  # tail logits, features
    def verify(self, block: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor | None]: ...
    def draft(self, context_features: torch.Tensor, block: list[int], start: int) -> torch.Tensor: ...
    def rollback(self, length: int) -> None: ...


def generate(engine: DecodeEngine, prompt: list[int], config: GenerationConfig,
             on_commit: Callable[[list[int]], None] | None = None, policy: BlockPilot | None = None) -> Generation:
    """Decode one request. `on_commit` receives each batch of newly committed tokens (streaming);
    `policy` chooses the block size after prefill when the config asks for AUTO."""
    block_size = config.block_size
    if not prompt:
        raise TrtspecError("the prompt is empty")
    if len(prompt) >= engine.max_context:
        raise TrtspecError(f"the prompt is {len(prompt)} tokens; the context holds {engine.max_context}")
    if block_size != 1 and engine.mask_token_id is None:
        raise TrtspecError("speculative decoding needs a drafter (or use block size 1 / --ar)")
    if block_size == AUTO and policy is None:
        raise TrtspecError("block size auto needs a BlockPilot policy (trtspec train-policy; then --policy DIR "
                           "or trtspec build --policy DIR)")
    _check_block_size(engine, block_size)
    limit = min(config.max_new_tokens, engine.max_context - len(prompt))
    sampler = Sampler(config.sampling, engine.device)
    out = _Output(limit, config.stop_ids, on_commit)
    engine.reset(len(prompt) + limit)

    with torch.inference_mode():
        began = time.perf_counter()
        prompt_logits, context = engine.prefill(prompt)
        bonus = int(sampler.sample(prompt_logits[-1:])[0])
        prefill_s = time.perf_counter() - began
        out.commit([bonus])
        start = len(prompt)  # position of the bonus token

        began = time.perf_counter()  # the policy's choice counts as decode time
        chosen = block_size == AUTO
        if chosen:
            block_size = policy.choose(context, prompt_logits)
            _check_block_size(engine, block_size)
        stats = DecodeStats(block_size=block_size, prompt_tokens=len(prompt), prefill_s=prefill_s,
                            auto=chosen, policy_s=time.perf_counter() - began if chosen else 0.0)
        masks = [engine.mask_token_id] * (block_size - 1) if block_size > 1 else []
        while not out.finish_reason:
            block = [bonus]
            if masks:
                drafts = engine.draft(context, block + masks, start)
                block += drafts.tolist()
            logits, features = engine.verify(block, start)
            posterior = sampler.sample(logits)
            accepted = int(accepted_length(drafts, posterior)) if masks else 0
            bonus = int(posterior[accepted])
            stats.record_cycle(accepted)
            out.commit(block[1:accepted + 1] + [bonus])
            start += accepted + 1
            engine.rollback(start)
            context = features[:accepted + 1] if features is not None else None
        stats.decode_s = time.perf_counter() - began

    stats.new_tokens = len(out.tokens)
    stats.finish_reason = out.finish_reason
    return Generation(out.tokens, stats)


def _check_block_size(engine: DecodeEngine, block_size: int) -> None:
    if block_size > 1 and engine.block_sizes is not None and block_size not in engine.block_sizes:
        raise TrtspecError(f"the engine was built for block sizes {', '.join(map(str, engine.block_sizes))}; "
                           f"block size {block_size} is not among them (rebuild with --block-sizes)")

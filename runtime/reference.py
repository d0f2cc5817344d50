"""The decode controller in plain Python: the specification the native controller is tested against.

The per-cycle logic written for reading (the acceptance rule on torch tensors, an output that
applies stop ids and the token limit, the histogram of DecodeStats) behind the controller
interface of `trtspec.runtime.controller`, so the same loop can run either: the tests check the
native controller against it cycle by cycle, and `trtspec bench --profile` times the pure-Python
loop beside the native one.
"""

from __future__ import annotations

import numpy as np
import torch

from trtspec.runtime.sampling import greedy_tokens
from trtspec.runtime.schedule import BlockChoice
from trtspec.runtime.stats import DecodeStats


def accepted_length(drafts: torch.Tensor, posterior: torch.Tensor) -> torch.Tensor:
    """How many leading drafts the target agrees with, per row.

    drafts [..., B-1] are the proposals for block positions 1..B-1; posterior [..., B] are the
    target's tokens after block positions 0..B-1. Draft k is accepted while it equals the target's
    token for its position, posterior[k-1]. With greedy (one-hot) proposals this is exactly
    speculative sampling, so the output is distributed as the target's at any temperature.
    """
    matches = (drafts == posterior[..., :-1]).long()
    return matches.cumprod(dim=-1).sum(dim=-1)


class Output:
    """Committed tokens with the stop rules applied: truncate after the first stop id or at the limit."""

    def __init__(self, limit: int, stop_ids: tuple[int, ...]):
        self.tokens: list[int] = []
        self.limit, self.stop_ids = limit, set(stop_ids)
        self.finish_reason = ""

    def commit(self, tokens: list[int]) -> list[int]:
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
        return kept


class PythonController:
    """The controller interface (see trtspec.runtime.controller.Controller) over an Output and
    DecodeStats; its blocks are numpy buffers like the native controller's."""

    def __init__(self, block_size: int, limit: int, stop_ids, mask_token_id: int, grow_to: int = 0):
        self.choice = BlockChoice(block_size, grow_to)
        self.limit, self.stop_ids = limit, tuple(stop_ids)
        width = max(block_size, grow_to)
        self.verify_block = np.zeros(width, dtype=np.int64)
        self.draft_block = np.full(width, mask_token_id, dtype=np.int64)
        self.tokens = np.zeros(limit, dtype=np.int64)  # committed tokens, a buffer callers may hold a view of
        self.output = Output(limit, self.stop_ids)
        self.output.finish_reason = "length"  # not begun: nothing to run
        self.stats = DecodeStats(block_size=block_size, grow_to=grow_to)
        self.block_size = block_size  # the next cycle's
        self.grown_cycles = self.ceilings = self.start = self.accepted = self.committed = self.drafts = 0
        self._narrowed: int | None = None  # the next cycle's width, when narrowed

    def begin(self, token: int, start: int) -> None:
        self.output = Output(self.limit, self.stop_ids)
        self.stats = DecodeStats(block_size=self.choice.size, grow_to=self.choice.grow_to)
        self.block_size = self.choice.size
        self.grown_cycles = self.ceilings = self.accepted = self.drafts = 0
        self._narrowed = None
        self.committed = len(self._commit([token]))
        self.start = start
        self.verify_block[0] = self.draft_block[0] = token

    def set_block_size(self, size: int) -> None:
        if not 1 <= size <= len(self.verify_block):
            raise ValueError(f"block size {size} is outside 1..{len(self.verify_block)}")
        self.choice = BlockChoice(size)
        self.block_size = size

    def narrow(self, width: int) -> None:
        if not 1 <= width <= self.block_size:
            raise ValueError(f"width {width} is outside 1..{self.block_size}")
        self._narrowed = width

    @property
    def next_width(self) -> int:
        return self.block_size if self._narrowed is None else min(self.block_size, self._narrowed)

    def _commit(self, tokens: list[int]) -> list[int]:
        first = len(self.output.tokens)
        kept = self.output.commit(tokens)
        self.tokens[first:first + len(kept)] = kept
        return kept

    @property
    def running(self) -> bool:
        return not self.output.finish_reason

    def step(self, posterior) -> bool:
        if not self.running:
            return False
        b, base = self.next_width, self.choice.size
        row = torch.as_tensor(posterior)[:b]
        drafts = torch.from_numpy(self.verify_block[1:b])
        accepted = int(accepted_length(drafts, row)) if b > 1 else 0
        bonus = int(row[accepted])
        self.stats.record_cycle(accepted)
        self.committed = len(self._commit(drafts[:accepted].tolist() + [bonus]))
        self.start += accepted + 1
        self.accepted = accepted
        # A growing block: a cycle that filled a base block makes the next one run grown. A narrowed
        # cycle is a ceiling only when it ran its whole block.
        self.grown_cycles += self.block_size != base
        self.ceilings += accepted == self.block_size - 1
        self.drafts += b - 1
        self._narrowed = None
        self.block_size = self.choice.next_size(accepted)
        self.verify_block[0] = self.draft_block[0] = bonus
        return self.running

    def step_greedy(self, logits) -> bool:
        return self.step(greedy_tokens(torch.as_tensor(logits)))

    @property
    def histogram(self) -> np.ndarray:
        out = np.zeros(self.verify_block.shape, dtype=np.int64)
        out[:len(self.stats.histogram)] = self.stats.histogram
        return out

    @property
    def count(self) -> int:
        return len(self.output.tokens)

    @property
    def finish_reason(self) -> str:
        return self.output.finish_reason

    @property
    def cycles(self) -> int:
        return self.stats.cycles

    @property
    def tau(self) -> float:
        return self.stats.tau

    @property
    def ceiling_fraction(self) -> float:
        return self.ceilings / self.cycles if self.cycles else 0.0

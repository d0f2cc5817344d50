"""The decode controller in plain Python: the specification the native core is tested against.

This is the per-cycle logic exactly as the decode loop ran it before it moved to C++ (the
acceptance rule on torch tensors, an output that applies stop ids and the token limit, the
histogram of DecodeStats), wrapped in the controller interface of `trtspec.runtime.controller`
so the same loop can run either: the tests check the native core against it cycle by cycle, and
`trtspec bench --profile` times the pure-Python loop beside the native one.
"""

from __future__ import annotations

import numpy as np
import torch

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
    """The controller interface (see trtspec.runtime.controller.Controller) over per-request
    Outputs and DecodeStats; blocks are numpy buffers like the native core's."""

    def __init__(self, block_sizes, limits, stop_ids, mask_token_id: int, grow_to=()):
        self.block_sizes, self.limits = list(block_sizes), list(limits)
        self.grow_to = list(grow_to) or [0] * len(self.block_sizes)
        self.active = list(self.block_sizes)  # the next cycle's block size
        self.grown = [0] * len(self.block_sizes)
        self.ceiling_cycles = [0] * len(self.block_sizes)
        width, requests = max(self.block_sizes + self.grow_to), len(self.block_sizes)
        self.verify_blocks = np.zeros((requests, width), dtype=np.int64)
        self.draft_blocks = np.full((requests, width), mask_token_id, dtype=np.int64)
        self.outputs = [Output(limit, tuple(ids)) for limit, ids in zip(self.limits, stop_ids, strict=True)]
        self.stats = [DecodeStats(block_size=b, grow_to=g) for b, g in zip(self.block_sizes, self.grow_to)]
        self.starts = [0] * requests
        self.accepted_lengths = [0] * requests
        self.kept: list[list[int]] = [[] for _ in range(requests)]
        self.begun = [False] * requests
        # committed tokens, also as one buffer that callers may hold a view of (as the native core's)
        self._tokens = np.zeros((requests, max(self.limits)), dtype=np.int64)

    def _commit(self, request: int, tokens: list[int]) -> list[int]:
        output = self.outputs[request]
        first = len(output.tokens)
        kept = output.commit(tokens)
        self._tokens[request, first:first + len(kept)] = kept
        return kept

    def begin(self, request: int, token: int, start: int) -> None:
        self.outputs[request] = Output(self.limits[request], tuple(self.outputs[request].stop_ids))
        self.stats[request] = DecodeStats(block_size=self.block_sizes[request], grow_to=self.grow_to[request])
        self.active[request] = self.block_sizes[request]
        self.grown[request] = self.ceiling_cycles[request] = 0
        self.kept[request] = self._commit(request, [token])
        self.starts[request], self.accepted_lengths[request] = start, 0
        self.verify_blocks[request, 0] = self.draft_blocks[request, 0] = token
        self.begun[request] = True

    def set_block_size(self, request: int, size: int) -> None:
        if not 1 <= size <= self.verify_blocks.shape[1]:
            raise ValueError(f"block size {size} is outside 1..{self.verify_blocks.shape[1]}")
        self.block_sizes[request] = self.active[request] = size
        self.grow_to[request] = 0

    def _running(self, request: int) -> bool:
        return self.begun[request] and not self.outputs[request].finish_reason

    @property
    def running(self) -> int:
        return sum(self._running(r) for r in range(len(self.outputs)))

    def step(self, posterior) -> int:
        posterior = torch.as_tensor(posterior)
        posterior = posterior[None] if posterior.dim() == 1 else posterior
        for r, b in enumerate(self.active):
            if not self._running(r):
                continue
            base = self.block_sizes[r]
            row = posterior[r, :b]
            drafts = torch.from_numpy(self.verify_blocks[r, 1:b])
            accepted = int(accepted_length(drafts, row)) if b > 1 else 0
            bonus = int(row[accepted])
            self.stats[r].record_cycle(accepted)
            self.kept[r] = self._commit(r, drafts[:accepted].tolist() + [bonus])
            self.starts[r] += accepted + 1
            self.accepted_lengths[r] = accepted
            # A growing block: a cycle that filled a base block makes the next one run grown.
            self.grown[r] += b != base
            self.ceiling_cycles[r] += accepted == b - 1
            self.active[r] = BlockChoice(base, self.grow_to[r]).next_size(accepted)
            self.verify_blocks[r, 0] = self.draft_blocks[r, 0] = bonus
        return self.running

    def step_greedy(self, logits) -> int:
        return self.step(torch.as_tensor(logits).argmax(dim=-1))

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens

    @property
    def histograms(self) -> np.ndarray:
        out = np.zeros(self.verify_blocks.shape, dtype=np.int64)
        for r, stats in enumerate(self.stats):
            out[r, :len(stats.histogram)] = stats.histogram
        return out

    def count(self, request: int) -> int:
        return len(self.outputs[request].tokens)

    def start(self, request: int) -> int:
        return self.starts[request]

    def accepted(self, request: int) -> int:
        return self.accepted_lengths[request]

    def committed(self, request: int) -> int:
        return len(self.kept[request])

    def finish_reason(self, request: int) -> str:
        return self.outputs[request].finish_reason

    def cycles(self, request: int) -> int:
        return self.stats[request].cycles

    def tau(self, request: int) -> float:
        return self.stats[request].tau

    def ceiling_fraction(self, request: int) -> float:
        return self.ceiling_cycles[request] / self.cycles(request) if self.cycles(request) else 0.0

    def block_size(self, request: int) -> int:
        return self.active[request]

    def grown_cycles(self, request: int) -> int:
        return self.grown[request]

    def ceilings(self, request: int) -> int:
        return self.ceiling_cycles[request]

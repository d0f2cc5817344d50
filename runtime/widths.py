"""How many positions a decode cycle verifies.

A verify call costs more for every position it scores on a CPU, and a block drafter's later
proposals are accepted less often, so a cycle need not verify its whole block. Two things narrow it:

* **Prompt lookup's copy** (`cycle_width`): without a long copy a cycle checks `--draft-width`
  positions, the drafter's first proposals, and a long copy widens it up to the block, while the
  engine's own calls say the extra positions cost little (`widening_pays`). The width depends on
  committed tokens only.
* **The drafter's confidence** (`confident_width`): after drafting, a greedy request decoding alone
  verifies the width that maximises expected tokens per millisecond,

      (1 + sum over j < w of prod over i <= j of c_i) / (overhead + verify_ms(w)),

  where c_i is the drafter's probability of its i-th proposal, verify_ms the engine's own calls of
  each width (`VerifyCosts`) and overhead the cycle's drafting and host work. On the default pair the
  product of the drafter's top probabilities over a cycle's first j proposals predicts the chance
  that all j are accepted (calibrated within a few points: docs/architecture.md, "Narrowed
  cycles"). A greedy request's output is the target's argmax whatever its widths, so this width may
  depend on the machine's timing; a sampled request's widths never do (its output must be a function
  of its text and seed), so it keeps the copy's rule.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np
import torch

# A cycle's width without a long copy on a CPU, where one more verified position costs ~1-3% of a
# step (the default pair, one thread: 40.6 ms for 1 position, 47.5 for 4, 88.0 for 16): B = 4 is the
# fastest fixed block there. On a GPU a block of 16 costs about one position: cycles keep their block.
CPU_DRAFT_WIDTH = 4
# Widening a cycle for a copy verifies more positions. It paid on the float32 engine, where each extra
# position over a 4-wide verify costs 0.07 of that verify (B = 16 widening 2.30x AR, capped at 8 2.21x),
# and not on the 4-bit target, where it costs 0.15 (B = 16 widening 1.06x, capped at 8 1.21x, B = 4
# 1.27x): a cycle widens while an extra position costs at most WIDEN_COST of the narrow one, between
# the two (docs/architecture.md, "Narrowed cycles").
WIDEN_COST = 0.1
WIDTH_SAMPLES = 8  # an engine's own calls of a width before their median counts as its cost


def widening_pays(narrow: int, wide: int, narrow_ms: float, wide_ms: float) -> bool:
    """Whether a cycle `wide` positions wide (verified in `wide_ms`) is worth it beside a `narrow`
    one (`narrow_ms`): each extra position costs at most WIDEN_COST of the narrow cycle."""
    return wide_ms - narrow_ms <= WIDEN_COST * narrow_ms * (wide - narrow)


def default_draft_width(device: torch.device, built: Sequence[int] | None) -> int:
    """The draft width where none is asked: CPU_DRAFT_WIDTH on a CPU (or the next width the engine
    was built for, `built`; None: any), 0 (whole blocks) elsewhere."""
    if device.type != "cpu":
        return 0
    return CPU_DRAFT_WIDTH if built is None else min((b for b in built if b >= CPU_DRAFT_WIDTH), default=0)


def cycle_width(block_size: int, copied: int, draft_width: int, built: Sequence[int] | None) -> int:
    """The positions a cycle of `block_size` verifies after a copy of `copied` tokens: `draft_width`
    (0: the whole block), or the copy and its bonus where that is wider, at most the block; rounded up
    to a width the engine was built for (`built`; None: any)."""
    if not draft_width or draft_width >= block_size:
        return block_size
    width = max(draft_width, copied + 1)
    if built is not None and width > 1:
        width = min((size for size in built if size >= width), default=block_size)
    return min(width, block_size)


def expected_tokens(confidence: np.ndarray) -> np.ndarray:
    """The drafter's probabilities of a cycle's proposals [n] -> the tokens a cycle of width 1..n+1
    commits on average [n + 1], if the probabilities are calibrated: the bonus, and each proposal
    with the chance that it and every one before it are accepted."""
    return 1.0 + np.concatenate(([0.0], np.cumsum(np.cumprod(confidence))))


def top_probabilities(logits: torch.Tensor) -> np.ndarray:
    """Each row's largest softmax probability, [n, K] -> [n], in NumPy on the calling thread: a torch
    op here would wake torch's thread pool beside ONNX Runtime's spinning one (at 2 threads that
    took speculation from 1.44x to 1.25x AR)."""
    rows = logits.detach().float().cpu().numpy()
    return 1.0 / np.exp(rows - rows.max(axis=-1, keepdims=True)).sum(axis=-1)


def confident_width(confidence: np.ndarray, verify_ms: np.ndarray, overhead_ms: float,
                    widths: Sequence[int]) -> int:
    """Of `widths` (each at most len(confidence) + 1), the one with the most expected tokens per
    millisecond (a tie goes to the wider: its drafts are drawn already); `verify_ms[w - 1]`: a call
    of width w."""
    tokens = expected_tokens(confidence)
    return max(sorted(widths, reverse=True), key=lambda w: tokens[w - 1] / (overhead_ms + verify_ms[w - 1]))


class VerifyCosts:
    """The engine's own timing of one request decoding alone: its verify calls by width and what a
    cycle costs besides (drafting, host work), each the median of the latest calls once there are
    WIDTH_SAMPLES."""

    def __init__(self):
        self._verify: dict[int, deque[float]] = {}
        self._overhead: deque[float] = deque(maxlen=4 * WIDTH_SAMPLES)
        self._medians: dict[int | None, float | None] = {}  # by width (None: the overhead), until a call lands

    def observe(self, width: int, verify_ms: float, overhead_ms: float | None = None) -> None:
        self._verify.setdefault(width, deque(maxlen=4 * WIDTH_SAMPLES)).append(verify_ms)
        self._medians.pop(width, None)
        if overhead_ms is not None:
            self._overhead.append(overhead_ms)
            self._medians.pop(None, None)

    def verify_ms(self, width: int) -> float | None:
        if width not in self._medians:  # asked several times a cycle: a median of up to 32 calls each
            calls = self._verify.get(width, ())
            self._medians[width] = float(np.median(calls)) if len(calls) >= WIDTH_SAMPLES else None
        return self._medians[width]

    def overhead_ms(self) -> float:
        if None not in self._medians:
            self._medians[None] = float(np.median(self._overhead)) if self._overhead else 0.0
        return self._medians[None]

    def curve(self, top: int) -> np.ndarray | None:
        """Verify ms of widths 1..top: measured where timed, in between interpolated, below the
        narrowest timed width extrapolated along the line through the two narrowest (a call's cost
        grows about linearly with its rows); None until `top` and one narrower width are timed."""
        timed = [w for w in range(1, top + 1) if self.verify_ms(w) is not None]
        if top not in timed or len(timed) < 2:
            return None
        ms = np.array([self.verify_ms(w) for w in timed])
        curve = np.interp(np.arange(1, top + 1), timed, ms)
        slope = (ms[1] - ms[0]) / (timed[1] - timed[0])
        below = np.arange(1, timed[0])
        curve[below - 1] = ms[0] - slope * (timed[0] - below)
        return np.maximum(curve, 1e-3)

    def untimed(self, top: int, allowed: Sequence[int]) -> int | None:
        """The width to run next so that `curve(top)` exists: `top` itself first (a cycle's usual
        width), then the one of `allowed` below it nearest 2; None once both are timed (or nothing
        narrower is allowed)."""
        if self.verify_ms(top) is None:
            return top
        narrower = [w for w in allowed if w < top]
        if not narrower or any(self.verify_ms(w) is not None for w in narrower):
            return None
        return min(narrower, key=lambda w: abs(w - 2))

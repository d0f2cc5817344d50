"""Decode statistics, the one place they are computed: acceptance length (tau), the acceptance
histogram and its ceiling bin, and decode tokens per second, per request (DecodeStats, whose
`to_dict` is the one JSON form every front end sends) and pooled over many requests (the functions
below, which bench, preflight, labels and the GPU check use).

The formulas over an acceptance histogram (`histogram[a]`: cycles that accepted `a` drafts) are
written here once: committed tokens and tau, tau as if the block had been smaller (`cut_histogram`),
cycles that accepted at least k drafts, and pooling; BlockPilot's load-aware chooser, DBloom's
analysis and the serving metrics call them."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Iterable, Sequence

from trtspec.runtime.schedule import BlockChoice


@dataclass
class DecodeStats:
    """`histogram[a]` counts cycles that accepted `a` drafts (0..B-1); bin B-1 is the ceiling. A
    growing block (grow_to G) widens the histogram to G bins and counts its ceilings itself.

    tau is committed tokens per cycle *including the bonus* (a + 1), averaged over cycles, as
    counted by the acceptance rule (a stop or the token limit may cut the last cycle short).
    """

    block_size: int
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = ""
    histogram: list[int] = field(default_factory=list)
    auto: bool = False      # block_size was chosen by the BlockPilot policy
    policy_s: float = 0.0   # time of that choice (part of decode_s)
    grow_to: int = 0        # the grown block size (0: the block never grows)
    grown_cycles: int = 0   # cycles run at grow_to
    ceilings: int | None = None  # cycles that accepted their whole block (None: the histogram's last bin)
    # Under continuous batching (trtspec.runtime.engine): requests that shared this one's verify
    # calls, on average (0: decoded alone, outside the engine), and its waits.
    batch_mean: float = 0.0
    queue_s: float = 0.0    # submitted -> admitted into a slot
    ttft_s: float = 0.0     # submitted -> first token
    turned_ar_at: int = 0   # `auto` under load: tokens committed when it turned AR (0: it never did)
    copied_cycles: int = 0  # cycles whose leading drafts were copied from the text (prompt lookup)
    draft_tokens: int = 0   # drafts verified, summed over cycles (B-1 each, fewer in a narrowed cycle)

    def __post_init__(self) -> None:
        if not self.histogram:
            self.histogram = [0] * max(self.block_size, self.grow_to)

    def record_cycle(self, accepted: int) -> None:
        self.histogram[accepted] += 1

    @property
    def cycles(self) -> int:
        return sum(self.histogram)

    @property
    def tau(self) -> float:
        return histogram_tau(self.histogram)

    @property
    def ceiling_cycles(self) -> int:
        """Cycles that accepted their whole block."""
        return self.histogram[-1] if self.ceilings is None else self.ceilings

    @property
    def ceiling_fraction(self) -> float:
        return self.ceiling_cycles / self.cycles if self.cycles else 0.0

    @property
    def schedule(self) -> str:
        """The block schedule run, spelled as a flag or request spells it (`BlockChoice.name`: "AR",
        "8", "4:8"), in every output: the JSON below, the bench's counts, the metrics' labels."""
        return BlockChoice(self.block_size, self.grow_to).name

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens committed by decode cycles (all but the prefill's first) per second of decode."""
        return decode_tokens_per_s([self])

    def to_dict(self) -> dict:
        """The statistics as every output sends them: `trtspec run --json`'s `stats`, `trtspec serve`'s
        `trtspec` object, the Triton model's `stats` output. The schedule run and whether BlockPilot
        chose it, its acceptance (AR has no block, so no ceiling: null), its counts and its times;
        `turned_ar_at` 0 unless `auto` turned AR under load (its cycles: those before it)."""
        return {
            "block_size": self.schedule,
            "grow_to": self.grow_to,
            "block_size_auto": self.auto,
            "tau": self.tau,
            "histogram": list(self.histogram),
            "ceiling_fraction": None if self.block_size <= 1 else self.ceiling_fraction,
            "cycles": self.cycles,
            "grown_cycles": self.grown_cycles,
            "copied_cycles": self.copied_cycles,
            "draft_tokens": self.draft_tokens,
            "turned_ar_at": self.turned_ar_at,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "finish_reason": self.finish_reason,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "queue_s": self.queue_s,
            "ttft_s": self.ttft_s,
            "batch_mean": self.batch_mean,
        }

    def summary(self) -> str:
        """One human-readable line for stderr."""
        chosen = " (chosen by BlockPilot)" if self.auto else ""
        grown = f" ({self.grown_cycles} grown to {self.grow_to})" if self.grow_to else ""
        text = (f"{self.new_tokens} new tokens, {self.cycles} cycles at B={self.block_size}{grown}{chosen}, "
                f"tau {self.tau:.2f}")
        if self.block_size > 1:
            text += f", ceiling {self.ceiling_fraction:.1%}"
        return (text + f" | prefill {self.prefill_s * 1e3:.1f} ms ({self.prompt_tokens} tokens), "
                f"decode {self.decode_tokens_per_s:.1f} tok/s | finish: {self.finish_reason}")


def committed_tokens(histogram: Sequence[int]) -> int:
    """Tokens the cycles of an acceptance histogram committed: accepted drafts + one bonus each."""
    return sum((a + 1) * n for a, n in enumerate(histogram))


def histogram_tau(histogram: Sequence[int]) -> float:
    """Committed tokens per cycle (accepted drafts + the bonus) of an acceptance histogram."""
    cycles = sum(histogram)
    return committed_tokens(histogram) / cycles if cycles else 0.0


def cut_histogram(histogram: Sequence[int], block_size: int) -> list[int]:
    """The same cycles as if the block had been `block_size`: the drafter's first B - 1 proposals of
    a longer block stand for a block of B, so a cycle that accepted B - 1 drafts or more counts in
    the ceiling bin B - 1 (min(a, B - 1) accepted). A histogram no wider than B is unchanged."""
    if len(histogram) <= block_size:
        return list(histogram)
    return [*histogram[:block_size - 1], sum(histogram[block_size - 1:])]


def accepted_at_least(histogram: Sequence[int]) -> list[int]:
    """`[k]`: cycles that accepted at least k drafts, k = 0 .. len - 1 (`[0]` counts every cycle)."""
    return list(accumulate(reversed(histogram)))[::-1]


def pool_histograms(histograms: Iterable[Sequence[int]]) -> list[int]:
    """Cycles that accepted a drafts, summed over histograms (of different widths with auto or a
    growing block: the shorter count as zeros beyond their end)."""
    histograms = list(histograms)
    width = max(map(len, histograms), default=0)
    return [sum(h[a] for h in histograms if a < len(h)) for a in range(width)]


def decode_tokens(new_tokens: int) -> int:
    """Tokens committed by decode cycles: all but the first, which prefill produced."""
    return max(new_tokens - 1, 0)


def decode_tokens_per_s(stats: Iterable[DecodeStats]) -> float:
    """Decode tokens over decode seconds, summed over requests."""
    stats = list(stats)
    seconds = sum(s.decode_s for s in stats)
    return sum(decode_tokens(s.new_tokens) for s in stats) / seconds if seconds > 0 else 0.0


def mean_tau(stats: Iterable[DecodeStats]) -> float:
    """Mean of per-request means, as the papers report it, over the requests that ran a cycle."""
    taus = [s.tau for s in stats if s.cycles]
    return statistics.fmean(taus) if taus else 0.0


def pooled_histogram(stats: Iterable[DecodeStats]) -> list[int]:
    """The requests' acceptance histograms pooled (`pool_histograms`)."""
    return pool_histograms(s.histogram for s in stats)


def schedule_counts(stats: Iterable[DecodeStats]) -> dict[str, int]:
    """How many requests ran each block schedule (`DecodeStats.schedule`; for auto, the distribution
    BlockPilot chose), smallest block first."""
    counts = Counter((s.block_size, s.grow_to) for s in stats)
    return {BlockChoice(size, grow_to).name: n for (size, grow_to), n in sorted(counts.items())}


def pooled_ceiling_fraction(stats: Iterable[DecodeStats]) -> float:
    """Fraction of speculative cycles that accepted their whole block (AR requests, such as auto
    may choose, left out)."""
    speculative = [s for s in stats if s.block_size > 1]
    cycles = sum(s.cycles for s in speculative)
    return sum(s.ceiling_cycles for s in speculative) / cycles if cycles else 0.0

"""DBloom's histogram analysis: is the block horizon, rather than the drafter, capping the speed-up?

The per-cycle acceptance histogram over 0..B-1 accepted drafts shows it where a mean acceptance
length hides it: a spike in the ceiling bin (cycles that accepted the whole block). From the
histogram we read the conditional acceptance rate of every block position, extrapolate the
rate of the last positions past the end of the block, and estimate the tau that the ceiling
cycles would have reached had the block continued ("stranded" speed-up) through the positions an
expansion could add: up to the largest block size (MAX_BLOCK_SIZE unless the caller knows a
smaller ceiling), never an infinite tail.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from trtspec.export.bindings import MAX_BLOCK_SIZE
from trtspec.runtime.schedule import BlockChoice
from trtspec.runtime.stats import DecodeStats, accepted_at_least

CEILING_THRESHOLD = 0.10   # a ceiling bin above this is worth a look
MIN_STRANDED_GAIN = 0.25   # tokens per cycle an expansion must promise to be recommended
TAIL_POSITIONS = 4         # last positions whose acceptance is extrapolated past the block
CAPTURE = 0.9              # recommend a block that captures this much of the extrapolated tail


def per_position_acceptance(histogram: list[int]) -> list[float | None]:
    """Rate at which draft k (k = 1..B-1) is accepted given drafts 1..k-1 were: cycles accepting
    at least k over cycles accepting at least k-1 (None where no cycle got that far)."""
    at_least = accepted_at_least(histogram)
    return [at_least[k] / at_least[k - 1] if at_least[k - 1] else None for k in range(1, len(histogram))]


@dataclass
class Preflight:
    block_size: int
    histogram: list[int]
    tau: float  # committed tokens per cycle (mean of per-request means)
    requests: list[dict] = field(default_factory=list)  # per request: tau, cycles, ceiling fraction, histogram
    max_block_size: int = MAX_BLOCK_SIZE  # the largest block an expansion could reach

    @property
    def ceiling_fraction(self) -> float:
        return DecodeStats(self.block_size, histogram=list(self.histogram)).ceiling_fraction

    @property
    def per_position_acceptance(self) -> list[float | None]:
        return per_position_acceptance(self.histogram)

    @property
    def tail_rate(self) -> float:
        """Acceptance rate expected just past the block: the mean over its last observed positions."""
        rates = [r for r in self.per_position_acceptance if r is not None][-TAIL_POSITIONS:]
        return statistics.fmean(rates) if rates else 0.0

    @property
    def expansion_positions(self) -> int:
        """Draft positions an expansion could add past the block (to the largest block size)."""
        return max(self.max_block_size - self.block_size, 0)

    @property
    def stranded_tokens_per_cycle(self) -> float:
        """Extra tokens per cycle had ceiling cycles continued at the tail rate r through the n positions
        an expansion could add: r + r^2 + ... + r^n, a ceiling cycle's expected extra accepted drafts
        (n at r = 1; at most n, never the infinite series, which a rate near 1 blows up)."""
        r, n = self.tail_rate, self.expansion_positions
        extra = float(n) if r >= 1 else r * (1 - r ** n) / (1 - r)
        return self.ceiling_fraction * extra

    @property
    def stranded_tau_estimate(self) -> float:
        return self.tau + self.stranded_tokens_per_cycle

    def recommendation(self) -> dict:
        """Expand the block or not, and to what."""
        if self.ceiling_fraction < CEILING_THRESHOLD or self.stranded_tokens_per_cycle < MIN_STRANDED_GAIN:
            return {"expand": False, "to": None,
                    "reason": f"ceiling bin {self.ceiling_fraction:.1%}, stranded {self.stranded_tokens_per_cycle:.2f} "
                              "tokens/cycle: the drafter, not the block horizon, limits tau"}
        r = self.tail_rate
        extra = math.ceil(math.log(1 - CAPTURE) / math.log(r)) if 0 < r < 1 else 8
        target = min(self.max_block_size, 4 * math.ceil((self.block_size + extra) / 4))
        return {"expand": True, "to": target,
                "reason": f"{self.ceiling_fraction:.1%} of cycles accept the whole block and the last positions "
                          f"still accept {r:.0%}: post-train to B={target} (trtspec expand-block --to {target})"}

    def to_dict(self) -> dict:
        return {"block_size": self.block_size, "histogram": self.histogram,
                "ceiling_fraction": self.ceiling_fraction,
                "per_position_acceptance": self.per_position_acceptance, "tau": self.tau,
                "stranded_tau_estimate": self.stranded_tau_estimate, "recommendation": self.recommendation(),
                "requests": self.requests}

    def format(self) -> str:
        lines = [f"acceptance at B={BlockChoice(self.block_size).name}: tau {self.tau:.2f}, "
                 f"ceiling {self.ceiling_fraction:.1%}, stranded tau estimate {self.stranded_tau_estimate:.2f}",
                 f"{'accepted':>8}  {'cycles':>7}  {'share':>6}  {'P(accept k | k-1)':>17}"]
        cycles = max(sum(self.histogram), 1)
        rates = [None, *self.per_position_acceptance]
        width = max(self.histogram) or 1
        for a, count in enumerate(self.histogram):
            rate = "" if rates[a] is None else f"{rates[a]:.2f}"
            bar = "#" * round(30 * count / width)
            lines.append(f"{a:>8}  {count:>7}  {count / cycles:>6.1%}  {rate:>17}  {bar}")
        advice = self.recommendation()
        lines.append(("expand: " if advice["expand"] else "keep: ") + advice["reason"])
        return "\n".join(lines)

"""DBloom's preflight: is the block horizon, rather than the drafter, capping the speed-up?

The per-cycle acceptance histogram over 0..B-1 accepted drafts shows it where a mean acceptance
length hides it: a spike in the ceiling bin (cycles that accepted the whole block). From the
histogram we read the conditional acceptance rate of every block position, extrapolate the
rate of the last positions past the end of the block, and estimate the tau that the ceiling
cycles would have reached had the block continued ("stranded" speed-up).
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from trtspec.errors import TrtspecError
from trtspec.export.bindings import MAX_BLOCK_SIZE
from trtspec.fileio import staged_file
from trtspec.runtime.decode import GenerationConfig
from trtspec.runtime.schedule import BlockChoice
from trtspec.runtime.stats import DecodeStats, mean_tau, pooled_histogram
from trtspec.sweep import Sweep, pipeline_requests, run_sweep

PLOT_SUFFIX = ".png"
CEILING_THRESHOLD = 0.10   # a ceiling bin above this is worth a look
MIN_STRANDED_GAIN = 0.25   # tokens per cycle an expansion must promise to be recommended
TAIL_POSITIONS = 4         # last positions whose acceptance is extrapolated past the block
CAPTURE = 0.9              # recommend a block that captures this much of the extrapolated tail


def per_position_acceptance(histogram: list[int]) -> list[float | None]:
    """Rate at which draft k (k = 1..B-1) is accepted given drafts 1..k-1 were: cycles accepting
    at least k over cycles accepting at least k-1 (None where no cycle got that far)."""
    at_least = [sum(histogram[a:]) for a in range(len(histogram))]
    return [at_least[k] / at_least[k - 1] if at_least[k - 1] else None for k in range(1, len(histogram))]


@dataclass
class Preflight:
    block_size: int
    histogram: list[int]
    tau: float  # committed tokens per cycle (mean of per-request means)
    requests: list[dict] = field(default_factory=list)  # per request: tau, cycles, ceiling fraction, histogram

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
        return min(statistics.fmean(rates), 0.999) if rates else 0.0

    @property
    def stranded_tokens_per_cycle(self) -> float:
        """Extra tokens per cycle had ceiling cycles continued at the tail rate: r + r^2 + ... ."""
        r = self.tail_rate
        return self.ceiling_fraction * r / (1 - r)

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
        target = min(MAX_BLOCK_SIZE, 4 * math.ceil((self.block_size + extra) / 4))
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


def plot(preflight: Preflight, path: str) -> None:
    """Histogram and per-position acceptance as a PNG (needs matplotlib: the [plot] extra)."""
    try:
        import matplotlib
    except ImportError:
        raise TrtspecError("--plot needs matplotlib: pip install 'trtspec[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    bins = range(len(preflight.histogram))
    left.bar(bins, preflight.histogram, color=["#4477aa"] * (len(preflight.histogram) - 1) + ["#cc3311"])
    left.set(xlabel="accepted drafts per cycle", ylabel="cycles",
             title=f"B={preflight.block_size}: ceiling {preflight.ceiling_fraction:.1%}")
    rates = preflight.per_position_acceptance
    right.plot(range(1, len(rates) + 1), [r if r is not None else float("nan") for r in rates], marker="o")
    right.set(xlabel="block position k", ylabel="P(accept k | accepted k-1)", ylim=(0, 1.02),
              title=f"tau {preflight.tau:.2f} -> stranded estimate {preflight.stranded_tau_estimate:.2f}")
    figure.tight_layout()
    try:
        with staged_file(path, suffix=PLOT_SUFFIX, what="--plot") as temporary:
            figure.savefig(temporary, dpi=120, format="png")
    finally:
        plt.close(figure)


def run_preflight(pipeline, prompts: list[str], block_size: int, max_new_tokens: int, sampling,
                  progress: bool = True) -> Preflight:
    """Decode every prompt at `block_size` and pool the acceptance histograms."""
    sweep = Sweep((BlockChoice(block_size),), max_new_tokens, sampling, with_ar=False)
    done = run_sweep([pipeline_requests(pipeline)], prompts, sweep, desc="preflight", progress=progress)
    stats = [generation.stats for generation in done.of(0)[0]]
    return Preflight(block_size, pooled_histogram(stats), mean_tau(stats), [_request(s) for s in stats])


def _request(stats: DecodeStats, **extra) -> dict:
    """One request's line in the report."""
    return {"tau": stats.tau, "cycles": stats.cycles, "ceiling_fraction": stats.ceiling_fraction,
            "new_tokens": stats.new_tokens, "histogram": stats.histogram, **extra}


ANCHORS_PER_PASS = 32  # blocks per packed drafter pass when teacher forcing (bounds the attention mask)


def run_teacher_forced(pipeline, prompts: list[str], block_size: int, max_new_tokens: int,
                       progress: bool = True) -> Preflight:
    """Greedy acceptance of the drafter at every position of the target's own greedy continuation.

    Decoding starts a cycle wherever the previous one stopped, so two drafters are measured on
    different contexts: one that commits more per cycle spends fewer cycles on easy text, and its
    per-position rates lean toward the hard contexts that remain. Here the "cycle" starts at each
    of the first `max_new_tokens` positions of the continuation — the same contexts for every
    drafter and block size — so a difference in per-position acceptance is the drafter's own.
    The continuation runs `block_size - 1` tokens further so that every block has its targets.
    Each request also lists its blocks' accepted counts (`accepted`, one per start position).
    """
    from trtspec.training.blocks import pack
    from trtspec.training.data import continue_prompts

    target, drafter, codec = pipeline.target, pipeline.drafter, pipeline.codec
    if target is None or drafter is None:
        raise TrtspecError("teacher-forced acceptance runs the checkpoints: give --target and --drafter, not --engine")
    config = GenerationConfig(block_size=1, max_new_tokens=max_new_tokens + block_size - 1)
    prompt_ids = [codec.encode(p) for p in prompts]
    continuations = continue_prompts(target, prompt_ids, config.with_stop_ids(codec.stop_ids), progress=progress)
    stats, accepted_counts = [], []
    with torch.inference_mode():
        for ids, continuation in tqdm(list(zip(prompt_ids, continuations)), desc="teacher-forced", unit="req",
                                      file=sys.stderr, disable=not progress, dynamic_ncols=True):
            sequence = ids + continuation
            last = min(len(ids) + max_new_tokens, len(sequence) - block_size + 1)
            anchors = torch.arange(len(ids), max(len(ids), last))  # none if it stopped within a block
            _, features = target(torch.tensor([sequence], device=target.device), 0, None,
                                 drafter.config.target_layer_ids)
            accepted = []
            for group in anchors.split(ANCHORS_PER_PASS):
                batch = pack([(sequence, len(ids))], block_size, len(group), drafter.config.mask_token_id,
                             1.0, None, anchor_sets=[group])
                hidden = drafter.forward_packed(features, batch.block_tokens.to(target.device),
                                                batch.block_positions.to(target.device), batch.mask.to(target.device))
                drafts = drafter.lm_head(hidden).argmax(-1).cpu().view(-1, block_size)[:, 1:]
                matches = drafts == batch.labels.view(-1, block_size)[:, 1:]
                accepted += matches.int().cumprod(dim=1).sum(dim=1).tolist()
            counts = [accepted.count(a) for a in range(block_size)]
            stats.append(DecodeStats(block_size, new_tokens=len(continuation), histogram=counts))
            accepted_counts.append(accepted)
    requests = [_request(s, accepted=accepted) for s, accepted in zip(stats, accepted_counts)]
    return Preflight(block_size, pooled_histogram(stats), mean_tau(stats), requests)

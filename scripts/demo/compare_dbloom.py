"""Compare three preflight reports per prompt: b16 at B=16, b16 naively at B=24, expanded at B=24.

    python scripts/demo/compare_dbloom.py build/dbloom/pre-b16-16.json build/dbloom/pre-b16-24.json \
        build/dbloom/pre-b24-24.json [--ceiling 0.25]

Over the prompts whose b16 ceiling fraction (at B=16) is at least --ceiling, and over all
prompts: the median and quartiles of committed tokens per cycle (tau) for each, the median
per-prompt gain of the expanded drafter over the other two, and whether its acceptance at
block positions 1..15 stays at or above b16's.

Decoded reports measure each drafter on its own cycle starts; teacher-forced ones (`trtspec
preflight --teacher-forced`) start a block at every position of the same continuations. Where
the reports list per-request histograms, each per-position difference also gets a 95% interval
from a paired bootstrap over prompts, and the positions where the expanded drafter is below b16
with family-wise confidence 95% (one-sided, Bonferroni over the 15 positions) are listed. For
teacher-forced reports it also replays each drafter's greedy decode and scores both drafters on
the same cycle starts, which separates the drafter from where its cycles happen to start.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from itertools import accumulate
from pathlib import Path

import numpy as np

from trtspec.dbloom.histogram import per_position_acceptance
from trtspec.runtime.stats import accepted_at_least

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_schedules import replay  # noqa: E402

POSITIONS = 15
RESAMPLES = 2000


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def at_least_counts(report: dict) -> np.ndarray:
    """[prompts, POSITIONS + 1]: per prompt, how many cycles accepted at least k drafts (k = 0..15)."""
    at_least = np.array([accepted_at_least(request["histogram"]) for request in report["requests"]], dtype=np.float64)
    return at_least[:, :POSITIONS + 1]


def paired_position_gaps(expanded: dict, base: dict, seed: int = 0) -> list[dict]:
    """Expanded minus base conditional acceptance at positions 1..15, with a bootstrap interval
    that resamples prompts (both ran the same prompts, so prompts are the unit)."""
    a, b = at_least_counts(expanded), at_least_counts(base)
    resamples = np.random.default_rng(seed).integers(0, len(a), size=(RESAMPLES, len(a)))
    gaps = []
    for k in range(1, POSITIONS + 1):
        def rate(counts, rows=slice(None)):
            return counts[rows, k].sum(axis=-1) / counts[rows, k - 1].sum(axis=-1)
        point = rate(a) - rate(b)
        spread = rate(a, resamples) - rate(b, resamples)
        low, high = np.quantile(spread, [0.025, 0.975])
        family_low = np.quantile(spread, 0.05 / POSITIONS)  # one-sided, Bonferroni over the 15 positions
        gaps.append({"position": k, "gap": float(point), "low": float(low), "high": float(high),
                     "below_b16": bool(np.quantile(spread, 1 - 0.05 / POSITIONS) < 0),
                     "family_low": float(family_low)})
    return gaps


def cycle_starts(report: dict, new_tokens: int) -> list[tuple[int, int]]:
    """(prompt, offset) of every cycle a greedy decode at the report's block size runs: at T=0
    a cycle starting at offset o accepts what the teacher-forced report recorded for o."""
    starts = []
    for prompt, request in enumerate(report["requests"]):
        cycles = replay({report["block_size"]: request["accepted"]}, new_tokens,
                        lambda _, b=report["block_size"]: b)
        starts += [(prompt, offset) for offset in accumulate((taken + 1 for _, taken in cycles[:-1]), initial=0)]
    return starts


def rates_at(report: dict, starts: list[tuple[int, int]]) -> list[float | None]:
    """Per-position acceptance (1..15) of a teacher-forced report over the given cycle starts."""
    histogram = [0] * report["block_size"]
    for prompt, offset in starts:
        accepted = report["requests"][prompt]["accepted"]
        if offset < len(accepted):
            histogram[accepted[offset]] += 1
    return per_position_acceptance(histogram)[:POSITIONS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("b16_16")
    parser.add_argument("b16_24")
    parser.add_argument("b24_24")
    parser.add_argument("--ceiling", type=float, default=0.25)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="the decode length the reports used")
    args = parser.parse_args()
    reports = {name: json.load(open(path)) for name, path in
               (("b16@16", args.b16_16), ("b16@24", args.b16_24), ("b24@24", args.b24_24))}
    per_prompt = {name: [r["tau"] for r in report["requests"]] for name, report in reports.items()}
    ceilings = [r["ceiling_fraction"] for r in reports["b16@16"]["requests"]]
    result = {}
    for subset, keep in (("high_ceiling", [c >= args.ceiling for c in ceilings]), ("all", [True] * len(ceilings))):
        chosen = [i for i, k in enumerate(keep) if k]
        rows = {name: quartiles([taus[i] for i in chosen]) for name, taus in per_prompt.items()}
        gains = {other: quartiles([per_prompt["b24@24"][i] - per_prompt[other][i] for i in chosen])
                 for other in ("b16@16", "b16@24")}
        result[subset] = {"prompts": len(chosen), "tau_quartiles": rows, "gain_quartiles": gains}
    early = zip(reports["b24@24"]["per_position_acceptance"][:15], reports["b16@16"]["per_position_acceptance"][:15])
    drops = [b16 - b24 for b24, b16 in early if b24 is not None and b16 is not None]
    result["positions_1_15_max_drop"] = max(drops)
    if all("histogram" in r for report in (reports["b24@24"], reports["b16@16"]) for r in report["requests"]):
        gaps = paired_position_gaps(reports["b24@24"], reports["b16@16"])
        result["positions_1_15_paired"] = gaps
        result["positions_significantly_below_b16"] = [g["position"] for g in gaps if g["below_b16"]]
    if all("accepted" in r for report in (reports["b24@24"], reports["b16@16"]) for r in report["requests"]):
        # Decoded rates weigh contexts by where each drafter's cycles start; score both on the same starts.
        new_tokens = args.max_new_tokens
        result["same_cycle_starts"] = {
            f"{starts_of} starts": {name: rates_at(reports[name], cycle_starts(reports[starts_of], new_tokens))
                                    for name in ("b16@16", "b24@24")}
            for starts_of in ("b16@16", "b24@24")}
    result["pooled_tau"] = {name: report["tau"] for name, report in reports.items()}
    result["ceiling_fraction"] = {name: report["ceiling_fraction"] for name, report in reports.items()}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

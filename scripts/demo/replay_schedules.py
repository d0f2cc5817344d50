"""Replay greedy decoding under different block-size schedules from teacher-forced acceptance.

At T=0 the output does not depend on the block size, and a cycle that starts at position p with
block B accepts exactly what `trtspec preflight --teacher-forced --block-size B` recorded for p.
So every schedule's cycles can be replayed without decoding: per-request fixed B, the per-prompt
oracle, "probe the first k cycles at one B, then choose", and per-cycle switching ("grow the block
after a long acceptance"; the runtime's growing block B:G is the case "after B-1"). Times use the
cycle costs stored in a `trtspec label-blocks` file of the same prompts; the replay is checked
against that file's measured cycle counts, growing-block columns included.

    for B in 6 8 12 16; do trtspec preflight --block-size $B --teacher-forced --json build/tf/he-$B.json; done
    python scripts/demo/replay_schedules.py build/tf/he build/blockpilot/labels-humaneval-t0.jsonl --sizes 6,8,12,16
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Callable

from trtspec.blockpilot.labels import read_labels
from trtspec.runtime.schedule import BlockChoice, parse_block_sizes

Schedule = Callable[[list[tuple[int, int]]], int]  # (block size, accepted) of past cycles -> next block size


def replay(accepted: dict[int, list[int]], new_tokens: int, schedule: Schedule) -> list[tuple[int, int]]:
    """The cycles of one request: the prefill's token sits at offset 0, a cycle at offset o commits
    accepted[B][o] + 1 tokens, until `new_tokens` are committed."""
    offset, cycles = 0, []
    while 1 + offset < new_tokens:
        block_size = schedule(cycles)
        row = accepted[block_size]
        taken = row[offset] if offset < len(row) else 0
        cycles.append((block_size, taken))
        offset += taken + 1
    return cycles


def grow(low: int, high: int, after: int | None = None) -> Schedule:
    """The growing block low:high (BlockChoice.next_size, the runtime's rule), growing after a cycle
    that accepted at least `after` drafts (default: a filled block of `low`, what the runtime does)."""
    choice = BlockChoice(low, high)
    return lambda cycles: choice.next_size(cycles[-1][1], after) if cycles else low


def seconds(cycles: list[tuple[int, int]], cost: dict[int, float]) -> float:
    return sum(cost[block_size] for block_size, _ in cycles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prefix", help="teacher-forced reports are PREFIX-B.json")
    parser.add_argument("labels", help="label-blocks JSONL of the same prompts (cycle costs, cycle counts)")
    parser.add_argument("--sizes", default="6,8,12,16")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    sizes = list(parse_block_sizes(args.sizes))
    labels = read_labels(args.labels)
    header, records = labels.header, labels.records
    cost = {int(b): s for b, s in header["cycle_cost_s"].items()}
    new_tokens = header["max_new_tokens"]
    reports = {b: json.load(open(f"{args.prefix}-{b}.json"))["requests"] for b in sizes}
    requests = [{b: reports[b][i]["accepted"] for b in sizes} for i in range(len(records))]

    def speedup(schedule: Schedule) -> float:
        """Aggregate modelled speed-up over AR: every request commits `new_tokens` tokens."""
        total = sum(seconds(replay(accepted, new_tokens, schedule), cost) for accepted in requests)
        return (new_tokens - 1) * cost[1] * len(requests) / total

    replayed = {b: [replay(a, new_tokens, lambda c, b=b: b) for a in requests] for b in sizes}
    fixed = {b: [seconds(cycles, cost) for cycles in replayed[b]] for b in sizes}
    matching = {b: sum(len(cycles) == r["runs"][str(b)]["cycles"] for cycles, r in zip(replayed[b], records))
                for b in sizes}
    for choice in labels.choices:  # growing blocks, as the native controller runs them
        if choice.grow_to and set(choice.sizes) <= set(sizes):
            rule = grow(choice.size, choice.grow_to)
            matching[choice.name] = sum(len(replay(a, new_tokens, rule)) == r["runs"][choice.name]["cycles"]
                                        for a, r in zip(requests, records))
    ar_total = (new_tokens - 1) * cost[1] * len(requests)
    results = {"replayed_cycles_match_labels": matching,
               "fixed": {b: ar_total / sum(times) for b, times in fixed.items()},
               "oracle": ar_total / sum(min(fixed[b][i] for b in sizes) for i in range(len(requests)))}

    def probe(block_size: int, k: int, threshold: float, low: int, high: int) -> Schedule:
        def schedule(cycles):
            if len(cycles) < k:
                return block_size
            return high if sum(a for _, a in cycles[:k]) / k >= threshold else low
        return schedule

    thresholds = [0.5 * i for i in range(1, 31)]
    results["probe_best_in_hindsight"] = max(
        ({"probe": p, "cycles": k, "threshold": t, "low": lo, "high": hi,
          "speedup": speedup(probe(p, k, t, lo, hi))}
         for p in (sizes[0], sizes[-1]) for k in (1, 2, 3) for t in thresholds
         for lo, hi in itertools.combinations(sizes, 2)), key=lambda row: row["speedup"])

    results["per_cycle"] = [{"low": lo, "high": hi, "after": n, "speedup": speedup(grow(lo, hi, n))}
                            for lo, hi in itertools.combinations(sizes, 2) for n in range(1, lo)]
    results["per_cycle"].sort(key=lambda row: -row["speedup"])
    results["per_cycle"] = results["per_cycle"][:5]
    print(json.dumps(results, indent=2))
    if args.json_path:
        with open(args.json_path, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()

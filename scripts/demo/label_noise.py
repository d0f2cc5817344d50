"""Is a label set's per-prompt oracle a property of the prompts, or of the seeds it was drawn with?

Two `trtspec label-blocks` runs of the same prompts with different seeds: each run's per-prompt
best fixed block size is applied to the *other* run. If the best size is a property of the prompt
(something a policy could learn), the transferred choices keep most of the oracle's gain over the
best single size; if it is sampling noise, they keep none. At T=1 on the demo pair, where the
drafter's greedy proposals rarely match the target's samples, this tells whether the oracle gap
can be closed at all.

    python scripts/demo/label_noise.py build/blockpilot/labels-humaneval-t1.jsonl \\
        build/blockpilot/labels-humaneval-t1-seed1000.jsonl
"""

from __future__ import annotations

import argparse
import json

from trtspec.blockpilot.evaluation import strategy_metrics
from trtspec.blockpilot.labels import read_labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("labels", nargs=2, metavar="LABELS.jsonl", help="two label sets of the same prompts")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    runs = [read_labels(path) for path in args.labels]
    if len(runs[0].records) != len(runs[1].records) or runs[0].header["prompts"] != runs[1].header["prompts"]:
        raise SystemExit("the two label sets must cover the same prompts")
    fixed = tuple(c for c in runs[0].fixed if c in runs[1].fixed)
    n = len(runs[0].records)
    best_per_prompt = [labels.labels(fixed) for labels in runs]
    report = {}
    for own, other in ((0, 1), (1, 0)):
        labels = runs[own]
        speed = {c.name: strategy_metrics(labels, [c] * n)["modelled_speedup"] for c in fixed}
        best = max(speed, key=speed.get)
        oracle = strategy_metrics(labels, best_per_prompt[own])["modelled_speedup"]
        transferred = strategy_metrics(labels, best_per_prompt[other])["modelled_speedup"]
        agreement = sum(a == b for a, b in zip(*best_per_prompt)) / n
        report[args.labels[own]] = {
            "seed": labels.header["seed"], "best_fixed": best, "best_fixed_speedup": speed[best],
            "oracle_speedup": oracle, "other_seed_oracle_choices_speedup": transferred,
            "gap_kept": (transferred - speed[best]) / (oracle - speed[best]) if oracle > speed[best] else None,
            "same_best_size": agreement}
        kept = report[args.labels[own]]["gap_kept"]
        print(f"{args.labels[own]} (seed {labels.header['seed']}): best fixed B={best} {speed[best]:.4f}x, "
              f"own oracle {oracle:.4f}x, the other seed's per-prompt choices {transferred:.4f}x "
              f"({'no gap' if kept is None else f'keeps {kept:.0%} of the gap'}); same best size for "
              f"{agreement:.0%} of prompts")
    if args.json_path:
        with open(args.json_path, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()

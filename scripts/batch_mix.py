"""Does a request's cost depend on the batch it joins? The measurement behind the routing question
of `trtspec serve --replicas` (docs/serving.md, "Routing") and issue 59's bar on mixed batches.

One engine (`--engine`, or the one `trtspec serve` loads for `--backend`: with `auto`, the cached
ONNX Runtime engine of the bundled pair where the run is float32, eager bfloat16 on a CPU with AMX) decodes
a stream of `--requests` requests, `--batch` at a time (each finished request's slot going to the
next, as on a server), three ways, alternating rounds:

* `spec`:  every request greedy at B = `--block-size`;
* `ar`:    every request sampled at T = 1, autoregressive;
* `mixed`: alternating one and the other, as a router that looks only at queue lengths hands a replica.

The engine verifies a mixed batch in one call at the wider block (runtime.engine.verify_calls),
the AR rows' padding computing only attention. `mixed / split` compares two replicas that each get
the mix against two that each get one kind (the sum of the two kinds' rates): below 1, a router that
knows each replica's block sizes would serve more.

Two rates per batch. *Whole run*: every output token over the run's time, which charges the mix
for its drain: greedy requests finish first, so a mixed run ends with sampled requests alone in a
half-empty batch, while an all-AR batch finishes together. *Under load*: the tokens committed while
every slot was busy (until fewer requests were left than slots), the steady state of a replica
with a queue, which is what the sum of two replicas' rates assumes. `--requests` equal to `--batch`
is one closed batch (its whole-run figure only). The ratio is given twice: of the kinds' median rates,
and paired, the median of each round's own ratio (a host whose speed drifts between rounds moves a
round's three runs alike).

    python scripts/batch_mix.py --rounds 3 --block-size 4 --max-new-tokens 64 --json mix.json
    python scripts/batch_mix.py --rounds 3 --block-size 4 --max-new-tokens 64 --requests 8 --json mix-closed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from trtspec.api import batch_context
from trtspec.fileio import atomic_write_text
from trtspec.perf.bench import add_script_options, load_prompts, script_pipeline
from trtspec.runtime.engine import EngineConfig
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.sampling import SamplingConfig
from trtspec.runtime.schedule import AR, BlockChoice


def loaded_rate(commits: list[tuple[float, int]], finishes: list[float], began: float, slots: int) -> float | None:
    """Output tok/s while every slot was busy: the tokens committed (each commit: its time, its
    count) from `began` until the moment fewer requests were left than `slots`; None when there
    never were more requests than slots (one closed batch)."""
    if len(finishes) <= slots:
        return None
    drain = sorted(finishes)[len(finishes) - slots]  # the (n - slots + 1)-th finish: slots - 1 are left
    return sum(count for at, count in commits if at <= drain) / (drain - began)


def split_ratio(rates: dict[str, float]) -> float:
    """Two replicas under the same stream of requests: each gets the mix, against each one kind."""
    return 2 * rates["mixed"] / (rates["spec"] + rates["ar"])


def paired_ratio(rounds: dict[str, list[dict]], measure: str) -> float:
    """The median over rounds of each round's own ratio: a round's three runs are minutes apart, so
    a host whose speed drifts between rounds moves all three alike, where the medians of the three
    kinds' rates, taken apart, can come from different rounds."""
    return statistics.median(split_ratio({name: runs[i][measure] for name, runs in rounds.items()})
                             for i in range(len(rounds["mixed"])))


def run(pipeline, ids: list[list[int]], configs: list[GenerationConfig], batch: int) -> dict[str, float | None]:
    """Output tok/s over the whole run and under load (None for one closed batch)."""
    engine = pipeline.stepped_engine(EngineConfig(max_running=batch), load_aware=False,
                                     max_context=batch_context(ids, configs, pipeline.runner.max_context))
    commits: list[tuple[float, int]] = []
    finishes: list[float] = []
    began = time.perf_counter()
    engine.generate(ids, configs, on_commit=lambda _, tokens: commits.append((time.perf_counter(), len(tokens))),
                    on_finish=lambda _: finishes.append(time.perf_counter()))
    whole = sum(count for _, count in commits) / (time.perf_counter() - began)
    return {"whole": whole, "under_load": loaded_rate(commits, finishes, began, batch)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--batch", type=int, default=8, help="Requests decoded at once (even).")
    parser.add_argument("--block-size", type=int, default=8, help="The greedy requests' block size.")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="Tokens every request generates.")
    parser.add_argument("--requests", type=int, default=32,
                        help="Requests per run (even; default: 32). Equal to --batch: one closed batch.")
    parser.add_argument("--rounds", type=int, default=5, help="Rounds of the three batches; medians are reported.")
    add_script_options(parser, "every round's figures")
    args = parser.parse_args()
    if args.requests < args.batch or args.requests % 2 or args.batch % 2:
        parser.error("--batch and --requests must be even, --requests at least --batch")

    pipeline = script_pipeline(args, args.block_size)
    ids = [pipeline.codec.encode(prompt) for prompt in load_prompts("humaneval", args.requests)[1]]

    def spec(seed: int) -> GenerationConfig:
        return GenerationConfig(block=BlockChoice(args.block_size), max_new_tokens=args.max_new_tokens, ignore_eos=True)

    def sampled(seed: int) -> GenerationConfig:
        return GenerationConfig(block=AR, max_new_tokens=args.max_new_tokens, ignore_eos=True,
                                sampling=SamplingConfig(temperature=1.0, seed=seed))

    batches = {"spec": [spec] * args.requests, "ar": [sampled] * args.requests,
               "mixed": [spec, sampled] * (args.requests // 2)}
    rounds: dict[str, list[dict]] = {name: [] for name in batches}
    for _ in range(args.rounds):
        for name, kinds in batches.items():
            rounds[name].append(run(pipeline, ids, [kind(seed) for seed, kind in enumerate(kinds)], args.batch))
    measures = ("whole", "under_load") if args.requests > args.batch else ("whole",)
    median = {m: {name: statistics.median(r[m] for r in runs) for name, runs in rounds.items()} for m in measures}
    ratio = {m: split_ratio(rates) for m, rates in median.items()}
    paired = {m: paired_ratio(rounds, m) for m in measures}
    kind = "one closed batch" if args.requests == args.batch else "a stream"
    print(f"{args.requests} requests ({kind}), {args.batch} at once, {args.max_new_tokens} tokens each, "
          f"median of {args.rounds} rounds; output tok/s")
    print(f"  {'':6} {'':18} {'whole run':>10}" + (f" {'under load':>11}" if len(measures) > 1 else ""))
    rows = (("spec", f"greedy at B={args.block_size}"), ("ar", "T=1 at AR"), ("mixed", "alternating"))
    for name, label in rows:
        print(f"  {name:6} {label:18}" + "".join(f" {median[m][name]:{10 if m == 'whole' else 11}.1f}" for m in measures))
    print(f"  mixed / split (two replicas, each the mix vs each one kind):"
          + "".join(f" {ratio[m]:.3f} ({m.replace('_', ' ')})" for m in measures))
    print(f"  paired (the median of each round's own ratio):"
          + "".join(f" {paired[m]:.3f} ({m.replace('_', ' ')})" for m in measures))
    if args.json:
        figures = {"settings": vars(args), "rounds": rounds, "median": median, "mixed_over_split": ratio,
                   "mixed_over_split_paired": paired}
        atomic_write_text(Path(args.json), json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Does a request's cost depend on the batch it joins? The measurement behind the routing question
of `trtspec serve --replicas` (docs/serving.md, "Routing").

One engine (the one `trtspec serve` loads: the cached ONNX Runtime engine of the bundled pair by
default) decodes `--batch` requests at once, three ways, alternating rounds:

* `spec`:  every request greedy at B = `--block-size` (what `auto` runs greedy requests at);
* `ar`:    every request sampled at T = 1, autoregressive (what `auto` sends sampled ones to);
* `mixed`: half and half, as a router that looks only at queue lengths hands a replica.

The engine verifies a mixed batch in one call at the wider block (runtime.engine.verify_calls),
so the AR half's rows are padded to B, and the target computes only their real positions' feed-forward
and logits (`computed`). `mixed / split` compares two replicas that each get the mix against two that
each get one kind (the same requests, routed by kind): below 1, a router that knows each replica's
block sizes would serve more. One closed batch (the default) also charges the mix for its tail: the
greedy half finishes first and the sampled half runs on alone, half-full; `--requests` more than
`--batch` measures a stream instead, each finished request's slot given to the next.

    python scripts/batch_mix.py --rounds 5 --json mix.json
    python scripts/batch_mix.py --rounds 3 --requests 32 --json mix-stream.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from trtspec.fileio import atomic_write_text
from trtspec.perf.bench import add_script_options, load_prompts, script_pipeline
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.sampling import SamplingConfig
from trtspec.runtime.schedule import AR, BlockChoice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="Requests decoded at once (even).")
    parser.add_argument("--block-size", type=int, default=8, help="The greedy requests' block size.")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="Tokens every request generates.")
    parser.add_argument("--requests", type=int, default=None,
                        help="Requests per batch kind (even; default: --batch, one closed batch). More than --batch "
                             "is a stream: each finished request's slot goes to the next, as on a server.")
    parser.add_argument("--rounds", type=int, default=5, help="Rounds of the three batches; medians are reported.")
    add_script_options(parser, "every round's figures")
    args = parser.parse_args()

    pipeline = script_pipeline(args, args.block_size)
    requests = args.requests or args.batch
    prompts = load_prompts("humaneval", requests)[1]

    def spec(seed: int) -> GenerationConfig:
        return GenerationConfig(block=BlockChoice(args.block_size), max_new_tokens=args.max_new_tokens, ignore_eos=True)

    def sampled(seed: int) -> GenerationConfig:
        return GenerationConfig(block=AR, max_new_tokens=args.max_new_tokens, ignore_eos=True,
                                sampling=SamplingConfig(temperature=1.0, seed=seed))

    batches = {"spec": [spec] * requests, "ar": [sampled] * requests, "mixed": [spec, sampled] * (requests // 2)}
    rates: dict[str, list[float]] = {name: [] for name in batches}
    for _ in range(args.rounds):
        for name, kinds in batches.items():
            configs = [kind(seed) for seed, kind in enumerate(kinds)]
            began = time.perf_counter()
            results = pipeline.generate_batch(prompts, configs, max_running=args.batch)
            rates[name].append(sum(len(r.tokens) for r in results) / (time.perf_counter() - began))
    median = {name: statistics.median(values) for name, values in rates.items()}
    # two replicas under the same stream of requests: each gets the mix, or each gets one kind
    ratio = 2 * median["mixed"] / (median["spec"] + median["ar"])
    print(f"{requests} requests, {args.batch} at once, {args.max_new_tokens} tokens each, median of {args.rounds} rounds")
    for name, label in (("spec", f"greedy at B={args.block_size}"), ("ar", "T=1 at AR"), ("mixed", "half and half")):
        print(f"  {name:6} {label:18} {median[name]:8.1f} output tok/s")
    print(f"  mixed / split (two replicas, each the mix vs each one kind): {ratio:.3f}")
    if args.json:
        atomic_write_text(Path(args.json), json.dumps({"settings": vars(args), "rounds": rates, "median": median,
                                                       "mixed_over_split": ratio}, indent=2) + "\n")


if __name__ == "__main__":
    main()

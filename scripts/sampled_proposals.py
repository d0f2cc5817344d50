"""At T > 0, does drawing the drafts from the drafter's distribution pay? One table, one run.

A sampled request's drafts are drawn from the drafter's own distribution and verified by
speculative sampling (keep with probability min(1, p/q), else redraw from max(0, p - q)): accepted
with probability sum min(p, q) per position, where a greedy draft is accepted with p(argmax q),
which the target's own uncertainty caps (runtime.sampling.draw_proposals). This decodes the same
prompts, seeds and backend several ways, interleaved prompt by prompt, one request at a time (as
`trtspec bench`): AR, then drafts drawn at each `--proposal-temperatures` fraction of the request's
temperature (0: greedy drafts, DFlash's rule; `EngineConfig.proposal_temperature`); it prints mean
tau and median decode tok/s of each, and the speed-ups over AR.

    python scripts/sampled_proposals.py --chat --limit 24 --block-size 4 --json proposals.json
    python scripts/sampled_proposals.py --chat --limit 24 --proposal-temperatures 0,0.4,0.7,1   # a sweep
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from trtspec.fileio import atomic_write_text
from trtspec.perf.bench import add_script_options, load_prompts, script_pipeline
from trtspec.runtime.engine import EngineConfig
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.sampling import DEFAULT_PROPOSAL_TEMPERATURE, SamplingConfig
from trtspec.runtime.schedule import AR, BlockChoice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=24, help="HumanEval's first N prompts.")
    parser.add_argument("--chat", action="store_true", help="Send each prompt in the target's chat template.")
    parser.add_argument("--block-size", type=int, default=4, help="The speculative block size.")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--proposal-temperatures", type=lambda text: [float(t) for t in text.split(",")],
                        default=[0.0, DEFAULT_PROPOSAL_TEMPERATURE],
                        help="Comma-separated fractions of T the drafts are drawn at (0: greedy drafts). [default: 0,0.7]")
    add_script_options(parser, "every request's figures")
    args = parser.parse_args()

    pipeline = script_pipeline(args, args.block_size)
    prompts = [pipeline.codec.encode(p, chat=args.chat) for p in load_prompts("humaneval", args.limit)[1]]
    context = max(len(p) for p in prompts) + args.max_new_tokens + args.block_size
    ways = {"AR": (AR, 0.0)} | {
        f"drafts at {f:g} x T" if f else "greedy drafts": (BlockChoice(args.block_size), f)
        for f in args.proposal_temperatures}
    engines = {f: pipeline.stepped_engine(EngineConfig(max_running=1, prefill_chunk=0, proposal_temperature=f),
                                          load_aware=False, max_context=context) for _, f in ways.values()}
    rows: dict[str, list[dict]] = {name: [] for name in ways}
    for seed, prompt in enumerate(prompts):
        for name, (block, fraction) in ways.items():
            config = GenerationConfig(block=block, max_new_tokens=args.max_new_tokens,
                                      sampling=SamplingConfig(temperature=args.temperature, seed=seed))
            stats = engines[fraction].generate([prompt], [config])[0].stats
            rows[name].append({"tau": stats.tau, "decode_tokens_per_s": stats.decode_tokens_per_s})
    summary = {name: {"tau": statistics.mean(r["tau"] for r in got),
                      "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in got)}
               for name, got in rows.items()}
    ar = summary["AR"]["decode_tokens_per_s"]
    print(f"HumanEval first {len(prompts)}{' (chat)' if args.chat else ''}, T = {args.temperature}, B = {args.block_size}, {args.max_new_tokens} "
          f"tokens, {pipeline.backend} {str(pipeline.dtype).removeprefix('torch.')}, {args.threads} thread(s)")
    for name, figures in summary.items():
        print(f"  {name:18} tau {figures['tau']:.3f}  decode {figures['decode_tokens_per_s']:6.1f} tok/s  "
              f"{figures['decode_tokens_per_s'] / ar:.2f}x AR")
    if args.json:
        atomic_write_text(Path(args.json), json.dumps({"settings": vars(args), "summary": summary, "requests": rows},
                                                      indent=2) + "\n")


if __name__ == "__main__":
    main()

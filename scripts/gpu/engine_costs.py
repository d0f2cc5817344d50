"""Serve a random Qwen3-4B-shaped pair through the batched engine: cycle time per (AR, B) x batch
with CUDA graphs and with the AOTInductor backend, AR tokens/s, the speed-ups those times give at
tau = 5.92 and at a trained pair's measured tau, and that pair's greedy output on this device
against the CPU's (trtspec.perf.engine_costs; the default pair unless --target/--drafter name one).

    python scripts/gpu/engine_costs.py --out OUT_DIR                          # a CUDA GPU, bf16
    python scripts/gpu/engine_costs.py --device cpu --shape tiny --out OUT_DIR   # the same code on a CPU

Writes OUT_DIR/engine-costs.json (rewritten after every row, so a run cut short keeps what it
measured) and OUT_DIR/engine-costs.txt. Exit status 1 if any measurement or check failed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

from trtspec.errors import TrtspecError
from trtspec.perf.bench import load_prompts
from trtspec.perf.cycle_costs import script_shape, write_report
from trtspec.perf.engine_costs import EngineCostConfig, EngineCosts, measure, pair_check
from trtspec.runtime.schedule import parse_block_sizes

DEFAULTS = EngineCostConfig()


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shape", default=None, choices=("qwen3-4b", "tiny"),
                        help="model shape (default: qwen3-4b on cuda, tiny on cpu)")
    parser.add_argument("--block-sizes", default="8,16", help="speculative block sizes (AR is always measured)")
    parser.add_argument("--batches", default=",".join(map(str, DEFAULTS.batches)))
    parser.add_argument("--variants", default=None,
                        help="graphs, eager, inductor (default: graphs,inductor on cuda; eager on cpu)")
    parser.add_argument("--new-tokens", type=int, default=DEFAULTS.new_tokens)
    parser.add_argument("--pair-prompts", type=int, default=8, help="prompts of the trained pair's check (0: none)")
    parser.add_argument("--prompts", default="humaneval", help="humaneval or a JSONL file of the pair's prompts")
    parser.add_argument("--target", help="the trained pair's target [default: the default pair's]")
    parser.add_argument("--drafter", help="the trained pair's drafter [default: the default pair's]")
    parser.add_argument("--out", required=True, help="directory for engine-costs.json and engine-costs.txt")
    args = parser.parse_args()
    try:
        shape = script_shape(args.device, args.shape)
        variants = tuple((args.variants or ("graphs,inductor" if args.device == "cuda" else "eager")).split(","))
        if not set(variants) <= {"graphs", "eager", "inductor"} or ("graphs" in variants and args.device == "cpu"):
            raise TrtspecError(f"--variants must name graphs (CUDA only), eager or inductor; got {args.variants}")
        sizes = (1, *parse_block_sizes(args.block_sizes, "--block-sizes"))
        config = replace(DEFAULTS, shape=shape, block_sizes=sizes, batches=_ints(args.batches), variants=variants,
                         new_tokens=args.new_tokens)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
    except (TrtspecError, ValueError) as error:
        print(f"Error: {error}", file=sys.stderr)
        return 1

    def progress(costs: EngineCosts) -> None:
        write_report(out, "engine-costs", costs)
        print(f"engine-costs: {costs.rows[-1]}", flush=True)

    device = torch.device(args.device)
    torch.manual_seed(0)
    costs = measure(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32, progress)
    if args.pair_prompts:  # the trained pair's tau joins the modelled speed-ups
        costs.pair = pair_check(device, load_prompts(args.prompts, args.pair_prompts)[1], sizes[1:], 64,
                                args.target, args.drafter)
        print(f"engine-costs: pair {costs.pair}", flush=True)
    write_report(out, "engine-costs", costs)
    print(costs.format_table())
    failed = costs.errors() or (costs.pair and costs.pair.get("identical") != costs.pair.get("requests"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

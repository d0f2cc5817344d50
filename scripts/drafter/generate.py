"""Step 2 of the drafter recipe: the target's own responses to the prompts, in resumable shards.

Each shard is `--shard-size` consecutive prompts, written atomically as
`OUT/shard-NNNN.jsonl.gz` (the `trtspec generate-data` record format, gzip-compressed: every command
that reads JSONL reads it) once all of them are decoded,
so a run cut off at any moment loses at most the shard in progress, and a rerun skips the shards
that exist. Every `--sampled-every`-th shard samples at T = 1 (seeded by the shard's number), the
rest are greedy: the drafter serves both. `OUT/manifest.json` keeps what the shards were made
with and the running totals (tokens, seconds), rewritten after every shard. Each shard records its wall
time and its CPU time (`cpu_seconds`, this process's: a job stopped or starved for a while shows in
the first only).

    python scripts/drafter/generate.py --prompts data/smollm2/prompts.jsonl -o data/smollm2/responses
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import time
from pathlib import Path

from trtspec.fileio import atomic_write_text
from trtspec.validate import jsonl_records


def shard_config(number: int, max_new_tokens: int, sampled_every: int) -> "GenerationConfig":
    from trtspec.runtime.request import GenerationConfig
    from trtspec.runtime.sampling import SamplingConfig
    from trtspec.runtime.schedule import AR

    sampled = sampled_every > 0 and number % sampled_every == sampled_every - 1
    sampling = SamplingConfig(temperature=1.0, seed=number) if sampled else SamplingConfig()
    return GenerationConfig(block=AR, max_new_tokens=max_new_tokens, sampling=sampling)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("-o", "--output", required=True, help="Directory of shards.")
    parser.add_argument("--shard-size", type=int, default=128)
    parser.add_argument("--shards", type=int, default=None, help="Stop after this many shards exist.")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--sampled-every", type=int, default=4, help="Every N-th shard samples at T = 1 (0: none).")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-context", type=int, default=512)
    parser.add_argument("--dtype", default="auto",
                        help="auto: bfloat16 where the CPU multiplies it fast (AMX), else float32; each shard records its own.")
    parser.add_argument("--backend", default=os.environ.get("TRTSPEC_BACKEND", "auto"),
                        help="As trtspec run's: auto decodes through the cached engine of the pair where that is "
                             "faster (ONNX Runtime on a CPU without AMX), else eager; each shard records its own.")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {
        "target": Path(args.target).name, "prompts": Path(args.prompts).name, "shard_size": args.shard_size,
        "max_new_tokens": args.max_new_tokens, "sampled_every": args.sampled_every, "shards": {}}
    if manifest["shard_size"] != args.shard_size:
        raise SystemExit(f"{out} was made with --shard-size {manifest['shard_size']}")
    total = -(-len(jsonl_records(args.prompts, ("prompt",))) // args.shard_size)
    pending = pending_shards(out, total if args.shards is None else min(total, args.shards))
    if not pending:  # a rerun on committed shards: no target loaded (torch's import alone takes seconds)
        print(f"{out}: all {len(manifest['shards'])} shards exist", flush=True)
        return

    import torch

    from trtspec.commands.options import load_pipeline
    from trtspec.training.data import generate_data, read_prompt_set

    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = read_prompt_set(args.prompts)
    pipeline = load_pipeline(args.target, None, args.dtype, "cpu", with_drafter=False, max_context=args.max_context,
                             backend=args.backend)
    # hosts differ: a set's shards may too
    made_with = {"dtype": str(pipeline.dtype).removeprefix("torch."), "backend": pipeline.backend}
    for number in pending:
        path = out / f"shard-{number:04d}.jsonl"
        chunk = prompts[number * args.shard_size:(number + 1) * args.shard_size]
        config = shard_config(number, args.max_new_tokens, args.sampled_every)
        began, began_cpu = time.perf_counter(), time.process_time()
        generate_data(pipeline, chunk, config, path, args.batch_size, progress=False)
        seconds, cpu_seconds = time.perf_counter() - began, time.process_time() - began_cpu
        tokens = sum(len(json.loads(line)["response_ids"]) for line in path.read_text().splitlines())
        shard = compress(path)
        manifest["shards"][shard.name] = {"prompts": len(chunk), "tokens": tokens, "seconds": round(seconds, 1),
                                          "cpu_seconds": round(cpu_seconds, 1),
                                          "temperature": config.sampling.temperature, **made_with}
        atomic_write_text(manifest_path, json.dumps(manifest, indent=1) + "\n")
        done = manifest["shards"].values()
        print(f"{shard.name}: {tokens} tokens in {seconds:.0f} s ({tokens / seconds:.0f} tok/s; "
              f"{cpu_seconds:.0f} s of CPU); "
              f"{sum(s['tokens'] for s in done)} tokens in {len(done)} shards", flush=True)


def pending_shards(out: Path, count: int) -> list[int]:
    """The numbers among the first `count` shards still to decode (a shard decoded but cut off
    before its compression is compressed now, not decoded again)."""
    pending = []
    for number in range(count):
        path = out / f"shard-{number:04d}.jsonl"
        if path.exists():
            compress(path)
        if not path.with_suffix(".jsonl.gz").exists():
            pending.append(number)
    return pending


def compress(path: Path) -> Path:
    """`path` as PATH.gz (written beside, then renamed; no timestamp inside, so the same shard
    compresses to the same bytes), the plain file removed: shards take a sixth of the space."""
    shard, partial = path.with_suffix(".jsonl.gz"), path.with_suffix(".jsonl.gz.partial")
    with open(partial, "wb") as raw, gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=raw, mtime=0) as out:
        out.write(path.read_bytes())
    os.replace(partial, shard)
    path.unlink()
    return shard


if __name__ == "__main__":
    main()

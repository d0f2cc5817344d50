"""The GPU check: one command on a machine with a CUDA GPU (TensorRT optional).

    python scripts/gpu_check.py [--block-sizes 12,16,20,24] [--prompts 20] [--out build/gpu-check]
    python scripts/gpu_check.py --device cpu ...   # the same flow on a CPU (torch backend, no CUDA graphs)

1. builds engines of a pair (the default pair unless --target/--drafter name one) for every backend
   this machine has (torch always; ONNX Runtime when onnxruntime-gpu's CUDA provider is present;
   TensorRT when it is installed),
2. checks each against eager PyTorch on the GPU: greedy outputs on HumanEval prompts must be
   identical at every block size and for the growing block smallest:largest, which switches
   graphs inside a request (float32), run by run and replayed from captured CUDA graphs
   (`Pipeline(..., cuda_graphs=True)`),
3. times one speculative cycle (draft(B) + verify(B)) per block size: eager step modules, the same
   modules replayed as CUDA graphs over static buffers, and each built engine,
and writes everything to OUT/gpu-check.json (after every section, so a run cut short keeps what it
checked; "passed" appears once every check has run). Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def cycle_timings(target, drafter, block_size: int, past: int) -> dict:
    """One draft(B) + verify(B) cycle of the step modules, eager and replayed as a CUDA graph."""
    from trtspec.perf.cycle_costs import cycle_inputs, replayed_ms
    from trtspec.timing import Timer
    from trtspec.export.steps import DraftStep, TargetStep

    device = target.device
    verify, draft = TargetStep(target, tuple(drafter.config.target_layer_ids)), DraftStep(drafter)
    target_in, draft_in = cycle_inputs(target, drafter, block_size, past, device)

    def eager_cycle():
        draft(*draft_in)
        verify(*target_in)

    timer = Timer(device, repeats=50, warmup=5)
    with torch.inference_mode():
        eager_ms, graph_ms = timer(eager_cycle), replayed_ms(eager_cycle, timer)
    return {"block_size": block_size, "past": past, "eager_ms": eager_ms, "cuda_graph_ms": graph_ms}


def batched_check(pipeline, reference, prompts: list[str], choices, max_new_tokens: int) -> dict:
    """The prompts decoded together by `pipeline`'s continuous-batching engine (mixed block sizes, 8 at
    a time) against each decoded alone by `reference`: identical tokens and acceptance histograms."""
    from trtspec.runtime.request import GenerationConfig

    configs = [GenerationConfig(block=c, max_new_tokens=max_new_tokens)
               for c in (choices * len(prompts))[:len(prompts)]]
    began = time.perf_counter()
    batched = pipeline.generate_batch(prompts, configs, max_running=8)
    seconds = time.perf_counter() - began
    alone = [reference.generate(p, c) for p, c in zip(prompts, configs)]
    return {"requests": len(prompts),
            "identical": sum(a.tokens == b.tokens for a, b in zip(batched, alone)),
            "same_histogram": sum(a.generation.stats.histogram == b.generation.stats.histogram
                                  for a, b in zip(batched, alone)),
            "batch_mean": sum(r.generation.stats.batch_mean for r in batched) / len(batched),
            "tokens_per_s": sum(r.generation.stats.new_tokens for r in batched) / seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="the pair's target [default: the default pair's]")
    parser.add_argument("--drafter", help="the pair's drafter [default: the default pair's]")
    parser.add_argument("--block-sizes", default="12,16,20,24")
    parser.add_argument("--prompts", type=int, default=20, help="HumanEval prompts for the equality check")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--past", type=int, default=512, help="cached positions for the cycle timing")
    parser.add_argument("--out", default="build/gpu-check")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: the same checks without CUDA graphs or other backends (a dry run)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible", file=sys.stderr)
        return 1
    cuda = args.device == "cuda"

    from trtspec.api import Pipeline
    from trtspec.assets import resolve_drafter, resolve_target
    from trtspec.perf.bench import load_prompts
    from trtspec.runtime.schedule import parse_block_sizes
    from trtspec.build import BuildConfig, build_engine
    from trtspec.engines import onnxruntime as ort_engine
    from trtspec.engines import tensorrt as trt_engine
    from trtspec.errors import TrtspecError
    from trtspec.fileio import atomic_write_text
    from trtspec.runtime.schedule import BlockChoice
    from trtspec.runtime.stats import decode_tokens_per_s
    from trtspec.perf.sweep import Sweep, pipeline_requests, run_sweep

    block_sizes = parse_block_sizes(args.block_sizes)
    out = Path(args.out)
    drafter_dir = resolve_drafter(args.drafter, args.target)  # (before the target: the default one implies it)
    target_dir = resolve_target(args.target)
    report = {"gpu": torch.cuda.get_device_name() if cuda else None, "device": args.device,
              "torch": torch.__version__, "engines": {}, "cycles": []}

    def save() -> None:  # after every section: a run cut short keeps what it checked
        atomic_write_text(out / "gpu-check.json", json.dumps(report, indent=2) + "\n")

    eager = Pipeline(target_dir, drafter_dir, dtype="float32", device=args.device)
    for block_size in block_sizes:
        report["cycles"].append(cycle_timings(eager.target, eager.drafter, block_size, args.past))
        print(f"cycle B={block_size}: {report['cycles'][-1]}", flush=True)
        save()

    backends = ["torch"]
    if cuda and ort_engine.available():
        import onnxruntime
        if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
            backends.append("onnxruntime")
    if cuda and trt_engine.available():
        backends.append("tensorrt")
    _, prompts = load_prompts("humaneval", args.prompts)
    choices = [BlockChoice(b) for b in block_sizes]
    if len(block_sizes) > 1:
        choices.append(BlockChoice(min(block_sizes), max(block_sizes)))
    failed = False
    report["batched"] = {}
    for cuda_graphs in (False, True) if cuda else (False,):  # eager batches, then replayed from CUDA graphs
        name = "eager" + ("+cuda-graphs" if cuda_graphs else "")
        try:
            batcher = Pipeline(target_dir, drafter_dir, dtype="float32", device=args.device, cuda_graphs=cuda_graphs)
            report["batched"][name] = row = batched_check(batcher, eager, prompts, choices, args.max_new_tokens)
            failed |= row["identical"] != row["requests"] or row["same_histogram"] != row["requests"]
        except Exception as error:  # noqa: BLE001 - reported; the other checks still run
            report["batched"][name], failed = {"error": f"{type(error).__name__}: {error}"}, True
        print(f"batched {name}: {report['batched'][name]}", flush=True)
        save()
    for backend in backends:
        began = time.perf_counter()
        try:  # a backend that fails to build is reported, and the other backends are still checked
            build_engine(target_dir, drafter_dir, out / backend,
                         BuildConfig(block_sizes=block_sizes, backend=backend, dtype="float32", device=args.device))
        except Exception as error:  # noqa: BLE001 - one GPU session checks every backend it can
            report["engines"][backend], failed = {"error": f"build: {type(error).__name__}: {error}"}, True
            print(f"{backend}: build failed: {error}", flush=True)
            save()
            continue
        built_s = time.perf_counter() - began
        for cuda_graphs in (False, True) if cuda else (False,):  # run by run, then replayed from CUDA graphs
            name = backend + ("+cuda-graphs" if cuda_graphs else "")
            try:
                engine = Pipeline(engine=out / backend, device=args.device, cuda_graphs=cuda_graphs)
            except TrtspecError as error:  # e.g. ONNX Runtime refusing to capture a graph with CPU nodes
                report["engines"][name], failed = {"error": str(error)}, True
                print(f"{name}: {error}", flush=True)
                save()
                continue
            rows = []
            for choice in choices:  # one sweep per choice, so the report is saved after each
                sweep = Sweep((choice,), args.max_new_tokens, with_ar=False)
                done = run_sweep([pipeline_requests(engine), pipeline_requests(eager)], prompts, sweep,
                                 desc=f"{name} B={choice.name}")
                built, reference = done.of(0, 0)[0], done.of(0, 1)[0]
                same = sum(a.tokens == b.tokens for a, b in zip(built, reference))
                rows.append({"block_size": choice.name, "identical": same, "requests": len(prompts),
                             "decode_tokens_per_s": decode_tokens_per_s(a.stats for a in built)})
                failed |= same != len(prompts)
                print(f"{name} B={choice.name}: identical {same}/{len(prompts)}", flush=True)
                report["engines"][name] = {"build_s": built_s, "checks": rows}
                save()
            try:
                batched = batched_check(engine, eager, prompts, choices, args.max_new_tokens)
                failed |= batched["identical"] != batched["requests"] or batched["same_histogram"] != batched["requests"]
            except Exception as error:  # noqa: BLE001 - reported; the other checks still run
                batched, failed = {"error": f"{type(error).__name__}: {error}"}, True
            report["engines"][name] = {"build_s": built_s, "checks": rows, "batched": batched}
            print(f"{name} batched: {batched}", flush=True)
            save()
    report["passed"] = not failed
    save()
    print(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

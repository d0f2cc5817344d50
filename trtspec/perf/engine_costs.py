"""Engine costs: what one decode cycle of the batched engine costs per (block size, batch), and the
speed-ups those costs give at a known acceptance.

Why: the engine that `serve` and Triton run batches requests and, on a GPU, replays each (graph,
block size, batch bucket) from a CUDA graph; what a cycle costs there decides whether speculation
pays at a batch size, and only the engine itself shows it (its padding to buckets, its host work,
its cache layout). The pair is `trtspec.perf.cycle_costs`'s random Qwen3-4B-shaped one (tiny on a
CPU). Each variant is an executor under the same runner:

* `graphs`: the eager step modules, replayed from CUDA graphs (the default on CUDA);
* `eager`: the same modules launched op by op (on a CPU, the only one);
* `inductor`: the step graphs compiled by AOTInductor (`trtspec build --backend inductor`'s
  compiler, here in-process from the random pair), replayed from CUDA graphs on a GPU.

A cycle's time is the median over the batch's requests of decode time / cycles (the requests run
in lockstep: random weights accept about nothing, so every cycle commits one token a request). At
an acceptance tau (tokens per cycle), block size B at batch b runs tau * AR(b) / cycle(B, b) times
the tokens/s of AR at the same batch: the modelled speed-up.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from trtspec.engines.torch import InductorExecutor, compile_package
from trtspec.export.bindings import graph_specs
from trtspec.export.exporter import export_program, step_modules
from trtspec.perf.cycle_costs import SHAPES, drafter_config, random_pair
from trtspec.perf.machine import describe_machine
from trtspec.runtime.engine import EngineConfig, LocalEngine
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.runner import BatchRunner
from trtspec.runtime.schedule import BlockChoice

PAPER_TAU = 5.92  # BlockPilot's paper, Qwen3-4B with its DFlash drafter at T = 1


@dataclass(frozen=True)
class EngineCostConfig:
    shape: str = "qwen3-4b"
    block_sizes: tuple[int, ...] = (1, 8, 16)   # 1: AR (the target alone)
    batches: tuple[int, ...] = (1, 8, 32, 64)
    variants: tuple[str, ...] = ("graphs", "inductor")
    prompt_tokens: int = 64
    new_tokens: int = 32
    taus: tuple[float, ...] = (PAPER_TAU,)     # acceptances to model speed-ups at (the checked pair's is added)


@dataclass
class EngineCost:
    variant: str
    block_size: int
    batch: int
    cycle_ms: float | None = None
    start_s: float | None = None   # the first request batch: captures (or compiles) included
    error: str | None = None

    @property
    def tokens_per_s(self) -> float | None:
        """At one token per request per cycle (AR; what a speculative cycle commits is tau of them)."""
        return None if self.cycle_ms is None else self.batch * 1e3 / self.cycle_ms


@dataclass
class EngineCosts:
    config: EngineCostConfig
    machine: dict
    rows: list[EngineCost] = field(default_factory=list)
    compile_s: dict[str, float] = field(default_factory=dict)
    pair: dict | None = None   # a trained pair through the engine on this device against the CPU (pair_check)

    def cycle_ms(self, variant: str, block_size: int, batch: int) -> float | None:
        row = next((r for r in self.rows if (r.variant, r.block_size, r.batch) == (variant, block_size, batch)), None)
        return row.cycle_ms if row is not None else None

    def taus(self) -> list[float]:
        pair_tau = (self.pair or {}).get("tau")
        return [*self.config.taus, *([pair_tau] if pair_tau else [])]

    def speedups(self) -> list[dict]:
        """tau * AR(b) / cycle(B, b) for every measured (variant, B > 1, batch) and tau."""
        result = []
        for row in self.rows:
            ar = self.cycle_ms(row.variant, 1, row.batch)
            if row.block_size == 1 or row.cycle_ms is None or ar is None:
                continue
            for tau in self.taus():
                result.append({"variant": row.variant, "block_size": row.block_size, "batch": row.batch,
                               "tau": tau, "speedup": tau * ar / row.cycle_ms})
        return result

    def errors(self) -> list[str]:
        return [r.error for r in self.rows if r.error] + ([self.pair["error"]] if self.pair and
                                                          self.pair.get("error") else [])

    def to_dict(self) -> dict:
        return {"config": asdict(self.config), "target": SHAPES[self.config.shape].to_dict(), "machine": self.machine,
                "rows": [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in self.rows],
                "compile_s": self.compile_s, "speedups": self.speedups(), "pair": self.pair, "errors": self.errors()}

    def format_table(self) -> str:
        c, m = self.config, self.machine
        lines = [f"{c.shape} target, random weights, through the engine | {m.get('gpu', m['device'])}, {m['dtype']}, "
                 f"torch {m['torch']} | {c.prompt_tokens}-token prompts, {c.new_tokens} new tokens",
                 "ms per engine cycle (all the batch's requests); AR tok/s; modelled speed-up over AR at tau"]
        taus = self.taus()
        header = f"{'variant':>9} {'batch':>5} {'AR ms':>8} {'AR tok/s':>9}"
        for size in c.block_sizes[1:]:
            header += f" {f'B={size} ms':>9}" + "".join(f" {f'x@{tau:.2f}':>7}" for tau in taus)
        lines.append(header)
        for variant in c.variants:
            for batch in c.batches:
                ar = self.cycle_ms(variant, 1, batch)
                if ar is None and all(self.cycle_ms(variant, b, batch) is None for b in c.block_sizes):
                    continue
                line = f"{variant:>9} {batch:>5} {_f(ar, 3):>8} {_f(ar and batch * 1e3 / ar, 0):>9}"
                for size in c.block_sizes[1:]:
                    cycle = self.cycle_ms(variant, size, batch)
                    line += f" {_f(cycle, 3):>9}" + "".join(
                        f" {_f(tau * ar / cycle if ar and cycle else None, 2):>7}" for tau in taus)
                lines.append(line)
        if self.pair:
            lines.append(f"pair on {m['device']} vs CPU: {self.pair}")
        return "\n".join(lines + [f"error: {e}" for e in self.errors()])


def _f(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def inductor_modules(target, drafter, max_context: int) -> tuple[dict[str, Callable], float]:
    """The step graphs exported and compiled by AOTInductor in-process (build's compiler), loaded."""
    from torch._inductor import aoti_load_package

    began, modules = time.perf_counter(), {}
    specs = graph_specs(target.config, drafter.config, drafter.draft_vocab_size)
    with tempfile.TemporaryDirectory() as folder:
        for name, module in step_modules(target, drafter).items():
            package = Path(folder) / f"{name}.pt2"
            compile_package(export_program(module, specs[name], max_context, target.dtype, target.device), package)
            modules[name] = aoti_load_package(str(package))
    return modules, time.perf_counter() - began


def engine_runner(target, drafter, variant: str, slots: int, max_context: int,
                  modules: dict[str, Callable] | None = None) -> BatchRunner:
    """The engine's runner over the variant's executor, with `slots` cache slots."""
    if variant == "inductor":
        specs = graph_specs(target.config, drafter.config, drafter.draft_vocab_size)
        executor = InductorExecutor(modules, target.device, specs, cuda_graphs=target.device.type == "cuda")
        return BatchRunner(executor, specs, target.dtype, slots, max_context, None, drafter.config.mask_token_id,
                           static=target.device.type == "cuda", draft_ids=drafter.draft_ids)
    return BatchRunner.eager(target, drafter, slots, cuda_graphs=variant == "graphs", max_context=max_context)


def measure_batches(runner: BatchRunner, config: EngineCostConfig, variant: str, prompts: list[list[int]],
                    on_row: Callable[[EngineCost], None]) -> None:
    """Every (block size, batch) of `config` through one local engine over `runner` (slots: the largest
    batch): a first request batch that captures what the timed one replays, then the timed one."""
    for block_size in config.block_sizes:
        block_runner = runner if block_size > 1 else runner.with_slots(runner.slots, drafter=False)
        for batch in config.batches:
            row = EngineCost(variant, block_size, batch)
            try:
                local = LocalEngine(block_runner, config=EngineConfig(max_running=batch, max_queued=batch, prefill_chunk=0))
                requests = [GenerationConfig(block=BlockChoice(block_size), max_new_tokens=config.new_tokens)] * batch
                began = time.perf_counter()
                local.generate(prompts[:batch], requests)
                row.start_s = time.perf_counter() - began
                timed = local.generate(prompts[:batch], requests)
                row.cycle_ms = statistics.median(g.stats.decode_s / g.stats.cycles * 1e3 for g in timed)
            except Exception as error:  # noqa: BLE001 - recorded in the report, the run goes on
                row.error = f"{variant} B={block_size} batch={batch}: {type(error).__name__}: {error}"
            on_row(row)


def measure(config: EngineCostConfig, device: torch.device, dtype: torch.dtype,
            on_progress: Callable[[EngineCosts], None] = lambda costs: None) -> EngineCosts:
    """Every variant's (block size, batch) cycles; `on_progress` sees the report after each row."""
    target_config = SHAPES[config.shape]
    target, drafter = random_pair(target_config, drafter_config(target_config), device, dtype)
    costs = EngineCosts(config, describe_machine(device, dtype, "trtspec engine"))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, target_config.vocab_size - 1, (config.prompt_tokens,), generator=generator).tolist()
               for _ in range(max(config.batches))]
    context = config.prompt_tokens + config.new_tokens + 64

    def add(row: EngineCost) -> None:
        costs.rows.append(row)
        on_progress(costs)

    for variant in config.variants:  # inductor last: the slowest to start, so a cut run keeps the rest
        modules = None
        try:
            if variant == "inductor":
                modules, costs.compile_s[variant] = inductor_modules(target, drafter, context)
            runner = engine_runner(target, drafter, variant, max(config.batches), context, modules)
        except Exception as error:  # noqa: BLE001 - recorded in the report, the run goes on
            add(EngineCost(variant, 0, 0, error=f"{variant}: {type(error).__name__}: {error}"))
            continue
        measure_batches(runner, config, variant, prompts, add)
        del runner, modules  # caches and captured graphs
    return costs


def pair_check(device: torch.device, prompts: list[str], block_sizes: tuple[int, ...], max_new_tokens: int,
               target: str | Path | None = None, drafter: str | Path | None = None) -> dict:
    """A trained pair (the default pair unless named; float32) decoded through the batched engine on
    `device` and on the CPU, mixed block sizes in one batch: identical greedy outputs, and its tau on
    `device` at the largest size."""
    from trtspec.api import Pipeline

    try:
        pipelines = [Pipeline(target, drafter, dtype="float32", device=where) for where in (str(device), "cpu")]
        configs = [GenerationConfig(block=BlockChoice(block_sizes[i % len(block_sizes)]), max_new_tokens=max_new_tokens)
                   for i in range(len(prompts))]
        on_device, on_cpu = (p.generate_batch(prompts, configs, max_running=8) for p in pipelines)
        largest = [r.generation.stats.tau for r, c in zip(on_device, configs) if c.block.size == max(block_sizes)]
        return {"requests": len(prompts), "identical": sum(a.tokens == b.tokens for a, b in zip(on_device, on_cpu)),
                "block_sizes": list(block_sizes), "tau": statistics.mean(largest) if largest else None,
                "tau_block_size": max(block_sizes)}
    except Exception as error:  # noqa: BLE001 - recorded in the report
        return {"error": f"pair: {type(error).__name__}: {error}"}

"""`trtspec bench --profile`: where a decode cycle's time goes, per block size: draft, verify, host.

Model time is the time inside the executor's draft and verify runs, each counted apart (an AR step
is a verify of one token); host time is everything else
in the decode phase (the controller's accept / commit / stop / statistics work, the engine's
bookkeeping, moving tokens). Both controllers run the same loop over the same engine, interleaved
per repeat: the native controller that the product uses, and the pure-Python reference controller the
tests check it against (trtspec.runtime.reference).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from trtspec.perf.bench import BenchConfig, check_prompts, speedups
from trtspec.perf.machine import machine_info
from trtspec.engines.executor import PREFILL
from trtspec.export.bindings import DRAFT, TARGET
from trtspec.errors import TrtspecError
from trtspec.runtime.controller import native_controller
from trtspec.runtime.engine import EngineConfig, LocalEngine
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.reference import PythonController
from trtspec.runtime.schedule import BlockChoice
from trtspec.runtime.stats import decode_tokens
from trtspec.perf.sweep import run_sweep

CONTROLLERS = ("python", "native")


class ExecutorClock:
    """Seconds spent inside the executor's decode-cycle runs (prefill excluded) while active, in all
    and per graph (`by_graph`: draft, target)."""

    def __init__(self, executor):
        self.executor = executor
        self.by_graph: dict[str, float] = {DRAFT: 0.0, TARGET: 0.0}
        self._cuda = executor.device.type == "cuda"

    @property
    def seconds(self) -> float:
        return sum(self.by_graph.values())

    def __enter__(self) -> "ExecutorClock":
        run = self.executor.run

        def timed(graph, profile, inputs, outputs) -> None:
            began = time.perf_counter()
            run(graph, profile, inputs, outputs)
            if self._cuda:  # launches are asynchronous: wait, so the model's time is counted as model
                torch.cuda.synchronize(self.executor.device)
            if profile != PREFILL:
                self.by_graph[graph] += time.perf_counter() - began

        self.executor.run = timed  # an instance attribute shadows the method while profiling
        return self

    def __exit__(self, *exc) -> None:
        del self.executor.run


@dataclass
class HostRun:
    """One (block size, controller) over every prompt of every repeat: sums per repeat."""

    block_size: int
    controller: str
    cycles: list[int] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    model_s: list[float] = field(default_factory=list)
    draft_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    outputs: list[list[list[int]]] = field(default_factory=list)  # [repeat][prompt] tokens

    def start_repeat(self) -> None:
        for series in (self.cycles, self.decode_s, self.model_s, self.draft_s, self.tokens, self.outputs):
            series.append([] if series is self.outputs else 0)

    def add(self, generation, model_s: float, draft_s: float) -> None:
        """Count one request of the current repeat, `model_s` of it inside the executor (`draft_s`
        of that in the draft graph)."""
        stats = generation.stats
        self.cycles[-1] += stats.cycles
        self.decode_s[-1] += stats.decode_s
        self.model_s[-1] += model_s
        self.draft_s[-1] += draft_s
        self.tokens[-1] += decode_tokens(stats.new_tokens)
        self.outputs[-1].append(generation.tokens)

    @property
    def cycle_ms(self) -> float:
        return statistics.median([d / c * 1e3 for d, c in zip(self.decode_s, self.cycles)])

    @property
    def model_ms(self) -> float:
        return statistics.median([m / c * 1e3 for m, c in zip(self.model_s, self.cycles)])

    @property
    def draft_ms(self) -> float:
        return statistics.median([d / c * 1e3 for d, c in zip(self.draft_s, self.cycles)])

    @property
    def verify_ms(self) -> float:
        return statistics.median([(m - d) / c * 1e3 for m, d, c in zip(self.model_s, self.draft_s, self.cycles)])

    @property
    def host_us_repeats(self) -> list[float]:
        return [(d - m) / c * 1e6 for d, m, c in zip(self.decode_s, self.model_s, self.cycles)]

    @property
    def host_us(self) -> float:
        return statistics.median(self.host_us_repeats)

    @property
    def host_fraction(self) -> float:
        return statistics.median([(d - m) / d for d, m in zip(self.decode_s, self.model_s)])

    @property
    def tokens_per_s_repeats(self) -> list[float]:
        return [t / d for t, d in zip(self.tokens, self.decode_s)]


@dataclass
class HostProfile:
    prompts: str
    n_prompts: int
    config: BenchConfig
    runs: dict[tuple[int, str], HostRun]
    machine: dict

    def speedup(self, run: HostRun) -> float:
        """Decode speed-up vs AR through the same controller, median over repeats."""
        ar = self.runs[(1, run.controller)]
        return statistics.median(speedups(run.tokens_per_s_repeats, ar.tokens_per_s_repeats))

    def identical(self, block_size: int) -> tuple[int, int]:
        """Requests whose tokens are the same through both controllers, and all requests."""
        python, native = (self.runs[(block_size, c)].outputs for c in CONTROLLERS)
        pairs = [(a, b) for ra, rb in zip(python, native) for a, b in zip(ra, rb)]
        return sum(a == b for a, b in pairs), len(pairs)

    def rows(self) -> list[dict]:
        rows = []
        for (block_size, controller), run in self.runs.items():
            same, total = self.identical(block_size)
            rows.append({"block_size": block_size, "controller": controller, "cycle_ms": run.cycle_ms,
                         "model_ms": run.model_ms, "draft_ms": run.draft_ms,
                         "verify_ms": run.verify_ms, "host_us": run.host_us, "host_fraction": run.host_fraction,
                         "cycles": sum(run.cycles), "decode_tokens_per_s": statistics.median(run.tokens_per_s_repeats),
                         "speedup_vs_ar": self.speedup(run), "identical_outputs": same, "requests": total,
                         "host_us_repeats": run.host_us_repeats})
        return rows

    def to_dict(self) -> dict:
        return {"host_profile": self.rows(), "machine": self.machine, "prompts": self.prompts,
                "n_prompts": self.n_prompts, "repeats": self.config.repeats,
                "max_new_tokens": self.config.max_new_tokens, "temperature": self.config.sampling.temperature}

    def format_table(self) -> str:
        m, c = self.machine, self.config
        lines = [f"{self.prompts}: {self.n_prompts} prompts x {c.repeats} repeats, T={c.sampling.temperature:g}, "
                 f"max {c.max_new_tokens} new tokens | {m['backend']} on {m['device']}, torch threads "
                 f"{m['torch_threads']}",
                 "time per decode cycle: model = the executor's draft + verify runs (AR: one verify of 1 token), "
                 "host = everything else",
                 f"{'B':>4}  {'controller':>10}  {'cycle ms':>8}  {'draft ms':>8}  {'verify ms':>9}  "
                 f"{'host us':>8}  {'host':>6}  "
                 f"{'tok/s':>7}  {'speed-up':>8}  {'identical':>9}"]
        for row in self.rows():
            lines.append(f"{BlockChoice(row['block_size']).name:>4}  {row['controller']:>10}  {row['cycle_ms']:>8.2f}  "
                         f"{row['draft_ms']:>8.2f}  {row['verify_ms']:>9.2f}  {row['host_us']:>8.1f}  {row['host_fraction']:>6.1%}  "
                         f"{row['decode_tokens_per_s']:>7.1f}  {row['speedup_vs_ar']:>7.2f}x  "
                         f"{row['identical_outputs']:>4}/{row['requests']}")
        for block_size in (1, *(b.size for b in c.block_sizes)):
            python, native = (self.runs[(block_size, name)] for name in CONTROLLERS)
            lines.append(f"B={BlockChoice(block_size).name}: native host time is "
                         f"{native.host_us / python.host_us:.2f}x the Python loop's; "
                         f"speed-up {self.speedup(python):.2f}x -> {self.speedup(native):.2f}x")
        return "\n".join(lines)


def run_host_profile(pipeline, prompts: list[str], config: BenchConfig, *, prompts_name: str = "prompts",
                     progress: bool = True) -> HostProfile:
    """AR and every block size through both controllers, taking turns per prompt (compiled engines only)."""
    if pipeline.runner.manifest is None:
        raise TrtspecError("--profile times the executor's graph runs; give a built engine (--engine DIR)")
    if any(c.auto or c.grow_to for c in config.block_sizes):
        raise TrtspecError("--profile measures fixed block sizes; leave auto and growing blocks B:G out "
                           "of --block-sizes")
    check_prompts(pipeline, prompts)
    baseline = pipeline.autoregressive()
    clock = ExecutorClock(pipeline.runner.executor)  # the baseline's runner shares it

    def through(controller):
        """Requests decoded with `controller`, each yielding its generation and its model seconds."""
        engines = {ar: LocalEngine(source.runner, source.policy, EngineConfig(max_running=1, prefill_chunk=0),
                                   tuple(pipeline.codec.stop_ids), controller=controller)
                   for ar, source in ((True, baseline), (False, pipeline))}

        def request(choice: BlockChoice, ids: list[int], config: GenerationConfig):
            before, drafted = clock.seconds, clock.by_graph[DRAFT]
            generation = engines[choice.ar].generate([ids], [config])[0]
            return generation, clock.seconds - before, clock.by_graph[DRAFT] - drafted
        return request

    encoded = [pipeline.codec.encode(p) for p in prompts]
    with clock:  # the controllers take turns prompt by prompt, so a machine's drift reaches both alike
        done = run_sweep([through(PythonController), through(native_controller)], encoded,
                         config.sweep(), desc="profile", progress=progress)
    runs = {}
    for c, choice in enumerate(done.schedule):
        for v, name in enumerate(CONTROLLERS):
            run = runs[(choice.size, name)] = HostRun(choice.size, name)
            for repeat in done.of(c, v):
                run.start_repeat()
                for generation, model_s, draft_s in repeat:
                    run.add(generation, model_s, draft_s)
            if 0 in run.cycles:
                raise TrtspecError("no decode cycles ran (every prompt stopped at its first token)")
    return HostProfile(prompts=prompts_name, n_prompts=len(prompts), config=config, runs=runs,
                       machine=machine_info(pipeline))

"""Cycle costs: what draft(B), verify(B) and an autoregressive step cost on a device, eager and
replayed from CUDA graphs, and how much of a whole decode cycle through the runtime is host work.

Why: a block size pays off when tau grows faster than the cycle's cost, and on a GPU that cost is
shaped by what only a GPU shows: verify(B) stays near the cost of reading the weights once for
small B, replay removes the per-kernel launch cost, and the host work between graphs (controller
step, token copies, the one sync per cycle) becomes a visible share of a short replayed cycle.

The shapes are what matters, not the weights: `random_pair` builds a Qwen3 target and a DFlash
drafter with random weights, allocated directly on the device (a Qwen3-4B target never touches
the CPU). The step timings run the export step modules (`export/steps.py`, the functions every
backend compiles) over whole fixed-size caches, as replay needs; their drafter reads B context
rows (a fully accepted block). The decode cycles run the runtime's own runner, torch
executor, native controller and engine over those same modules (what `trtspec build
--backend torch` would save, without minutes of torch.export), launched op by op or replayed.

A cycle's host share is `trtspec bench --profile`'s: 1 - model / cycle, where cycle is the
wall time per decode cycle and model the time inside the executor's draft and verify runs
(`ExecutorClock`, in a separate request: on a GPU it waits for each run, which the timed requests
must not). Replayed, model time is device time; launched op by op it includes the launches.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from trtspec.perf.machine import describe_machine
from trtspec.timing import Timer
from trtspec.engines.capture import CudaGraphs
from trtspec.engines.torch import TorchExecutor
from trtspec.errors import TrtspecError
from trtspec.fileio import atomic_write_text
from trtspec.export.bindings import graph_specs
from trtspec.export.exporter import step_modules
from trtspec.export.steps import DraftStep, TargetStep
from trtspec.perf.host_profile import ExecutorClock
from trtspec.models import DFlashConfig, DFlashDrafter, Qwen3Config, Qwen3Target, default_target_layer_ids
from trtspec.models.checkpoint import build_empty
from trtspec.runtime.engine import EngineConfig, LocalEngine
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.runner import BatchRunner
from trtspec.runtime.schedule import BlockChoice

# Qwen3-4B's decoder (its config.json); DFlash's Qwen3-4B drafters have 5 layers reading 5 target layers.
QWEN3_4B = Qwen3Config(vocab_size=151_936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0,
                       max_position_embeddings=40_960, tie_word_embeddings=True)
# The same code path at a size a CPU runs in seconds (the dry run of scripts/gpu/run.sh).
TINY = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1_000_000.0,
                   max_position_embeddings=4096, tie_word_embeddings=True)
SHAPES = {"qwen3-4b": QWEN3_4B, "tiny": TINY}
DRAFTER_LAYERS, DRAFTER_FEATURES = 5, 5


def script_shape(device: str, shape: str | None) -> str:
    """The model shape a GPU script measures: `shape`, else qwen3-4b on CUDA and tiny on the CPU;
    a CUDA run without a device, or the 4B shape on a CPU, is refused in one line."""
    if device == "cuda" and not torch.cuda.is_available():
        raise TrtspecError("no CUDA device visible (use --device cpu for the tiny shape)")
    shape = shape or ("qwen3-4b" if device == "cuda" else "tiny")
    if shape == "qwen3-4b" and device == "cpu":
        raise TrtspecError("a Qwen3-4B-shaped model on the CPU takes tens of GB and minutes per cycle; "
                           "use --shape tiny")
    return shape


def write_report(out: Path, stem: str, report) -> None:
    """`report` (to_dict, format_table) as OUT/STEM.json and OUT/STEM.txt, each written atomically."""
    atomic_write_text(out / f"{stem}.json", json.dumps(report.to_dict(), indent=2) + "\n")
    atomic_write_text(out / f"{stem}.txt", report.format_table() + "\n")


def drafter_config(target: Qwen3Config, layers: int = DRAFTER_LAYERS, features: int = DRAFTER_FEATURES,
                   block_size: int = 16) -> DFlashConfig:
    """A DFlash drafter for `target`: its layer shape, `layers` layers, reading `features` target layers."""
    return DFlashConfig(**{**target.to_dict(), "num_hidden_layers": layers, "tie_word_embeddings": False},
                        block_size=block_size, mask_token_id=target.vocab_size - 1,
                        target_layer_ids=tuple(default_target_layer_ids(target.num_hidden_layers, features)),
                        num_target_layers=target.num_hidden_layers)


def random_pair(target_config: Qwen3Config, drafter_cfg: DFlashConfig, device: torch.device,
                dtype: torch.dtype, seed: int = 0) -> tuple[Qwen3Target, DFlashDrafter]:
    """A target and its drafter with random weights, allocated once on `device` in `dtype`."""
    target = build_empty(lambda: Qwen3Target(target_config), device, dtype)
    if target_config.tie_word_embeddings:  # materialising from meta unties shared weights; tie them again
        target.lm_head.weight = target.model.embed_tokens.weight
    drafter = build_empty(lambda: DFlashDrafter(drafter_cfg), device, dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for model in (target, drafter):
            for param in model.parameters():
                if param.dim() == 1:  # norm weights
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02, generator=generator)
    return target.eval(), drafter.eval().bind(target)


def cycle_inputs(target: Qwen3Target, drafter: DFlashDrafter, block_size: int, past: int,
                 device: torch.device, batch: int = 1) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Static inputs of verify(B) and draft(B) for `batch` requests over whole fixed-size caches
    with `past` valid positions each (the shapes CUDA-graph replay needs: nothing depends on how
    much is cached)."""
    t, d = target.config, drafter.config
    capacity, dtype = past + 64, target.dtype

    def cache(layers: int, heads: int, dim: int) -> torch.Tensor:
        return torch.randn(capacity, batch, layers, heads, dim, device=device, dtype=dtype)

    slots = torch.arange(batch, device=device)
    starts = torch.full((batch,), past, device=device)
    target_in = (torch.randint(2, t.vocab_size, (batch, block_size), device=device), starts, slots,
                 cache(t.num_hidden_layers, t.num_key_value_heads, t.head_dim),
                 cache(t.num_hidden_layers, t.num_key_value_heads, t.head_dim))
    draft_in = (torch.randn(batch, block_size, d.num_features * d.hidden_size, device=device, dtype=dtype),
                torch.full((batch,), block_size, device=device),
                torch.full((batch, block_size), d.mask_token_id, device=device),
                starts + block_size, slots,
                cache(d.num_hidden_layers, d.num_key_value_heads, d.head_dim),
                cache(d.num_hidden_layers, d.num_key_value_heads, d.head_dim))
    return target_in, draft_in


def replayed_ms(fn: Callable[[], object], timer: Timer) -> float | None:
    """Median ms of `fn` captured once as a CUDA graph (the executors' capture protocol) and
    replayed; None on the CPU."""
    if timer.device.type != "cuda":
        return None
    graphs = CudaGraphs(timer.device)
    graphs.run("step", fn)  # warm-up, capture, first replay
    return timer(graphs.graphs["step"].replay)


@dataclass
class StepCost:
    """One step function at one block size (1: the autoregressive step, verify of one token)."""

    step: str  # "draft" or "verify"
    block_size: int
    eager_ms: float | None = None
    graph_ms: float | None = None
    error: str | None = None


@dataclass
class LoopCost:
    """Decode cycles of one request shape through the runtime (`generate`) at one block size."""

    block_size: int
    loop: str  # "graphs" (static bindings replayed from CUDA graphs) or "eager" (launched op by op)
    cycle_ms: float | None = None   # wall time per cycle, median over the timed requests
    model_ms: float | None = None   # of it, inside the executor's draft and verify runs
    cycles: int = 0
    tau: float = 0.0
    error: str | None = None

    @property
    def host_share(self) -> float | None:
        if self.cycle_ms is None or self.model_ms is None:
            return None
        return 1.0 - self.model_ms / self.cycle_ms


@dataclass(frozen=True)
class CycleCostConfig:
    shape: str = "qwen3-4b"
    block_sizes: tuple[int, ...] = (8, 12, 16, 20, 24)
    past: int = 512        # cached positions in the step timings; the runtime's context (+ one block of slack)
    prompt_tokens: int = 64
    new_tokens: int = 64   # per request of the decode-cycle runs (random weights accept ~nothing: ~1 cycle a token)
    requests: int = 3      # timed requests per decode-cycle run, after one warm-up request
    repeats: int = 30      # timed calls per step timing, after `warmup`
    warmup: int = 3

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise TrtspecError(f"shape must be one of {', '.join(SHAPES)}; got {self.shape!r}")
        if self.prompt_tokens + self.new_tokens > self.past:
            raise TrtspecError(f"a request of {self.prompt_tokens} prompt + {self.new_tokens} new tokens does not "
                               f"fit --past {self.past}")
        if min(self.requests, self.repeats) < 1:
            raise TrtspecError("requests and repeats must be >= 1")


@dataclass
class CycleCosts:
    config: CycleCostConfig
    machine: dict
    steps: list[StepCost] = field(default_factory=list)
    loops: list[LoopCost] = field(default_factory=list)
    floor: dict | None = None        # the weight-read floor under a batch-1 step (weight_read_floor)
    kernels: dict[str, list[dict]] = field(default_factory=dict)  # "verify B=16" -> its costliest kernels
    failures: list[str] = field(default_factory=list)             # of the floor and kernel profiles

    def step(self, name: str, block_size: int) -> StepCost | None:
        return next((s for s in self.steps if s.step == name and s.block_size == block_size), None)

    def cycle_ms(self, block_size: int, kind: str) -> float | None:
        """draft(B) + verify(B) ms ("eager_ms" or "graph_ms"); the AR step (B = 1) runs no drafter."""
        parts = [self.step("verify", block_size)] + ([self.step("draft", block_size)] if block_size > 1 else [])
        times = [getattr(p, kind) if p is not None else None for p in parts]
        return None if None in times else sum(times)

    def to_dict(self) -> dict:
        return {"config": {**asdict(self.config), "block_sizes": list(self.config.block_sizes)},
                "target": SHAPES[self.config.shape].to_dict(), "drafter_layers": DRAFTER_LAYERS,
                "machine": self.machine, "steps": [asdict(s) for s in self.steps],
                "loops": [{**asdict(loop), "host_share": loop.host_share} for loop in self.loops],
                "floor": self.floor, "kernels": self.kernels, "errors": self.errors()}

    def errors(self) -> list[str]:
        return [e for e in (*(s.error for s in self.steps), *(x.error for x in self.loops), *self.failures) if e]

    def format_table(self) -> str:
        m, c = self.machine, self.config
        loops = {(x.block_size, x.loop): x for x in self.loops}
        lines = [f"{c.shape} target + {DRAFTER_LAYERS}-layer drafter, random weights | {m.get('gpu', m['device'])}, "
                 f"{m['dtype']}, torch {m['torch']} | steps over {c.past} cached positions, medians of {c.repeats}",
                 "ms per call; cycle = draft + verify; loop = wall ms per decode cycle through the runtime "
                 "(host share: outside the draft and verify runs)",
                 f"{'B':>3}  {'draft eager':>11}  {'draft graph':>11}  {'verify eager':>12}  {'verify graph':>12}  "
                 f"{'cycle eager':>11}  {'cycle graph':>11}  {'loop eager':>15}  {'loop graphs':>15}"]
        for block_size in (1, *c.block_sizes):
            draft, verify = self.step("draft", block_size), self.step("verify", block_size)
            lines.append(f"{'AR' if block_size == 1 else block_size:>3}  "
                         f"{_ms(draft and draft.eager_ms):>11}  {_ms(draft and draft.graph_ms):>11}  "
                         f"{_ms(verify and verify.eager_ms):>12}  {_ms(verify and verify.graph_ms):>12}  "
                         f"{_ms(self.cycle_ms(block_size, 'eager_ms')):>11}  "
                         f"{_ms(self.cycle_ms(block_size, 'graph_ms')):>11}  "
                         f"{_loop(loops.get((block_size, 'eager'))):>15}  {_loop(loops.get((block_size, 'graphs'))):>15}")
        if self.floor is not None:
            ar = self.step("verify", 1)
            floor = self.floor["floor_ms"]
            lines.append(f"weight-read floor: {self.floor['weight_bytes'] / 1e9:.2f} GB of weights at "
                         f"{self.floor['copy_bandwidth_gb_s']:.0f} GB/s copy bandwidth = {floor:.3f} ms; AR step "
                         + (f"{ar.graph_ms / floor:.2f}x the floor (graph)" if ar and ar.graph_ms else
                            f"{ar.eager_ms / floor:.2f}x the floor (eager)" if ar and ar.eager_ms else "-"))
        for name, kernels in self.kernels.items():
            lines.append(f"{name}: costliest kernels, ms per call (share of the call's device time)")
            lines += [f"  {k['ms']:8.3f}  {k['share']:5.1%}  x{k['calls']:<4} {k['name'][:90]}" for k in kernels]
        return "\n".join(lines + [f"error: {e}" for e in self.errors()])


def weight_read_floor(model: torch.nn.Module, timer: Timer) -> dict:
    """The time to read every weight of `model` once at the device's measured copy bandwidth (read
    + write bytes of a large device-to-device copy per second): no batch-1 step can beat it."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied weight once
    size = (1 << 30) if timer.device.type == "cuda" else (64 << 20)
    source = torch.empty(size, dtype=torch.uint8, device=timer.device)
    target = torch.empty_like(source)
    bandwidth = 2 * size / (timer(lambda: target.copy_(source)) / 1e3)
    return {"weight_bytes": weight_bytes, "copy_bandwidth_gb_s": bandwidth / 1e9,
            "floor_ms": weight_bytes / bandwidth * 1e3}


def kernel_profile(call: Callable[[], object], device: torch.device, calls: int = 5, top: int = 12) -> list[dict]:
    """The `top` costliest kernels of `call` by device time per call (torch.profiler; on a CPU, ops
    by self CPU time), with their share of the call's total."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    call()
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as profiler:
        for _ in range(calls):
            call()
        if cuda:
            torch.cuda.synchronize(device)
    events = [(e.key, (e.self_device_time_total if cuda else e.self_cpu_time_total) / calls / 1e3, e.count // calls)
              for e in profiler.key_averages()]
    total = sum(ms for _, ms, _ in events) or 1.0
    events.sort(key=lambda event: -event[1])
    return [{"name": name, "ms": ms, "share": ms / total, "calls": count} for name, ms, count in events[:top]]


def _ms(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


def _loop(cost: LoopCost | None) -> str:
    if cost is None or cost.cycle_ms is None:
        return "-"
    share = cost.host_share
    return f"{cost.cycle_ms:.3f}" + (f" ({share:.0%})" if share is not None else "")


def measure_steps(target: Qwen3Target, drafter: DFlashDrafter, block_size: int, past: int,
                  timer: Timer) -> list[StepCost]:
    """verify(B) and draft(B) at `block_size` (verify alone at 1: the AR step), eager and replayed."""
    verify_step, draft_step = TargetStep(target, tuple(drafter.config.target_layer_ids)), DraftStep(drafter)
    target_in, draft_in = cycle_inputs(target, drafter, block_size, past, target.device)
    calls = [("verify", lambda: verify_step(*target_in))]
    if block_size > 1:
        calls.append(("draft", lambda: draft_step(*draft_in)))
    costs = []
    with torch.inference_mode():
        for name, call in calls:
            cost = StepCost(name, block_size)
            try:  # one failure (a capture the device refuses) must not cost the other figures
                cost.eager_ms = timer(call)
                cost.graph_ms = replayed_ms(call, timer)
            except Exception as error:  # noqa: BLE001 - recorded in the report, the run goes on
                cost.error = f"{name} B={block_size}: {type(error).__name__}: {error}"
            costs.append(cost)
    return costs


def profile_steps(costs: CycleCosts, target: Qwen3Target, drafter: DFlashDrafter, timer: Timer) -> None:
    """The weight-read floor, and the costliest kernels of the AR step, verify(B) and draft(B) at the
    largest block size measured, over the same inputs as the step timings."""
    size, past = max(costs.config.block_sizes), costs.config.past
    verify_step, draft_step = TargetStep(target, tuple(drafter.config.target_layer_ids)), DraftStep(drafter)
    with torch.inference_mode():
        try:
            costs.floor = weight_read_floor(target, timer)
        except Exception as error:  # noqa: BLE001 - recorded in the report, the run goes on
            costs.failures.append(f"weight-read floor: {type(error).__name__}: {error}")
        ar_in = cycle_inputs(target, drafter, 1, past, target.device)[0]
        target_in, draft_in = cycle_inputs(target, drafter, size, past, target.device)
        for name, call in (("AR step", lambda: verify_step(*ar_in)), (f"verify B={size}", lambda: verify_step(*target_in)),
                           (f"draft B={size}", lambda: draft_step(*draft_in))):
            try:
                costs.kernels[name] = kernel_profile(call, target.device)
            except Exception as error:  # noqa: BLE001 - recorded in the report, the run goes on
                costs.failures.append(f"kernel profile {name}: {type(error).__name__}: {error}")


def runtime_engine(target: Qwen3Target, drafter: DFlashDrafter, block_sizes: tuple[int, ...], max_context: int,
                   cuda_graphs: bool) -> BatchRunner:
    """The runtime's runner and torch executor over the step modules, as `BatchRunner.open` would
    give for an engine built from this pair (static bindings replayed from CUDA graphs, or not)."""
    specs = graph_specs(target.config, drafter.config, drafter.draft_vocab_size)
    executor = TorchExecutor(step_modules(target, drafter), target.device, specs, cuda_graphs=cuda_graphs)
    return BatchRunner(executor, specs, target.dtype, 1, max_context, tuple(block_sizes),
                       drafter.config.mask_token_id, static=cuda_graphs and target.device.type == "cuda",
                       draft_ids=drafter.draft_ids)


def measure_loop(engine: BatchRunner, prompt: list[int], block_size: int, config: CycleCostConfig,
                 cost: LoopCost) -> LoopCost:
    """Wall time per decode cycle of `requests` identical requests after a warm-up request (which
    also captures every binding the timed ones replay: the same prompt takes the same cycles), and
    the model's part of it: clocked in those requests on a CPU, where the clock adds nothing, and in
    one more request on a GPU, where it waits for every run."""
    request = GenerationConfig(block=BlockChoice(block_size), max_new_tokens=config.new_tokens)
    local = LocalEngine(engine.with_slots(1, drafter=False) if block_size == 1 else engine,
                        config=EngineConfig(max_running=1, prefill_chunk=0))
    clock, on_cpu = ExecutorClock(engine.executor), engine.device.type == "cpu"

    def generate():
        return local.generate([prompt], [request])[0]
    try:
        generate()
        per_cycle, clocked_cycles = [], 0
        with clock if on_cpu else contextlib.nullcontext():
            for _ in range(config.requests):
                stats = generate().stats
                per_cycle.append(stats.decode_s / stats.cycles * 1e3)
                clocked_cycles += stats.cycles if on_cpu else 0
        if not on_cpu:
            with clock:
                clocked_cycles = generate().stats.cycles
        cost.cycle_ms, cost.cycles, cost.tau = statistics.median(per_cycle), stats.cycles, stats.tau
        cost.model_ms = clock.seconds / clocked_cycles * 1e3
    except Exception as error:  # noqa: BLE001 - recorded in the report, the run goes on
        cost.error = f"{cost.loop} loop B={block_size}: {type(error).__name__}: {error}"
    return cost


def measure(config: CycleCostConfig, device: torch.device, dtype: torch.dtype,
            on_progress: Callable[[CycleCosts], None] = lambda costs: None) -> CycleCosts:
    """Every step timing, then every decode-cycle run; `on_progress` sees the report after each
    block size (so a run cut short still leaves what it measured)."""
    target_config = SHAPES[config.shape]
    target, drafter = random_pair(target_config, drafter_config(target_config), device, dtype)
    costs = CycleCosts(config, describe_machine(device, dtype, "torch step modules"))
    timer = Timer(device, config.repeats, config.warmup)
    for block_size in (1, *config.block_sizes):
        costs.steps += measure_steps(target, drafter, block_size, config.past, timer)
        on_progress(costs)
    profile_steps(costs, target, drafter, timer)
    on_progress(costs)
    prompt = torch.randint(2, target_config.vocab_size - 1, (config.prompt_tokens,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    loops = (["graphs"] if device.type == "cuda" else []) + ["eager"]  # the product's path first
    for loop in loops:
        engine = runtime_engine(target, drafter, config.block_sizes, config.past, cuda_graphs=loop == "graphs")
        for block_size in (1, *config.block_sizes):
            costs.loops.append(measure_loop(engine, prompt, block_size, config, LoopCost(block_size, loop)))
            on_progress(costs)
        del engine  # its caches and captured graphs
    return costs


def tiny(config: CycleCostConfig) -> CycleCostConfig:
    """`config` at the tiny shape with a CPU's budget of repeats."""
    return replace(config, shape="tiny", past=128, prompt_tokens=16, new_tokens=16, requests=2, repeats=5, warmup=1)

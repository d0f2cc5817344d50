"""BlockPilot's cost table: milliseconds per decode cycle by block size and batch, timed on the
engine's runner the first time an engine of its kind starts on a machine (`measure_costs`, kept by
`cached_costs`), and the line that fits it to the cycles the engine then measures
(`fit_host_work`). The load-aware chooser (trtspec.blockpilot.load) judges by them;
`bench --concurrency --json` reports the table beside the cycles the engine measured."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from trtspec.errors import TrtspecError
from trtspec.fileio import atomic_write_text, cache_root, key_digest, stderr_line, take_turns
from trtspec.timing import Timer

BATCHES = (1, 2, 4, 8, 16)
ROUNDS = 9
CONTEXT = 256
COSTS_DIR = "costs"  # under the cache directory ($TRTSPEC_CACHE): one JSON file per table


@dataclass
class CostTable:
    """Milliseconds per decode cycle (draft + verify; AR: verify(1)) by block size and batch."""

    batches: tuple[int, ...]
    cycle_ms: dict[int, list[float]]  # block size -> one figure per batch

    def cost(self, block_size: int, batch: int) -> float:
        """Interpolated over the measured batches (held flat beyond them)."""
        return float(np.interp(batch, self.batches, self.cycle_ms[block_size]))

    def to_dict(self) -> dict:
        return {"batches": list(self.batches), "cycle_ms": {str(b): ms for b, ms in self.cycle_ms.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "CostTable":
        """The inverse of `to_dict`; ValueError unless every row has one positive figure per batch."""
        batches = tuple(int(b) for b in data["batches"])
        cycle_ms = {int(size): [float(ms) for ms in row] for size, row in data["cycle_ms"].items()}
        if not batches or any(len(row) != len(batches) or min(row) <= 0 for row in cycle_ms.values()):
            raise ValueError("not a cost table")
        return cls(batches, cycle_ms)


def cached_costs(runner, block_sizes: tuple[int, ...], identity: dict,
                 echo: Callable[[str], None] = stderr_line) -> CostTable:
    """`measure_costs`, kept: the first engine of its kind on a machine times the table (seconds:
    a server's start-up, each Ray replica's), later ones read it from the cache. The entry's key is
    everything the timing depends on: `identity` (what the caller runs: the models' configurations or
    the engine's graphs, backend, dtype, device, threads), the runner's slots and context, the block
    sizes and the trtspec code that runs the calls. Only relative costs matter: the engine replaces
    the figures with its own cycles as they run (trtspec.blockpilot.load). Engines starting together
    (a deployment's replicas) take turns: one times the table, alone on the machine, and the others
    read it. An entry that cannot be read is timed again; a cache that cannot be written is skipped.
    `echo` announces the timing (tens of seconds for a real model on a CPU), so a start-up that
    waits says why."""
    from trtspec.export.cache import code_sha256

    sizes = sorted(set(block_sizes) | {1})
    key = {**identity, "slots": runner.slots, "max_context": runner.max_context, "static": runner.static,
           "block_sizes": sizes, "batches": BATCHES, "context": CONTEXT, "rounds": ROUNDS, "torch": torch.__version__,
           "code": code_sha256(("blockpilot", "runtime", "engines", "export", "models"))}
    digest = key_digest(key)
    path = cache_root() / COSTS_DIR / f"{digest}.json"
    with take_turns(path.with_suffix(".lock")):  # replicas starting together: one times, the others read
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
            entry = json.loads(path.read_text())
            table = CostTable.from_dict(entry["table"])
            if key_digest(entry["key"]) == digest and sorted(table.cycle_ms) == sizes:
                return table
        echo(f"timing a decode cycle at block sizes {', '.join(map(str, sizes))} and batches up to "
             f"{max(timed_batches(runner))} for BlockPilot's load-aware choice (once: later starts reuse it)")
        table = measure_costs(runner, block_sizes)
        with contextlib.suppress(OSError, TrtspecError):
            atomic_write_text(path, json.dumps({"key": key, "table": table.to_dict()}, indent=1, default=str) + "\n")
    return table


def timed_batches(runner, batches: tuple[int, ...] = BATCHES) -> tuple[int, ...]:
    """The batches a table is timed at: those the runner's slots hold."""
    return tuple(b for b in batches if b <= runner.slots) or (1,)


def measure_costs(runner, block_sizes: tuple[int, ...], batches: tuple[int, ...] = BATCHES, context: int = CONTEXT,
                  rounds: int = ROUNDS) -> CostTable:
    """Time draft(B) + verify(B) on the runner itself, for every block size and batch (1 = AR), at
    `context` cached positions (what the caches hold is irrelevant to the timing). Each round times
    every cell once and a cell's figure is its median over the rounds: a host's speed drifts over
    seconds, and timing the cells one after another would hand that drift to whichever size came
    first (the choice between AR and B = 8 at 4 clients turns on a few percent)."""
    batches = timed_batches(runner, batches)
    context = min(context, runner.max_context - max(block_sizes) - 1)
    width = runner.specs["target"].outputs[1].shape({"batch": 1, "tokens": 1})[-1]  # the drafter's feature width
    sizes, generator, cells = sorted(set(block_sizes) | {1}), torch.Generator().manual_seed(0), {}
    for size in sizes:
        for batch in batches:
            slots, starts = list(range(batch)), [context] * batch
            blocks = torch.randint(2, 100, (batch, size), generator=generator)
            contexts = [torch.zeros(size, width, dtype=runner.dtype, device=runner.device)] * batch

            def cycle(size=size, slots=slots, starts=starts, blocks=blocks, contexts=contexts) -> None:
                if size > 1:
                    runner.draft(slots, contexts, blocks, [s + size for s in starts])
                runner.verify(slots, blocks, starts)

            cells[size, batch] = cycle
    once, times = Timer(runner.device, repeats=1, warmup=0), {cell: [] for cell in cells}
    with torch.inference_mode():
        for cycle in cells.values():  # warm-up
            cycle()
        for _ in range(rounds):
            for cell, cycle in cells.items():
                times[cell].append(once(cycle))
    return CostTable(batches, {size: [float(np.median(times[size, b])) for b in batches] for size in sizes})


def fit_host_work(table: np.ndarray, measured: np.ndarray) -> tuple[float, float]:
    """(slope, host ms) with measured ~ slope x table + host over the shapes the engine ran: the
    table times bare calls, real cycles add the engine's host work per cycle. Where the shapes
    are too alike to fit a line, or the line finds no host work, the median ratio (host 0)."""
    if len(table) >= 2 and table.max() >= 1.5 * table.min():
        slope, host = np.polyfit(table, measured, 1)
        if slope > 0 and host >= 0:
            return float(slope), float(host)
    return (float(np.median(measured / table)), 0.0) if len(table) else (1.0, 0.0)

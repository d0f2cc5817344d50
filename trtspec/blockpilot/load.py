"""BlockPilot under load: the policy's choice, or a smaller block, or AR, whichever the batch pays for.

The policy was trained one request at a time; batched, an AR step for n requests costs little more
than for one, while a verify of n blocks of B computes n*B tokens. So at each `auto` admission the
engine asks `LoadAwareChooser` (a `trtspec.runtime.schedule.BlockChooser`) which of the policy's
choice, a smaller size and AR commits the most tokens per second for the batch the request joins:

    rate(s) = sum over the batch's requests of tau_i(s)  /  cost(s, n)

cost(s, n) is the engine's own median for cycles of that shape, else the start-up cost table
(trtspec.blockpilot.costs) fitted to the measured shapes; tau(s) is learnt from finished requests,
greedy and sampled apart, after a prior. When an admission goes to AR, the `auto` requests still
speculating turn AR too (`requests_to_switch`): a batch of two sizes pays two calls per
iteration. The rules and the reason for each constant are in docs/blockpilot.md ("`auto` under
load"), the measurements behind them in docs/benchmarks.md.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from trtspec.blockpilot.costs import CostTable, fit_host_work
from trtspec.runtime.schedule import BlockChoice, Load
from trtspec.runtime.stats import committed_tokens, cut_histogram, pool_histograms

PRIOR_CYCLES = 64.0      # the prior counts as this many decode cycles (about two 128-token requests)
STAY_MARGIN = 0.1       # a size within this fraction of the best rate keeps the size the batch is heading to
AR_MARGIN = 0.03        # AR must beat speculation by this much: at equal throughput, speculation serves sooner
AR_EXPLORE = 0.15        # AR within this of the best, at a batch the engine never ran AR at: run AR to measure it
OBSERVED_MIN = 8         # decode cycles a finished request needs to count as evidence of tau (below)
MEASURED_MIN = 16        # cycles of one (size, batch) shape before the engine's own timing replaces the table
WINDOW = 256             # the latest cycles of a shape that its measured cost is the median of
STALE_S = 30.0           # a shape not run for this long is measured afresh: the host's speed drifts
PRIOR_BREAK_EVEN = 1.25  # prior tau: this multiple of the batch-1 break-even (the policy chose speculation)


@dataclass
class LoadAwareChooser:
    """A BlockChooser: (the policy's choice, the engine's load, sampled?) -> the choice to run;
    learns tau per block size, for greedy and sampled requests apart, and cycle costs per shape."""

    costs: CostTable  # timed at the first start on this machine, then read from the cache
    choices: tuple[BlockChoice, ...] = ()  # what the policy can answer (unknown: only AR settles without it)
    _seen: dict[tuple[int, bool], list[int]] = field(default_factory=dict)  # pooled acceptance histograms
    _cycles: dict[tuple[int, int], deque] = field(default_factory=dict)  # (size, batch) -> the engine's cycle ms
    _medians: dict[tuple[int, int], float] = field(default_factory=dict)  # of the shapes with MEASURED_MIN cycles
    _fit: tuple[float, float] = (1.0, 0.0)  # (slope, host ms): table -> measured, over those shapes
    _changed: set = field(default_factory=set)  # shapes with cycles the medians have not seen yet
    _last_run: dict[tuple[int, int], float] = field(default_factory=dict)  # shape -> `clock()` of its latest cycle
    clock: Callable[[], float] = time.monotonic
    _lock: threading.Lock = field(default_factory=threading.Lock)
    decisions: dict[str, int] = field(default_factory=dict)  # "kept" / "smaller" / "ar" / "load" (policy not asked)

    def tau(self, size: int, sampled: bool = False) -> float:
        """Expected acceptance length at `size` (greedy or sampled): what finished requests at this
        size or a larger one showed, after a prior."""
        if size <= 1:
            return 1.0
        prior = PRIOR_BREAK_EVEN * self.cost(size, 1) / self.cost(1, 1)
        committed, cycles = self._evidence(size, sampled)
        return (PRIOR_CYCLES * prior + committed) / (PRIOR_CYCLES + cycles)

    def _evidence(self, size: int, sampled: bool) -> tuple[float, float]:
        """(committed tokens, cycles) that finished requests at `size` or larger show for `size`."""
        committed = cycles = 0.0
        with self._lock:
            for (ran, regime), histogram in self._seen.items():
                if regime != sampled or ran < size:
                    continue
                cut = cut_histogram(histogram, size)  # the same cycles, as if cut at `size`
                committed += float(committed_tokens(cut))
                cycles += float(sum(cut))
        return committed, cycles

    def observe_request(self, choice: BlockChoice, histogram: list[int], sampled: bool = False) -> None:
        """A request that ran at `choice` finished with this acceptance histogram (cycles by accepted
        drafts). A request of fewer than OBSERVED_MIN cycles is left out: its last cycle, cut by its
        token limit, is a large part of it, so it understates tau (and would turn the next requests
        to AR). A growing block's grown cycles count as what its base size would have accepted (all
        of it)."""
        if choice.size > 1 and sum(histogram) >= OBSERVED_MIN:
            new = cut_histogram(histogram, choice.size)
            with self._lock:
                key = (choice.size, sampled)
                self._seen[key] = pool_histograms([self._seen.get(key, []), new])

    def observe_cycle(self, size: int, batch: int, ms: float) -> None:
        """The engine ran one cycle of `batch` requests at `size` (1: AR) in `ms` milliseconds."""
        with self._lock:
            self._cycles.setdefault((size, batch), deque(maxlen=WINDOW)).append(ms)
            self._changed.add((size, batch))
            self._last_run[size, batch] = self.clock()

    def measured(self) -> dict[tuple[int, int], float]:
        """(size, batch) -> median ms of the engine's latest cycles, for shapes with enough of them."""
        with self._lock:
            self._update_medians()
            return dict(self._medians)

    def _update_medians(self) -> None:
        """Medians of the shapes with new cycles, when a cost is asked for (at admissions), not at
        every cycle: the engine thread pays for it. A shape the engine has not run for STALE_S is
        forgotten, its cycles too, so it is measured afresh before it counts again: the host's speed
        drifts, and a median from minutes ago set against one from now judges the drift, not the
        sizes. Under the lock."""
        now = self.clock()
        old = [cell for cell, at in self._last_run.items() if now - at > STALE_S]
        for cell in old:
            del self._last_run[cell], self._cycles[cell]
            self._medians.pop(cell, None)
        fresh = [cell for cell in self._changed if cell in self._cycles and len(self._cycles[cell]) >= MEASURED_MIN]
        for cell in fresh:
            self._medians[cell] = float(np.median(self._cycles[cell]))
        if fresh or old:
            cells = [cell for cell in self._medians if cell[0] in self.costs.cycle_ms]
            self._fit = fit_host_work(np.array([self.costs.cost(*cell) for cell in cells]),
                                      np.array([self._medians[cell] for cell in cells]))
        self._changed.clear()

    def cost(self, size: int, batch: int) -> float:
        """ms of a cycle at `size` for `batch` requests: measured by the engine if it ran that shape
        lately, else the start-up table fitted to what the engine measures (`fit_host_work`)."""
        with self._lock:
            self._update_medians()
            measured, (slope, host) = self._medians.get((size, batch)), self._fit
        return measured if measured is not None else slope * self.costs.cost(size, batch) + host

    def rate(self, size: int, regimes: list[bool]) -> float:
        """Tokens per millisecond of a batch of these requests (sampled or not) all at `size`."""
        sampled = sum(regimes)  # tau once per regime, not once per request
        committed = (len(regimes) - sampled) * self.tau(size) + sampled * self.tau(size, sampled=True)
        return committed / self.cost(size, len(regimes))

    def choose(self, choice: BlockChoice | Callable[[], BlockChoice], load: Load, sampled: bool = False) -> BlockChoice:
        """The size to run for a request the policy gave `choice` (or a function that gives it: it is
        only asked when its answer can change the outcome: the policy's forward runs on the engine
        thread, and no request decodes meanwhile)."""
        rates, expected = self._rates(load, sampled)  # judged once, whichever sizes are then compared
        if callable(choice):
            widest = max(self.costs.cycle_ms)  # the policy's largest size: every candidate is judged
            best = self._best(widest, load, sampled, rates, expected) if widest > 1 else 1
            # a choice c at or above `best` would come out as `best` too (its candidates include it and
            # none better; the same stay rule applies): only a choice below it, or a different choice
            # of that very size (a growing block), could come out otherwise
            if best == 1 or (self.choices and all(c.size > best or c == BlockChoice(best) for c in self.choices)):
                self._count("ar" if best == 1 else "load")
                return BlockChoice(best)
            choice = choice()
        if choice.size <= 1 or choice.size not in self.costs.cycle_ms:
            return choice
        best = self._best(choice.size, load, sampled, rates, expected)
        self._count("kept" if best == choice.size else "ar" if best == 1 else "smaller")
        return choice if best == choice.size else BlockChoice(best)

    def requests_to_switch(self, chosen: BlockChoice, running: Sequence[tuple[BlockChoice, int]]) -> list[int]:
        """An `auto` admission sent to AR means the whole batch is better off AR at its size: the
        `auto` requests still speculating follow (each: what it asked for, its current size). A
        request with a fixed size keeps it: it asked for that size."""
        if chosen.size != 1:
            return []
        return [index for index, (asked, size) in enumerate(running) if asked.auto and size != 1]

    def _rates(self, load: Load, sampled: bool) -> tuple[dict[int, float], int]:
        """The batch this request joins (its expected size) and its rate at every size, all of it
        at that size; AR's rate discounted by AR_MARGIN."""
        decoding = list(load.sampled or (False,) * len(load.block_sizes))
        joining = max(1, load.running - len(load.block_sizes))  # this one and those still prefilling
        waiting = min(load.queued, max(0, load.slots - load.running)) if load.slots else load.queued
        expected = max(len(decoding) + joining + waiting, round(load.recent))  # and those about to come (back)
        batch = decoding + [sampled] * (expected - len(decoding))
        return {b: self.rate(b, batch) / (1 + AR_MARGIN if b == 1 else 1) for b in self.costs.cycle_ms}, expected

    def _best(self, size: int, load: Load, sampled: bool, rates: dict[int, float], expected: int) -> int:
        """Of `size`, the smaller sizes and AR, the one that pays for the batch this request joins."""
        # the size the batch is heading to: the latest admission's, of those decoding (0: none decodes;
        # a size outside the table counts as AR, as before)
        heading = load.block_sizes[-1] if load.block_sizes else 0
        heading = heading if heading in self.costs.cycle_ms or heading == 0 else 1
        if self._evidence(size, sampled)[1] < PRIOR_CYCLES and heading != 1 \
                and not any(b >= size for b in load.block_sizes):
            bound = self._tau_bound(size, sampled)
            rivals = [rates[b] for b in rates if b != size]
            if bound is None or not rivals or expected * bound / self.cost(size, expected) >= max(rivals):
                return size  # explore, one request at a time: nothing to judge by yet, and it could pay
        candidates = [size, *sorted((b for b in rates if 1 < b < size), reverse=True), 1]
        best = max(candidates, key=rates.get)  # ties: the earlier
        if heading in candidates and rates[heading] >= (1 - STAY_MARGIN) * rates[best]:
            best = heading  # near a tie, go where the batch goes: two groups cost two calls
        if best != 1 and heading in (0, 1) and rates[1] >= (1 - AR_EXPLORE) * rates[best] \
                and (1, expected) not in self.measured():
            best = 1  # AR at this batch is the table's guess and close: run it (opening no second group) to know
        return best

    def _tau_bound(self, size: int, sampled: bool) -> float | None:
        """The most tau at `size` could be, from a smaller size with enough evidence: its cycles as
        they were, except that those that accepted every draft (the only ones a longer block can
        extend) accept all of the longer block's. None: no smaller size has the evidence."""
        bounds = []
        with self._lock:
            seen = [(ran, histogram) for (ran, regime), histogram in self._seen.items()
                    if regime == sampled and 1 < ran < size]
        for ran, histogram in seen:
            cycles = sum(histogram)
            if cycles >= PRIOR_CYCLES:
                ceilings = histogram[ran - 1] if len(histogram) >= ran else 0
                bounds.append((committed_tokens(histogram) + ceilings * (size - ran)) / cycles)
        return min(bounds, default=None)

    def _count(self, verdict: str) -> None:
        with self._lock:
            self.decisions[verdict] = self.decisions.get(verdict, 0) + 1


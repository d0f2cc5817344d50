"""BlockPilot under load: the policy's choice, or a smaller block, or AR, whichever the batch pays for.

The policy was trained on labels measured one request at a time, where a cycle at block size B
costs about as much as a few autoregressive steps. Batched, that changes: an autoregressive step
for n requests costs little more than for one (the weights are read once), while a verify of n
blocks of B computes n*B tokens. So when a request is admitted, the engine asks
`LoadAwareChooser` which of the policy's choice c, a smaller block size the policy could also
choose, and AR commits the most tokens per second for the batch it joins:

    rate(s) = sum over the batch's requests of tau_i(s)  /  cost(s, n)

The rules, each with its reason (the measurements that set them are in docs/benchmarks.md, "The
load-aware chooser: the evidence behind its rules"):

* cost(s, n), one cycle at s for n requests, is what the engine measured for its own cycles of
  that shape (draft + verify + the rows' host work: the median of the latest WINDOW, once the
  shape has run MEASURED_MIN cycles), else the cost table (trtspec.blockpilot.costs: bare draft(s)
  + verify(s) calls at a fixed context, timed at the first start on a machine and kept) fitted to the
  measured shapes as a line, measured = slope x table + host. The engine's own cycles are the real
  traffic's, and the start-up table alone moves between engine starts by more than a decision
  turns on. A line, not a ratio: every real cycle carries host work that the table's bare calls
  lack, and a ratio spreads it over the table's costs, pricing AR, the cheapest call, too low.
* A shape the engine has not run for STALE_S counts as never run: the host's speed drifts, and
  costs are only comparable when measured at about the same time.
* The batch is judged as if every request in it ran at s, not at the sizes the others run now:
  every admission applies the same rule, so the batch drifts to what pays at its size. Judging
  only this request's effect, with the others fixed, locks a batch into whatever its first
  requests chose (joining a running group costs less than opening a call of another size).
* n counts the requests decoding, those still prefilling, those queued for the free slots, and
  the running count averaged over about a second (clients about to come back).
* Near a tie (within STAY_MARGIN) the request joins the size the batch is heading to, that of the
  latest admission still decoding: two sizes in one batch cost two calls per cycle, more than
  either size alone. The latest admission, not the majority: once an admission finds another size
  better by the margin, the ones after it follow and the old group drains within one request's
  life, where following the majority keeps a batch on the worse size and gives every later
  admission that finds the margin a second group for its whole life.
* AR must beat speculation by AR_MARGIN: at equal throughput, speculation serves each request
  sooner. The margin is small because near the crossover the two are a few percent apart, and a
  larger margin holds batches at a block size past it.
* AR's cost at a batch size the engine has not run AR at is only the fitted table's guess, so
  where AR comes within AR_EXPLORE of the best and the request would open no second group
  (nothing decodes yet, or AR does), the request runs AR and the engine's own cycles settle the
  next decisions.

tau per block size is learnt online from every speculative request the engine finished (auto or a
fixed size: the drafter and the traffic are the same) of at least OBSERVED_MIN decode cycles,
pooled by decode cycles, after a prior of PRIOR_BREAK_EVEN x the batch-1 break-even tau worth
PRIOR_CYCLES cycles. It is kept apart for greedy and sampled requests, which accept far less, so
sampled requests learn on their own to fall back to AR. A smaller size s than the one a request
ran at is estimated from its acceptance histogram, each cycle cut at s (min(a, s - 1) + 1): the
drafter's first s - 1 proposals of a longer block stand for a block of s
(trtspec.runtime.stats.cut_histogram). Until requests at the policy's choice (or a larger size)
have shown PRIOR_CYCLES decode cycles, a request is sent to explore that choice as it is: an engine
that turned to AR on a guess would never see what speculation accepts (AR requests show no
acceptance). One request explores at a time: while one decodes at that size or larger, the others
are judged by the prior, so a burst of admissions (a load tool's first wave) does not all pay for
the exploration; nor does one explore beside a batch heading to AR, where it would add a second
call to every cycle of the batch for its whole life (a request admitted alone, or into a
speculating batch, explores). And a size is not explored where it could not pay: where a smaller
size has the evidence, and even its cycles that accepted every draft extended to the whole larger
block leave the larger size behind the best at this load.

The choice is made once per request, at admission, as in the research, with one exception: when
the chooser sends an `auto` admission to AR, it has judged the whole batch better off AR at its
size, so the `auto` requests still speculating turn AR from their next cycle (the engine's
`_follow_to_ar`) instead of keeping a second call in every iteration for the rest of their lives;
a request with a fixed size keeps it. Where the load
settles the size whatever the policy answers (AR, or a size no larger than any of the policy's
choices), the policy is not asked: its forward (mostly the prompt's confidence over the prefill's
tail logits) runs on the engine thread, and no request decodes meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from trtspec.blockpilot.costs import CostTable, fit_host_work
from trtspec.runtime.schedule import BlockChoice
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
    """(the policy's choice, the engine's load, sampled?) -> the choice to run; learns tau per block
    size, for greedy and sampled requests apart."""

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

    def observe(self, choice: BlockChoice, histogram: list[int], sampled: bool = False) -> None:
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

    def __call__(self, choice: BlockChoice | Callable[[], BlockChoice], load, sampled: bool = False) -> BlockChoice:
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

    def _rates(self, load, sampled: bool) -> tuple[dict[int, float], int]:
        """The batch this request joins (its expected size) and its rate at every size, all of it
        at that size; AR's rate discounted by AR_MARGIN."""
        decoding = list(load.sampled or (False,) * len(load.block_sizes))
        joining = max(1, load.running - len(load.block_sizes))  # this one and those still prefilling
        waiting = min(load.queued, max(0, load.slots - load.running)) if load.slots else load.queued
        expected = max(len(decoding) + joining + waiting, round(load.recent))  # and those about to come (back)
        batch = decoding + [sampled] * (expected - len(decoding))
        return {b: self.rate(b, batch) / (1 + AR_MARGIN if b == 1 else 1) for b in self.costs.cycle_ms}, expected

    def _best(self, size: int, load, sampled: bool, rates: dict[int, float], expected: int) -> int:
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


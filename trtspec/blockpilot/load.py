"""BlockPilot under load: the policy's choice, kept only while speculation still pays at this batch.

The policy was trained on per-request labels measured one request at a time, where a cycle at
block size B costs about as much as a few autoregressive steps. Batched, the picture changes: an
autoregressive step for n requests costs little more than for one (the weights are read once), a
verify of n blocks of B costs n*B tokens of compute. So when a request is admitted, the engine
asks `LoadAwareChooser` which block size serves the batch it joins best, that batch taken as
running at one size b (steady load: requests that leave are replaced by requests that choose the
same way, so the batch converges there):

    n * tau_b / cost(b, n)        (committed tokens per millisecond; b = 1 is AR, tau 1)

where n counts the decoding requests and the new one, and cost(B, n) is the measured time of one
draft(B) + verify(B) call for n requests (verify(1) for AR). The candidates are the policy's choice,
AR and, once the batch is not empty, the smaller measured sizes (4, 8 where the engine has them): a
verify of n blocks of 8 grows half as fast as of 12, and joining a large AR batch is nearly free.
Alone, the policy's choice is weighed against AR only: it was trained one request at a time.
tau is learnt online from the acceptance histograms of finished requests, for greedy and sampled
requests apart (at T > 0 a drafter accepts far less: demo pair, B = 12, tau 4.1 greedy and 2.3 at
T = 0.7); the histogram at size c gives tau at every smaller size (a cycle that accepted a drafts
at c accepts min(a, b - 1) at b). A prior of 1.25x the batch-1 break-even tau, worth two requests,
starts it. The choice is still made once per request, at admission, as in the research.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from trtspec.cycle_costs import Timer
from trtspec.runtime.schedule import BlockChoice

BATCHES = (1, 2, 4, 8, 16)
SMALLER_SIZES = (4, 8)   # block sizes below the policy's that a request joining a batch may drop to
PRIOR_WEIGHT = 2.0       # the prior counts as this many finished requests
PRIOR_BREAK_EVEN = 1.25  # prior tau: this multiple of the batch-1 break-even (the policy chose speculation)


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


def cost_sizes(policy_sizes: tuple[int, ...], runner_sizes: tuple[int, ...] | None) -> tuple[int, ...]:
    """The block sizes to cost: the policy's, and the smaller candidates the runner can run."""
    smaller = [b for b in SMALLER_SIZES if b < min(policy_sizes) and (runner_sizes is None or b in runner_sizes)]
    return tuple(sorted({*policy_sizes, *smaller}))


def measure_costs(runner, block_sizes: tuple[int, ...], batches: tuple[int, ...] = BATCHES, context: int = 256,
                  repeats: int = 3) -> CostTable:
    """Time draft(B) + verify(B) on the runner itself, for every block size and batch (1 = AR), at
    `context` cached positions (what the caches hold is irrelevant to the timing)."""
    batches = tuple(b for b in batches if b <= runner.slots) or (1,)
    context = min(context, runner.max_context - max(block_sizes) - 1)
    width = runner.specs["target"].outputs[1].shape({"batch": 1, "tokens": 1})[-1]  # the drafter's feature width
    timer, generator, table = Timer(runner.device, repeats=repeats, warmup=1), torch.Generator().manual_seed(0), {}
    with torch.inference_mode():
        for size in sorted(set(block_sizes) | {1}):
            row = []
            for batch in batches:
                slots, starts = list(range(batch)), [context] * batch
                blocks = torch.randint(2, 100, (batch, size), generator=generator)
                contexts = [torch.zeros(size, width, dtype=runner.dtype, device=runner.device)] * batch

                def cycle() -> None:
                    if size > 1:
                        runner.draft(slots, contexts, blocks, [s + size for s in starts])
                    runner.verify(slots, blocks, starts)

                row.append(timer(cycle))
            table[size] = row
    return CostTable(batches, table)


@dataclass
class LoadAwareChooser:
    """(the policy's choice, the engine's load, sampled?) -> the choice to run.

    It learns acceptance from finished requests, for greedy and sampled requests apart: their pooled
    acceptance histograms per block size. A histogram at size c also gives tau at any smaller size b
    (a cycle that accepted a drafts at c would have accepted min(a, b - 1) at b), so a request
    joining a busy engine may run at a smaller measured size than the policy's, where the batch's
    verify grows less with every row, or join the AR group."""

    costs: CostTable
    _histograms: dict[tuple[int, bool], np.ndarray] = field(default_factory=dict)
    _requests: dict[tuple[int, bool], int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    decisions: dict[str, int] = field(default_factory=dict)  # "kept" / "smaller" / "ar" counts, for reports

    def tau(self, size: int, sampled: bool = False) -> float:
        """Expected acceptance length at `size` (greedy or sampled): from the histograms of the nearest
        size at or above it that finished requests ran at, after a prior."""
        if size <= 1:
            return 1.0
        prior = PRIOR_BREAK_EVEN * self.costs.cost(size, 1) / self.costs.cost(1, 1)
        with self._lock:
            seen = sorted(b for b, kind in self._histograms if kind == sampled and b >= size)
            if not seen:
                return prior
            histogram, requests = self._histograms[seen[0], sampled], self._requests[seen[0], sampled]
        committed = np.minimum(np.arange(len(histogram)), size - 1) + 1
        estimate = float((histogram * committed).sum() / histogram.sum())
        return (PRIOR_WEIGHT * prior + requests * estimate) / (PRIOR_WEIGHT + requests)

    def observe(self, choice: BlockChoice, histogram: list[int], sampled: bool = False) -> None:
        """A request that ran at `choice` finished with this acceptance histogram (growing blocks,
        whose cycles ran at two sizes, are left out)."""
        if choice.size > 1 and not choice.grow_to and sum(histogram):
            with self._lock:
                key = (choice.size, sampled)
                self._histograms[key] = self._histograms.get(key, 0) + np.asarray(histogram[:choice.size], dtype=float)
                self._requests[key] = self._requests.get(key, 0) + 1

    def rate(self, size: int, sampled: bool, batch: int) -> float:
        """Tokens per millisecond of a batch of `batch` requests all running at `size`: one call of
        cost(size, batch) per cycle, each request committing tau(size)."""
        return batch * self.tau(size, sampled) / self.costs.cost(size, batch)

    def __call__(self, choice: BlockChoice, load, sampled: bool = False) -> BlockChoice:
        if choice.size <= 1 or choice.size not in self.costs.cycle_ms:
            return choice
        # Judged at the batch the request joins (those decoding now, and itself), as if that batch
        # ran at one size: under steady load, requests that leave are replaced by requests that
        # choose the same way, so the batch converges to the size that serves it best. Alone, only
        # the per-request policy's choice and AR are weighed (the policy was trained one at a time);
        # a growing block is kept whole or sent to AR.
        batch = len(load.block_sizes) + 1
        smaller = [b for b in self.costs.cycle_ms if 1 < b < choice.size] if batch > 1 and not choice.grow_to else []
        best = max([choice.size, *smaller, 1], key=lambda b: self.rate(b, sampled, batch))  # ties: the policy's
        verdict = "kept" if best == choice.size else "ar" if best == 1 else "smaller"
        with self._lock:
            self.decisions[verdict] = self.decisions.get(verdict, 0) + 1
        return choice if best == choice.size else BlockChoice(best)

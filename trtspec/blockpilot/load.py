"""BlockPilot under load: the policy's choice, kept only while speculation still pays at this batch.

The policy was trained on per-request labels measured one request at a time, where a cycle at
block size B costs about as much as a few autoregressive steps. Batched, the picture changes: an
autoregressive step for n requests costs little more than for one (the weights are read once), a
verify of n blocks of B costs n*B tokens of compute. So when a request is admitted, the engine
asks `LoadAwareChooser` whether the policy's choice c still beats autoregressive decoding at the
batch it joins:

    tau_c / cost(c, n)  >  1 / cost(AR, n)        (committed tokens per second, per request)

where cost(B, n) is the measured time of one draft(B) + verify(B) call for n requests (verify(1)
for AR). Precisely, it compares the whole batch's tokens per second with the request in the group
of c or in the AR group (groups of other sizes cost what they cost either way), so joining a
large AR group is seen to be nearly free. tau per block size is learnt online from the requests
that finished at it, pooled by decode cycles (so a short request weighs little), after a prior of
1.25x the batch-1 break-even tau worth 64 cycles; apart for greedy and sampled requests: at T > 0
a drafter accepts far less (demo pair, B = 12: tau 4.1 greedy, 2.3 at T = 0.7), so sampled
requests learn on their own to fall back to AR.
The choice is still made once per request, at admission, as in the research.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from trtspec.cycle_costs import Timer
from trtspec.runtime.schedule import BlockChoice

BATCHES = (1, 2, 4, 8, 16)
PRIOR_CYCLES = 64.0      # the prior counts as this many decode cycles (about two 128-token requests)
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
    """(the policy's choice, the engine's load, sampled?) -> the choice to run; learns tau per block
    size, for greedy and sampled requests apart."""

    costs: CostTable
    _seen: dict[tuple[int, bool], list[float]] = field(default_factory=dict)  # [committed tokens, cycles]
    _lock: threading.Lock = field(default_factory=threading.Lock)
    decisions: dict[str, int] = field(default_factory=dict)  # "kept" / "ar" counts, for reports

    def tau(self, size: int, sampled: bool = False) -> float:
        """Expected acceptance length at `size` (greedy or sampled): what finished requests showed,
        after a prior."""
        if size <= 1:
            return 1.0
        prior = PRIOR_BREAK_EVEN * self.costs.cost(size, 1) / self.costs.cost(1, 1)
        with self._lock:
            committed, cycles = self._seen.get((size, sampled), (0.0, 0.0))
        return (PRIOR_CYCLES * prior + committed) / (PRIOR_CYCLES + cycles)

    def observe(self, choice: BlockChoice, tau: float, cycles: int, sampled: bool = False) -> None:
        """A request that ran at `choice` finished after `cycles` decode cycles with acceptance length
        `tau`. Pooled by cycles, so a short request (a warm-up of a few tokens) weighs little."""
        if choice.size > 1 and cycles > 0:
            with self._lock:
                seen = self._seen.setdefault((choice.size, sampled), [0.0, 0.0])
                seen[0] += tau * cycles
                seen[1] += cycles

    def rate(self, size: int, sampled: bool, groups: Counter) -> float:
        """Tokens per millisecond of the whole batch if the new request runs at `size`: the n requests
        at block size b share one call costing cost(b, n) per cycle, and each commits its tau(b)."""
        groups = groups + Counter({(size, sampled): 1})
        calls = Counter()
        for (b, _), n in groups.items():
            calls[b] += n
        cycle = sum(self.costs.cost(b, n) for b, n in calls.items())
        return sum(n * self.tau(b, s) for (b, s), n in groups.items()) / cycle

    def __call__(self, choice: BlockChoice, load, sampled: bool = False) -> BlockChoice:
        if choice.size <= 1 or choice.size not in self.costs.cycle_ms:
            return choice
        regimes = load.sampled or (False,) * len(load.block_sizes)
        groups = Counter((b if b in self.costs.cycle_ms else 1, s)  # the decoding requests
                         for b, s in zip(load.block_sizes, regimes))
        keep = self.rate(choice.size, sampled, groups) > self.rate(1, sampled, groups)
        verdict = "kept" if keep else "ar"
        with self._lock:
            self.decisions[verdict] = self.decisions.get(verdict, 0) + 1
        return choice if keep else BlockChoice(1)

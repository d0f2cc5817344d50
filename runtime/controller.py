"""The per-cycle decode controller: the native core, and what the decode loop needs from it.

After draft(B) and verify(B) the host must decide how many drafts the target accepted, commit
them and the bonus token (stop ids and the token limit may cut a block short), count the cycle
in the acceptance histogram and move the position the KV caches roll back to. That runs
hundreds of times per request, so it lives in C++ (`runtime/native/`, built by `pip install`),
over buffers allocated once per request and shared with torch without copies.

`trtspec.runtime.reference` holds a pure-Python version of the same logic, the specification the
tests check the native core against cycle by cycle.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from trtspec.errors import TrtspecError


class Controller(Protocol):
    """The per-cycle core for R requests; row r of every buffer belongs to request r."""

    verify_blocks: np.ndarray   # [R, W] int64: bonus, then the drafts verify(B) checks
    draft_blocks: np.ndarray    # [R, W] int64: bonus, then MASK x (B-1), what draft(B) completes
    tokens: np.ndarray          # [R, capacity] int64: committed tokens
    histograms: np.ndarray      # [R, W] int64: cycles that accepted a drafts, a in 0..W-1
    running: int                # requests not yet finished

    def begin(self, request: int, token: int, start: int) -> None: ...
    def set_block_size(self, request: int, size: int) -> None: ...  # from the next cycle on (1: AR)
    def step(self, posterior) -> int: ...        # posterior tokens [B] or [R, B]
    def step_greedy(self, logits) -> int: ...    # float32 logits [B, V] or [R, B, V], argmax taken
    def block_size(self, request: int) -> int: ...    # the next cycle's (a growing block changes it)
    def grown_cycles(self, request: int) -> int: ...  # cycles run at the grown size
    def ceilings(self, request: int) -> int: ...      # cycles that accepted every draft of their block
    def count(self, request: int) -> int: ...
    def start(self, request: int) -> int: ...
    def accepted(self, request: int) -> int: ...
    def committed(self, request: int) -> int: ...
    def finish_reason(self, request: int) -> str: ...


def native_controller(block_sizes: Sequence[int], limits: Sequence[int], stop_ids: Sequence[Sequence[int]],
                      mask_token_id: int, grow_to: Sequence[int] = ()) -> Controller:
    """The C++ controller for one batch of requests (`grow_to`: a grown block size per request, 0 = none)."""
    try:
        from trtspec.runtime._native import Controller as Native
    except ImportError as error:
        raise TrtspecError(f"trtspec's native core is not built ({error}); reinstall with pip install -e . "
                           "(needs a C++17 compiler)") from None
    return Native(list(block_sizes), list(limits), [list(ids) for ids in stop_ids], mask_token_id, list(grow_to))


class Stepper:
    """Feeds verify's logits to a controller, one step per cycle.

    Greedy CPU float32 logits go to the core as a numpy view, taken once per logits buffer (the
    compiled engines return the same static buffer every cycle, and the first torch call after a
    graph run is the costliest host work of a CPU cycle); the core takes the argmax of only the
    rows the acceptance rule reads. Otherwise `posterior_of` samples (on the logits' device) and
    only the tokens cross to the host.
    """

    def __init__(self, core: Controller, posterior_of: Callable[[torch.Tensor], torch.Tensor] | None):
        self.core, self.posterior_of = core, posterior_of
        self._views: dict[int, tuple[torch.Tensor, np.ndarray | None]] = {}  # per buffer (one per block size)

    def __call__(self, logits: torch.Tensor) -> None:
        if self.posterior_of is None:
            known = self._views.get(id(logits))
            if known is None or known[0] is not logits:
                host = logits.dtype == torch.float32 and logits.device.type == "cpu"
                if len(self._views) >= 4:
                    self._views.clear()
                known = self._views[id(logits)] = logits, logits.numpy() if host else None
            if known[1] is not None:
                self.core.step_greedy(known[1])
                return
        posterior = self.posterior_of(logits) if self.posterior_of is not None else logits.argmax(dim=-1)
        self.core.step(posterior if posterior.device.type == "cpu" else posterior.cpu())

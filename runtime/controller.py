"""The per-cycle decode controller: the native one, and what the decode loop needs from it.

After draft(B) and verify(B) the host must decide how many drafts the target accepted, commit
them and the bonus token (stop ids and the token limit may cut a block short), count the cycle
in the acceptance histogram and move the position the KV caches roll back to. That runs
hundreds of times per request, so it lives in C++ (`runtime/native/`, built by `pip install`),
one controller per request, over buffers allocated once and shared with torch without copies.

`trtspec.runtime.reference` holds a pure-Python version of the same logic, the specification the
tests check the native controller against cycle by cycle.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from trtspec.errors import TrtspecError
from trtspec.runtime.sampling import greedy_tokens


class Controller(Protocol):
    """The per-cycle core of one request."""

    verify_block: np.ndarray   # [W] int64: bonus, then the drafts verify(B) checks
    draft_block: np.ndarray    # [W] int64: bonus, then MASK x (B-1), what draft(B) completes
    tokens: np.ndarray         # [limit] int64: committed tokens (the first `count`)
    histogram: np.ndarray      # [W] int64: cycles that accepted a drafts, a in 0..W-1
    running: bool              # not finished yet
    block_size: int            # the next cycle's (a growing block changes it)
    grown_cycles: int          # cycles run at the grown size
    ceilings: int              # cycles that accepted every draft of their block
    count: int                 # tokens committed
    start: int                 # the position of the bonus token: where the next block begins
    accepted: int              # drafts the latest cycle accepted
    committed: int             # tokens the latest cycle committed
    finish_reason: str         # "" while running, then "stop" or "length"

    def begin(self, token: int, start: int) -> None: ...
    def set_block_size(self, size: int) -> None: ...  # from the next cycle on (1: AR)
    def step(self, posterior) -> bool: ...        # posterior tokens [B]; whether it still runs
    def step_greedy(self, logits) -> bool: ...    # float32 logits [B, V], argmax taken


ControllerFactory = Callable[[int, int, Sequence[int], int, int], Controller]


def native_controller(block_size: int, limit: int, stop_ids: Sequence[int], mask_token_id: int,
                      grow_to: int = 0) -> Controller:
    """The C++ controller for one request (`grow_to`: its grown block size, 0 = none)."""
    try:
        from trtspec.runtime._native import Controller as Native
    except ImportError as error:
        raise TrtspecError(f"trtspec's native core is not built ({error}); reinstall with pip install -e . "
                           "(needs a C++17 compiler)") from None
    return Native(block_size, limit, list(stop_ids), mask_token_id, grow_to)


class Stepper:
    """Feeds verify's logits to a greedy request's controller, one step per cycle.

    CPU float32 logits go to the controller as a numpy view of the whole output buffer, taken once
    per buffer (the engines return the same buffer every cycle of a shape, and the first torch call
    after a graph run is the costliest host work of a CPU cycle); the controller takes the argmax
    of only the rows the acceptance rule reads. Other logits are reduced on their device and only
    the tokens cross to the host.
    """

    def __init__(self, controller: Controller):
        self.controller = controller
        self._views: dict[int, tuple[torch.Tensor, np.ndarray | None]] = {}  # per buffer (one per verify width)

    def __call__(self, logits: torch.Tensor, row: int) -> None:
        """A step from row `row` of a verify's logits [R, B, V]."""
        known = self._views.get(id(logits))
        if known is None or known[0] is not logits:
            host = logits.dtype == torch.float32 and logits.device.type == "cpu"
            if len(self._views) >= 4:
                self._views.clear()
            known = self._views[id(logits)] = logits, logits.numpy() if host else None
        if known[1] is not None:
            self.controller.step_greedy(known[1][row])
        else:
            self.controller.step(greedy_tokens(logits[row]).cpu())

"""A request's block-size schedule: a fixed B, B growing to G, or auto (BlockPilot chooses).

Written `B`, `B:G` or `auto` wherever a block size is given (`--block-size`, `--block-sizes`,
label columns). `B:G` runs cycles at B, and after a cycle that accepted at least B-1 drafts (it
filled a block of B) runs the next one at G; any shorter acceptance drops back to B. Repetitive
stretches inside a request are where a larger block pays, and a filled block is the cheapest
sign that one has begun; the native controller applies the rule per cycle, no Python in between.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from trtspec.errors import TrtspecError
from trtspec.limits import MAX_BLOCK_SIZE, parse_int

@dataclass(frozen=True)
class BlockChoice:
    """What a request asks for, from the flag to the controller: a block size B (1: autoregressive),
    B growing to G, or auto (`size` None: the BlockPilot policy chooses after prefill)."""

    size: int | None  # None: auto; 1: autoregressive
    grow_to: int = 0  # 0: never grows

    def __post_init__(self) -> None:
        if self.size is None:
            if self.grow_to:
                raise TrtspecError("with block size auto the BlockPilot policy chooses the growth too; drop the :G")
            return
        if isinstance(self.size, bool) or not isinstance(self.size, int) or not 1 <= self.size <= MAX_BLOCK_SIZE:
            raise TrtspecError(f"block size must be an integer in [2, {MAX_BLOCK_SIZE}], got {self.size!r} "
                               "(or 1 for AR, or auto)")
        if self.grow_to and not (2 <= self.size < self.grow_to <= MAX_BLOCK_SIZE):
            raise TrtspecError(f"a block grows from B >= 2 to a larger size up to {MAX_BLOCK_SIZE}; "
                               f"got {self.size}:{self.grow_to}")

    @property
    def auto(self) -> bool:
        return self.size is None

    @property
    def ar(self) -> bool:
        return self.size == 1

    @property
    def name(self) -> str:
        base = {None: "auto", 1: "AR"}.get(self.size, str(self.size))
        return f"{base}:{self.grow_to}" if self.grow_to else base

    def next_size(self, accepted: int, after: int | None = None) -> int:
        """The block size of the cycle after one that accepted `accepted` drafts: G once `after`
        drafts were accepted (default B-1, a filled block of B: what the native controller does), else B."""
        after = self.size - 1 if after is None else after
        return self.grow_to if self.grow_to and accepted >= after else self.size

    @property
    def sizes(self) -> tuple[int, ...]:
        """The block sizes whose graphs this schedule runs (none known yet for auto)."""
        if self.size is None:
            return ()
        return (self.size, self.grow_to) if self.grow_to else (self.size,)

    @classmethod
    def parse(cls, text: str | int, allow_auto: bool = True, allow_ar: bool = False, allow_growth: bool = True,
              label: str = "block size") -> "BlockChoice":
        """'12' -> 12; '6:16' -> 6 growing to 16; 'auto' -> AUTO and 'AR' -> AR (when allowed).

        The one parser of block sizes: flags, label columns, policy files and requests all use it.
        """
        if isinstance(text, bool) or not isinstance(text, (str, int)):
            raise TrtspecError(f"{label} must be an integer B or B:G, got {text!r}")
        text = str(text).strip()
        if allow_auto and text == "auto":
            return AUTO
        if allow_ar and text in ("AR", "1"):
            return AR
        base, colon, grown = text.partition(":")
        size, grow_to = parse_int(base), parse_int(grown) if colon else 0
        if colon and not allow_growth:
            raise TrtspecError(f"give plain block sizes here (a growing block B:G runs the graphs of B and G); "
                               f"got {text!r}")
        if size is None or grow_to is None:
            forms = ("an integer B" + (" or B:G (B growing to G)" if allow_growth else "")
                     + (", or auto" if allow_auto else "") + (", or AR" if allow_ar else ""))
            raise TrtspecError(f"{label} must be {forms}; got {text!r}")
        if not 2 <= size <= MAX_BLOCK_SIZE:
            raise TrtspecError(f"{label} must be in [2, {MAX_BLOCK_SIZE}], got {size} " + (
                "(or AR, also 1: the target alone)" if allow_ar else "(autoregressive decoding is --ar, and bench's baseline)"))
        return cls(size, grow_to)


AUTO = BlockChoice(None)  # the BlockPilot policy chooses after prefill
AR = BlockChoice(1)       # autoregressive: the target alone


class BlockPolicy(Protocol):
    """What the decode loop needs to decide AUTO: a one-shot choice from prefill's outputs
    (BlockPilot, trtspec.blockpilot, is the product's; the loop knows nothing of its training)."""

    # whether `choose` reads the logits of the prompt's tail (else prefill computes only the last)
    reads_logits: bool

    def choose(self, features: torch.Tensor, logits: torch.Tensor) -> "BlockChoice": ...


@dataclass(frozen=True)
class Load:
    """What an engine holds right now (a server's gauges, and what a BlockChooser judges by)."""

    queued: int
    running: int
    block_sizes: tuple[int, ...]  # current block size of each running request that is decoding, oldest first
    sampled: tuple[bool, ...] = ()  # whether each of them samples (T > 0), in the same order
    recent: float = 0.0  # requests running, averaged over the last second or so (engine.RECENT_S)
    slots: int = 0  # requests that can run together (max_running; 0: unknown)


class BlockChooser(Protocol):
    """What the engine asks of a load-aware chooser (BlockPilot's: trtspec.blockpilot.load), which
    turns the policy's one-shot choice into the one that pays for the batch a request joins."""

    def choose(self, choice: BlockChoice | Callable[[], BlockChoice], load: Load, sampled: bool) -> BlockChoice:
        """The block to run for an `auto` admission: the policy's `choice` (or a function that gives
        it, asked only when its answer can change the outcome) at the engine's `load`."""

    def requests_to_switch(self, chosen: BlockChoice, running: Sequence[tuple[BlockChoice, int]]) -> list[int]:
        """After an `auto` admission got `chosen`: which of the decoding requests (each: what it
        asked for, its current block size) turn AR from their next cycle, by their index."""

    def observe_cycle(self, size: int, batch: int, ms: float) -> None:
        """The engine ran one cycle of `batch` requests at `size` (1: AR) in `ms` milliseconds."""

    def observe_request(self, choice: BlockChoice, histogram: list[int], sampled: bool) -> None:
        """A request that ran at `choice` finished with this acceptance histogram."""


def parse_block_choices(text: str, allow_auto: bool = False, allow_growth: bool = True,
                        label: str = "block sizes") -> tuple[BlockChoice, ...]:
    """'6,12,6:16,auto' -> one BlockChoice each, duplicates dropped."""
    parts = str(text).split(",")
    return tuple(dict.fromkeys(BlockChoice.parse(part, allow_auto, allow_growth=allow_growth, label=label)
                               for part in parts))


def parse_block_sizes(text: str, label: str = "block sizes") -> tuple[int, ...]:
    """'8,12,16' -> (8, 12, 16): plain block sizes (what an engine is built for), duplicates dropped."""
    return tuple(c.size for c in parse_block_choices(text, allow_growth=False, label=label))

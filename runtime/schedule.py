"""A request's block-size schedule: a fixed B, B growing to G, or auto (BlockPilot chooses).

Written `B`, `B:G` or `auto` wherever a block size is given (`--block-size`, `--block-sizes`,
label columns). `B:G` runs cycles at B, and after a cycle that accepted at least B-1 drafts (it
filled a block of B) runs the next one at G; any shorter acceptance drops back to B. Repetitive
stretches inside a request are where a larger block pays, and a filled block is the cheapest
sign that one has begun; the native controller applies the rule per cycle, no Python in between.
"""

from __future__ import annotations

from dataclasses import dataclass

from trtspec.errors import TrtspecError
from trtspec.export.bindings import MAX_BLOCK_SIZE

AUTO = 0  # block size value meaning "let BlockPilot choose"


@dataclass(frozen=True)
class BlockChoice:
    size: int         # 1: autoregressive; AUTO: BlockPilot's choice
    grow_to: int = 0  # 0: never grows

    def __post_init__(self) -> None:
        if self.grow_to and not (2 <= self.size < self.grow_to <= MAX_BLOCK_SIZE):
            raise TrtspecError(f"a block grows from B >= 2 to a larger size up to {MAX_BLOCK_SIZE}; "
                               f"got {self.size}:{self.grow_to}")

    @property
    def name(self) -> str:
        base = {AUTO: "auto", 1: "AR"}.get(self.size, str(self.size))
        return f"{base}:{self.grow_to}" if self.grow_to else base

    @property
    def sizes(self) -> tuple[int, ...]:
        """The block sizes whose graphs this schedule runs."""
        return (self.size, self.grow_to) if self.grow_to else (self.size,)

    @classmethod
    def parse(cls, text: str | int, allow_auto: bool = True, allow_ar: bool = False) -> "BlockChoice":
        """'12' -> 12; '6:16' -> 6 growing to 16; 'auto' -> AUTO and 'AR' -> 1 (when allowed)."""
        text = str(text).strip()
        if allow_auto and text in ("auto", str(AUTO)):
            return cls(AUTO)
        if allow_ar and text in ("AR", "1"):
            return cls(1)
        base, _, grown = text.partition(":")
        try:
            size, grow_to = int(base), int(grown) if grown else 0
        except ValueError:
            also = ", or auto" if allow_auto else ""
            raise TrtspecError(f"a block size is an integer B or B:G (B growing to G){also}; got {text!r}") from None
        if not 2 <= size <= MAX_BLOCK_SIZE:
            raise TrtspecError(f"block size must be in [2, {MAX_BLOCK_SIZE}], got {size} "
                               "(autoregressive decoding is --ar, and bench's baseline)")
        return cls(size, grow_to)


def parse_block_choices(text: str, allow_auto: bool = False) -> tuple[BlockChoice, ...]:
    """'6,12,6:16,auto' -> one BlockChoice each, duplicates dropped."""
    return tuple(dict.fromkeys(BlockChoice.parse(part, allow_auto) for part in text.split(",")))

"""The bundled demo pair, and how model arguments name it.

`--target` defaults to the bundled demo target; `--drafter` defaults to the bundled b16 drafter
only when the target is the bundled one too, and also accepts a bundled name such as `demo-b16`.
A name that exists as a path is that path: a local `./demo-b16` is never shadowed by the bundled one.
"""

from __future__ import annotations

import os
from pathlib import Path

from trtspec.errors import TrtspecError

ASSETS = Path(__file__).resolve().parent / "assets"
DEMO_TARGET = "demo-target"
DEMO_DRAFTER = "demo-b16"


def bundled_names() -> list[str]:
    return sorted(p.name for p in ASSETS.glob("demo-*") if (p / "config.json").is_file())


def _bundled(value: str | None, default: str) -> str | None:
    """The bundled name `value` means (`default` when it is None), or None where it is a path:
    a path on disk wins over a bundled name."""
    if value is None:
        return default
    if not isinstance(value, str):
        return None
    return value if value.startswith("demo-") and not os.path.lexists(value) else None


def resolve_target(value: str | None) -> Path:
    if _bundled(value, DEMO_TARGET) == DEMO_TARGET:
        path = ASSETS / DEMO_TARGET
        if not (path / "config.json").is_file():
            raise TrtspecError("the bundled demo target is not installed; pass --target DIR")
        return path
    return Path(value)


def resolve_drafter(value: str | None, target: str | None) -> Path | None:
    """The drafter directory, or None when the request names none and none is implied."""
    if value is None and _bundled(target, DEMO_TARGET) != DEMO_TARGET:
        return None
    name = _bundled(value, DEMO_DRAFTER)
    if name is not None:
        path = ASSETS / name
        if not (path / "config.json").is_file():
            known = ", ".join(n for n in bundled_names() if n != DEMO_TARGET) or "none"
            raise TrtspecError(f"no bundled drafter named {name!r} and no such path (bundled: {known})")
        return path
    return Path(value)

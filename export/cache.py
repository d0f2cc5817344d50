"""Exported step graphs kept for the next build of the same pair.

Exporting a graph (torch.export's trace, its decompositions, the ONNX translation and check) is most
of a CPU build of a small model (docs/benchmarks.md, "Exported-graph cache"). The graphs do not
depend on the engine's block sizes, batch limit or policy (every axis is dynamic), so a rebuild with
other options, or the cached `--backend auto` engine of another block-size set, exports exactly what
an earlier build did. Graphs are kept in the cache directory (`$TRTSPEC_CACHE/graphs`) under a hash
of everything that determines them: the checkpoints it is made of (the target's graph: the target
and which of its layers feed the drafter, so a new drafter or draft vocabulary for the same target
reuses it; the draft graph: both checkpoints and the draft vocabulary), the graph's interface, the context length, dtype and device, the versions of torch and the ONNX exporter, and
the source of the export and model code. A graph over `MAX_CACHED_BYTES` (a large model, whose
export is no longer the slow part and whose copy would cost gigabytes) is not kept. The build's
self-check against eager PyTorch runs on a cached graph as on a fresh one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import shutil
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch

from trtspec import __version__
from trtspec.errors import TrtspecError
from trtspec.export.bindings import GraphSpec
from trtspec.fileio import atomic_write_text, cache_root, file_sha256, key_digest, staged_file, take_turns

GRAPHS_DIR = "graphs"
MAX_CACHED_BYTES = 1 << 30
SOURCES = ("export", "models")  # trtspec subpackages whose code decides what a graph computes


def graph_key(name: str, suffix: str, spec: GraphSpec, *, sources: dict[str, object], max_context: int,
              dtype: torch.dtype, device: torch.device, **options: object) -> str:
    """The cache entry's name; `sources`: content hashes of what the graph is made of (checkpoints,
    draft vocabulary, the target layers that feed the drafter); `options`: how it was exported."""
    key = {"graph": name, "format": suffix, "spec": spec.to_dict(), "sources": sources, "max_context": max_context,
           "dtype": str(dtype), "device": device.type, "options": options, "trtspec": __version__, "code": code_sha256(),
           "versions": {package: _version(package) for package in ("torch", "onnx", "onnxscript")}}
    return key_digest(key) + suffix


def export_cached(destination: Path, key: str, export: Callable[[Path], None]) -> None:
    """Write the graph to `destination`: a copy of the cached one, or `export(destination)` and keep
    a copy. An entry whose bytes no longer match the SHA-256 kept beside it is exported afresh; a
    cache that cannot be read or written is skipped. Builds of the same graph at the same time (two
    terminals, a server starting while a build runs) take turns, so the graph is exported once."""
    cached = cache_root() / GRAPHS_DIR / key
    digest = cached.with_name(cached.name + ".sha256")
    with take_turns(cached.with_name(cached.name + ".lock")):
        with contextlib.suppress(OSError):
            if cached.is_file() and digest.is_file() and file_sha256(cached) == digest.read_text().strip():
                shutil.copyfile(cached, destination)
                return
        export(destination)
        if destination.stat().st_size <= MAX_CACHED_BYTES:
            with contextlib.suppress(OSError, TrtspecError):
                with staged_file(cached) as temporary:
                    shutil.copyfile(destination, temporary)
                atomic_write_text(digest, file_sha256(destination))


@functools.cache
def code_sha256(packages: tuple[str, ...] = SOURCES) -> str:
    """Of the code that decides what a graph computes (or, given `packages`, what else is kept on
    the strength of the code: BlockPilot's cost tables): a change to it makes entries kept before stale."""
    digest = hashlib.sha256()
    for package in packages:
        folder = Path(importlib.import_module(f"trtspec.{package}").__file__).parent
        for path in sorted(folder.glob("*.py")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None

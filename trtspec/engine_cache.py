"""Engines built on first use: `--backend auto` for run, bench and serve without --engine.

On a CPU a small model decodes faster through an ONNX Runtime engine than in eager PyTorch
(docs/benchmarks.md), but building an engine is a separate step a new user does not know about. So
`auto` builds one the first time a (target, drafter, options) combination runs, into the cache
directory under a key made of the checkpoints' content hashes, the draft-vocabulary counts, the
build options, the trtspec version and the code the graphs are exported from, and reuses it from
then on. Nothing stale can be picked up: a changed checkpoint or graph code is a new key, and the
engine's own manifest checks every file it loads. An entry that fails that check (a damaged or
partly deleted file) is rebuilt with a message, and a cache that cannot be written makes `auto`
decode eagerly, saying why (`onnxruntime` refuses in one line).

`auto` stays eager on CUDA (replayed from CUDA graphs, trtspec.runtime.runner): a TensorRT or
AOTInductor build takes minutes and is tuned per GPU, so it is an explicit `trtspec build --backend
tensorrt|inductor`, then `--engine DIR`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Callable

import torch

from trtspec import __version__
from trtspec.engines.manifest import MANIFEST_VERSION, checkpoint_sha256, read_manifest, record_artifacts
from trtspec.device import engine_first, resolve_dtype
from trtspec.errors import TrtspecError
from trtspec.fileio import CACHE_ENV, ENGINE, cache_root, key_digest, output_kind

ENGINES_DIR = "engines"

BACKENDS = ("auto", "eager", "onnxruntime")
# ONNX Runtime graphs are shape-dynamic, so every block size a user is likely to ask for is built in:
# a size costs only its line in the manifest and its self-check.
BLOCK_SIZES = tuple(range(3, 33))
BACKEND_HELP = ("auto: on a CPU with onnxruntime installed, in float32 (--dtype auto on a CPU without AMX, "
                "where it beats eager bfloat16), an ONNX Runtime engine built on first use into the "
                f"cache (${CACHE_ENV}, default ~/.cache/trtspec) and reused after; eager otherwise (on CUDA replayed "
                "from CUDA graphs; a compiled engine: trtspec build --backend tensorrt|inductor). eager: the "
                "checkpoints in PyTorch. Env TRTSPEC_BACKEND.")


def wants_engine(backend: str, device: torch.device, dtype: str, block_sizes: tuple[int, ...]) -> bool:
    """Whether `backend` means a cached ONNX Runtime engine for this request: explicitly, or `auto`
    on a CPU with onnxruntime, float32 and block sizes an engine serves."""
    from trtspec.engines import onnxruntime as ort_engine

    if backend == "onnxruntime":
        return True
    # auto: float32 where an engine beats eager bfloat16 (device.engine_first), or where that is the dtype anyway
    float32 = resolve_dtype(dtype, device, compiled=engine_first(device)) == torch.float32
    usable = device.type == "cpu" and float32 and ort_engine.available()
    return backend == "auto" and usable and all(b >= BLOCK_SIZES[0] for b in block_sizes)  # B = 2: eager only


def engine_key(target_dir: Path, drafter_dir: Path, sizes: tuple[int, ...], draft_vocab: int | None = None,
               draft_counts: Path | None = None) -> str:
    """The cache entry's name: a hash of everything the built engine holds, the drafter's shipped
    BlockPilot policy included (the engine embeds it)."""
    from trtspec.blockpilot.policy import drafter_policy
    from trtspec.engines.int4 import DRAFT_BITS
    from trtspec.export.bindings import MAX_BATCH
    from trtspec.export.cache import code_sha256
    from trtspec.models.draft_vocab import DRAFTER_VOCAB_DIR

    counts = Path(draft_counts) if draft_counts else drafter_dir / DRAFTER_VOCAB_DIR
    policy = drafter_policy(drafter_dir)
    key = {"target": checkpoint_sha256(target_dir), "drafter": checkpoint_sha256(drafter_dir),
           "draft_vocab": draft_vocab, "counts": record_artifacts(counts) if draft_vocab and counts.is_dir() else None,
           "policy": record_artifacts(policy) if policy is not None else None,
           "block_sizes": sizes, "max_batch": MAX_BATCH, "draft_bits": DRAFT_BITS, "trtspec": __version__,
           "graph_code": code_sha256(),
           "manifest_version": MANIFEST_VERSION}  # a new manifest format is a new entry, not a refused one
    return key_digest(key, 16)


def _damage(path: Path) -> str | None:
    """Why the cache entry `path` cannot be loaded (the manifest's check of every file), or None."""
    try:
        read_manifest(path)
    except TrtspecError as exc:
        return str(exc)
    except OSError as exc:
        return f"{exc.filename}: {exc.strerror}"
    return None


def _discard(path: Path) -> None:
    """Remove a damaged cache entry that a build would not replace (its marker is gone too): the
    entry is trtspec's own, named by its key. What cannot be removed is left for the build to refuse."""
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _unwritable(entries: Path) -> str | None:
    """Why no new entry can be written into the cache directory `entries` (created here), or None."""
    try:
        entries.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None if os.access(entries, os.W_OK | os.X_OK) else "not writable"


def cached_engine(target_dir: Path, drafter_dir: Path, *, device: str, block_sizes: tuple[int, ...] = (),
                  draft_vocab: int | None = None, draft_counts: Path | None = None,
                  echo: Callable[[str], None] = print, fallback: bool = False) -> Path | None:
    """The ONNX Runtime engine of this pair and these options, built into the cache if it is not
    there or is damaged. A cache that cannot be written is one TrtspecError line, or with
    `fallback` (backend auto) a message and None: decode eagerly."""
    from trtspec.build import BuildConfig, build_engine
    from trtspec.export.bindings import MAX_BATCH

    sizes = tuple(sorted(set(BLOCK_SIZES) | set(block_sizes)))
    config = BuildConfig(block_sizes=sizes, backend="onnxruntime", dtype="float32", device=device,
                         max_batch=MAX_BATCH, draft_vocab=draft_vocab, draft_counts=draft_counts)
    entries = cache_root() / ENGINES_DIR
    path = entries / engine_key(Path(target_dir), Path(drafter_dir), sizes, draft_vocab, draft_counts)
    if os.path.lexists(path):
        damage = _damage(path)
        if damage is None:
            echo(f"using the ONNX Runtime engine built for this pair earlier: {path}")
            return path
        echo(f"the cached engine {path} is damaged, rebuilding it: {damage}")
        if output_kind(path) != ENGINE:  # a build replaces only a marked engine directory
            _discard(path)
    if draft_vocab is not None:  # a bad K or missing counts: one line now, not after announcing a build
        from trtspec.models.draft_vocab import select
        from trtspec.models.target import load_target_config

        select(draft_vocab, draft_counts, drafter_dir, load_target_config(target_dir).vocab_size)
    problem = _unwritable(entries)
    if problem is not None:
        reason = f"the engine cache {entries} cannot be written ({problem})"
        if not fallback:
            raise TrtspecError(f"{reason}; set {CACHE_ENV} to a writable directory, or pass --backend eager")
        echo(f"{reason}: decoding eagerly (set {CACHE_ENV} to a writable directory for a compiled engine)")
        return None
    echo(f"building an ONNX Runtime engine for this pair into {path} (once: later runs reuse it; "
         "--backend eager skips it)")
    build_engine(Path(target_dir), Path(drafter_dir), path, config)
    return path

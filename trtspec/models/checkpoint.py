"""Reading and writing Hugging Face style checkpoint directories.

A directory holds `config.json` and either `model.safetensors` or a sharded set indexed by
`model.safetensors.index.json`. Every failure is turned into a one-line `CheckpointError`.
Writes are staged (`trtspec.fileio.staged_directory`), so an interrupted save never leaves a
directory that looks complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from trtspec.errors import CheckpointError
from trtspec.fileio import CHECKPOINT, staged_directory
from trtspec.validate import read_json_object, safetensors_index

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_dir(path: str | os.PathLike, what: str) -> Path:
    """Return `path` as a directory that exists, or explain what is wrong with it."""
    directory = Path(path)
    if not directory.exists():
        raise CheckpointError(f"{what} directory not found: {directory}")
    if not directory.is_dir():
        raise CheckpointError(f"{what} path is not a directory: {directory}")
    return directory


def read_json(path: Path, what: str) -> dict:
    """Load a JSON object, naming the file in any error."""
    return read_json_object(path, what, CheckpointError)


def read_optional_json(path: Path, what: str) -> dict:
    return read_json(path, what) if path.exists() else {}


def _load_safetensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{what}: missing weight file {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{what}: cannot read {path} ({exc})") from None


def load_state_dict(directory: Path, what: str) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint, on the CPU."""
    single, index = directory / SINGLE_FILE, directory / INDEX_FILE
    if single.exists():
        return _load_safetensors(single, what)
    if not index.exists():
        raise CheckpointError(f"{what}: no {SINGLE_FILE} or {INDEX_FILE} in {directory}")
    weight_map = safetensors_index(index, what, CheckpointError)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        tensors.update(_load_safetensors(directory / shard, what))
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise CheckpointError(f"{what}: tensors listed in {INDEX_FILE} but absent from the shards: {missing[:3]}")
    return tensors


def save_checkpoint(directory: str | os.PathLike, config: dict, tensors: dict[str, torch.Tensor],
                    extra_files: dict[str, str] | None = None) -> Path:
    """Write config.json + model.safetensors atomically (temp dir, then rename)."""
    with staged_directory(directory, CHECKPOINT) as staging:
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        contiguous = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
        save_file(contiguous, str(staging / SINGLE_FILE), metadata={"format": "pt"})
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text, encoding="utf-8")
    return Path(directory)


def build_empty(factory: Callable[[], torch.nn.Module], device: str | torch.device = "cpu",
                dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Construct a module without running its random initialisation (weights come next), its
    storage allocated once, directly on `device` in `dtype` (a 4B model never passes through the
    CPU or float32 on its way to a GPU)."""
    with torch.device("meta"):
        module = factory()
    if dtype is not None:
        module = module.to(dtype)
    return module.to_empty(device=device)


def load_into(module: torch.nn.Module, tensors: dict[str, torch.Tensor], what: str,
              ignore_suffixes: tuple[str, ...] = ()) -> None:
    """Copy `tensors` into `module`, refusing missing, unexpected or misshaped tensors by name."""
    expected = module.state_dict()
    unexpected = sorted(n for n in tensors if n not in expected and not n.endswith(ignore_suffixes))
    missing = sorted(n for n in expected if n not in tensors)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"{what}: checkpoint lacks tensor {', '.join(missing[:3])}{more}")
    if unexpected:
        raise CheckpointError(f"{what}: checkpoint has unexpected tensor {', '.join(unexpected[:3])}")
    for name, param in expected.items():
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise CheckpointError(f"{what}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                                  f"config implies {tuple(param.shape)}")
    module.load_state_dict({n: tensors[n] for n in expected}, strict=True)

"""The engine directory's `manifest.json`: what was built, from what, and how to check it.

An engine directory is self-contained (graphs or plans, tokenizer, manifest). Loading one checks,
with a one-line error for each failure, that this trtspec reads its manifest version, that every
artifact is present with the size and SHA-256 recorded at build time (a truncated or edited file
is refused), and, when checkpoints are named too, that they are the ones it was built from.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trtspec.errors import TrtspecError
from trtspec.export.bindings import GraphSpec, graph_specs
from trtspec.models.config import DFlashConfig, Qwen3Config

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
TOKENIZER_DIR = "tokenizer"
CHECKPOINT_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_sha256(directory: Path) -> str:
    """One hash over a checkpoint's config and weights (names and contents, in sorted order)."""
    digest = hashlib.sha256()
    files = sorted({p for pattern in CHECKPOINT_FILES for p in directory.glob(pattern)})
    for path in files:
        digest.update(path.name.encode() + b"\0" + file_sha256(path).encode())
    return digest.hexdigest()


@dataclass
class Manifest:
    backend: str
    dtype: str
    max_context: int
    block_sizes: list[int]
    profiles: dict[str, list]          # graph -> ordered profile keys ("prefill", 1, B, ...)
    target_config: dict
    drafter_config: dict               # z-lab layout
    sources: dict[str, str]            # "target"/"drafter" -> checkpoint_sha256
    artifacts: dict[str, dict]         # relative path -> {"bytes", "sha256"}
    graphs: dict[str, dict] = field(default_factory=dict)  # graph -> {"file", "inputs", "outputs"}
    tensorrt_profiles: dict | None = None  # the TensorRT optimization profiles of these graphs
    check: dict | None = None          # build-time comparison with eager torch
    policy: dict | None = None
    trtspec_version: str = ""
    manifest_version: int = MANIFEST_VERSION

    @property
    def target(self) -> Qwen3Config:
        return Qwen3Config.from_dict(self.target_config, "engine target config")

    @property
    def drafter(self) -> DFlashConfig:
        return DFlashConfig.from_zlab(self.drafter_config)

    def specs(self) -> dict[str, GraphSpec]:
        return graph_specs(self.target, self.drafter)

    def profile_index(self, graph: str, key) -> int:
        return self.profiles[graph].index(key)

    def block_size_table(self) -> list[dict]:
        """Each built block size with the profile it uses in every graph."""
        return [{"block_size": b, **{f"{g}_profile": self.profile_index(g, b) for g in self.profiles}}
                for b in self.block_sizes]

    def to_dict(self) -> dict:
        data = asdict(self)
        data["block_size_profiles"] = self.block_size_table()
        return data

    def write(self, directory: Path) -> None:
        (directory / MANIFEST_FILE).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")


def record_artifacts(directory: Path) -> dict[str, dict]:
    return {str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST_FILE}


def read_manifest(directory: str | Path) -> Manifest:
    """Load and verify an engine directory's manifest (see the module docstring)."""
    directory = Path(directory)
    path = directory / MANIFEST_FILE
    if not directory.is_dir():
        raise TrtspecError(f"engine directory not found: {directory}")
    if not path.is_file():
        raise TrtspecError(f"{directory} is not an engine directory (no {MANIFEST_FILE}); "
                           "create one with `trtspec build`")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TrtspecError(f"{path} is not valid JSON ({exc}); rebuild the engine") from None
    version = data.get("manifest_version") if isinstance(data, dict) else None
    if version != MANIFEST_VERSION:
        raise TrtspecError(f"{path} has manifest version {version!r} (written by trtspec "
                           f"{data.get('trtspec_version', '?') if isinstance(data, dict) else '?'}); this trtspec "
                           f"reads version {MANIFEST_VERSION}: rebuild the engine with `trtspec build`")
    data.pop("block_size_profiles", None)
    try:
        manifest = Manifest(**data)
    except TypeError as exc:
        raise TrtspecError(f"{path} does not have the fields of a version {MANIFEST_VERSION} manifest ({exc})") from None
    for name, recorded in manifest.artifacts.items():
        artifact = directory / name
        if not artifact.is_file():
            raise TrtspecError(f"engine {directory} is incomplete: {name} is missing; rebuild the engine")
        size = artifact.stat().st_size
        if size != recorded["bytes"]:
            raise TrtspecError(f"engine file {artifact} is {size} bytes, the manifest says {recorded['bytes']}: "
                               "truncated or replaced; rebuild the engine")
        if file_sha256(artifact) != recorded["sha256"]:
            raise TrtspecError(f"engine file {artifact} does not match its SHA-256 in the manifest: "
                               "corrupted or edited; rebuild the engine")
    return manifest


def check_sources(manifest: Manifest, target: Path | None, drafter: Path | None) -> None:
    """Refuse an engine built from other checkpoints than the ones named."""
    for role, directory in (("target", target), ("drafter", drafter)):
        if directory is None:
            continue
        actual = checkpoint_sha256(Path(directory))
        if actual != manifest.sources.get(role):
            raise TrtspecError(f"the engine was built from another {role} checkpoint than {directory} "
                               f"(sha256 {manifest.sources.get(role, '?')[:12]}... vs {actual[:12]}...); "
                               "rebuild it with `trtspec build`")

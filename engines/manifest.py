"""The engine directory's `manifest.json`: what was built, from what, and how to check it.

An engine directory is self-contained (graphs or plans, tokenizer, policy, manifest). Loading one
checks, with a one-line error naming the file and field for each failure, that this trtspec reads
its manifest version, that every field has its type and range, that the manifest accounts for
every file in the directory (a file it does not list, such as a graph whose entry was removed, is
refused: nothing unhashed is ever loaded), that every artifact is present with the size and
SHA-256 recorded at build time (a truncated or edited file is refused), that the manifest itself
is what the build wrote (`manifest_sha256`, a digest of its canonical JSON: an edited
`max_context`, `mask_token_id`, `rope_theta`, dtype or profile index is refused, not run), and,
when checkpoints are named too, that they are the ones it was built from.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trtspec.device import MODEL_DTYPES
from trtspec.errors import TrtspecError
from trtspec.export.bindings import (DRAFT, IN_PLACE, MAX_BATCH, MAX_BLOCK_SIZE, SHARED, TARGET, GraphSpec, graph_specs,
                                     target_graph_in_place)
from trtspec.fileio import MARKER, file_sha256
from trtspec.models.config import DFlashConfig, Qwen3Config, target_config_from_dict

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 9  # 2: batched step graphs (batch and slot axes); 3: the manifest's own content hashed;
# 4: the target graph's `computed` input (its feed-forward on the real positions of padded rows);
# 5: the draft graph's `proposal_logits` output (sampled requests draw their proposals from them);
# 6: the target graph's projections, too, on the real positions only (same bindings, a faster graph);
# 7: its `scored` input: logits [scored, vocab] of the positions asked for (a prompt chunk's last);
# 8: graphs' `cache` layout (an ONNX Runtime 4-bit target's caches are per layer, updated in place);
# 9: the in-place target graph's `lengths` and `computed` (rows of any lengths in one call)
DIGEST_FIELD = "manifest_sha256"  # of the canonical JSON of every other field (content_sha256)
TOKENIZER_DIR = "tokenizer"
CHECKPOINT_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json")
BACKENDS = ("onnxruntime", "tensorrt", "torch", "inductor")
DTYPES = tuple(MODEL_DTYPES)
WEIGHT_FORMATS = ("int4", "int8")  # quantized weights (`weights`, by their fewest bits); absent: the dtype's
UNLISTED = (MANIFEST_FILE, MARKER)  # the only files of an engine directory that are not artifacts


def content_sha256(data: dict) -> str:
    """SHA-256 of a manifest's canonical JSON (sorted keys, no spaces, ASCII) without its digest field:
    what a load recomputes, so any edit of a field (or a damaged byte) is refused."""
    body = {key: value for key, value in data.items() if key != DIGEST_FIELD}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


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
    max_batch: int                     # requests one call may batch (the TensorRT profiles' batch axis)
    profiles: dict[str, list]          # graph -> ordered profile keys ("prefill", 1, B, ...)
    target_config: dict
    drafter_config: dict               # z-lab layout
    sources: dict[str, str]            # "target"/"drafter" -> checkpoint_sha256
    artifacts: dict[str, dict]         # relative path -> {"bytes", "sha256"}
    graphs: dict[str, dict] = field(default_factory=dict)  # graph -> {"file", "inputs", "outputs"}
    tensorrt_profiles: dict | None = None  # the TensorRT optimization profiles of these graphs
    check: dict | None = None          # build-time comparison with eager torch
    policy: dict | None = None
    draft_vocab: dict | None = None    # {"dir", "size": K, "ids_sha256"}: the drafter proposes among K ids
    weights: dict | None = None        # None: weights in `dtype`; else {"format": "int4"|"int8", "graphs", ...}
    trtspec_version: str = ""
    manifest_version: int = MANIFEST_VERSION

    @property
    def target(self) -> Qwen3Config:
        return target_config_from_dict(self.target_config, "engine target config")

    @property
    def drafter(self) -> DFlashConfig:
        return DFlashConfig.from_zlab(self.drafter_config)

    def specs(self) -> dict[str, GraphSpec]:
        specs = graph_specs(self.target, self.drafter, (self.draft_vocab or {}).get("size"))
        if self.graphs.get(TARGET, {}).get("cache") == IN_PLACE:
            specs[TARGET] = target_graph_in_place(self.target, self.drafter.num_features)
        return specs

    @property
    def label(self) -> str:
        """The backend and any weight format, as reports name the engine: "onnxruntime int4 (target),
        int8 (draft)"."""
        if self.weights is None:
            return self.backend
        graph_bits = self.weights["graph_bits"]
        return f"{self.backend} " + ", ".join(f"int{bits} ({graph})" for graph, bits in graph_bits.items())

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
        """The manifest, with the digest of its content (taken of what a load reads back: JSON's types)."""
        data = json.loads(json.dumps(self.to_dict()))
        data[DIGEST_FIELD] = content_sha256(data)
        (directory / MANIFEST_FILE).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _files(directory: Path) -> list[str]:
    """Every file below `directory` (relative, POSIX), except the manifest and the output marker."""
    return [p.relative_to(directory).as_posix() for p in sorted(directory.rglob("*"))
            if not p.is_dir() and p.relative_to(directory).as_posix() not in UNLISTED]


def record_artifacts(directory: Path) -> dict[str, dict]:
    return {name: {"bytes": (directory / name).stat().st_size, "sha256": file_sha256(directory / name)}
            for name in _files(directory)}


def _is_int(value, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _relative(value) -> bool:
    """A path that stays inside the engine directory."""
    if not isinstance(value, str) or not value or "\\" in value:
        return False
    parts = Path(value).parts
    return not Path(value).is_absolute() and ".." not in parts and "." not in value.split("/")


def validate_fields(data: dict, path: Path) -> None:
    """Check every field of a manifest dict (types and ranges) before anything uses it; one line
    naming the file and the field for the first that is wrong."""
    def bad(field_name: str, expected: str):
        return TrtspecError(f"{path}: field {field_name} must be {expected}, got {data.get(field_name)!r:.80}; "
                            "the manifest is damaged or edited: rebuild the engine")

    for name in ("backend", "dtype", "max_context", "block_sizes", "max_batch", "profiles", "target_config", "drafter_config",
                 "sources", "artifacts", "graphs"):
        if name not in data:
            raise TrtspecError(f"{path}: field {name} is missing; rebuild the engine")
    if data["backend"] not in BACKENDS:
        raise bad("backend", "one of " + ", ".join(BACKENDS))
    if data["dtype"] not in DTYPES:
        raise bad("dtype", "one of " + ", ".join(DTYPES))
    if not _is_int(data["max_context"], 2):
        raise bad("max_context", "an integer >= 2")
    if not _is_int(data["max_batch"], 1) or data["max_batch"] > MAX_BATCH:
        raise bad("max_batch", f"an integer in [1, {MAX_BATCH}]")
    sizes = data["block_sizes"]
    if (not isinstance(sizes, list) or not sizes or not all(_is_int(b, 2) and b <= MAX_BLOCK_SIZE for b in sizes)
            or sorted(set(sizes)) != sizes):
        raise bad("block_sizes", f"a sorted list of distinct integers in [2, {MAX_BLOCK_SIZE}]")
    for name in ("target_config", "drafter_config", "sources", "artifacts", "graphs", "profiles"):
        if not isinstance(data[name], dict):
            raise bad(name, "a JSON object")
    for name in ("tensorrt_profiles", "check", "policy", "draft_vocab", "weights"):
        if data.get(name) is not None and not isinstance(data[name], dict):
            raise bad(name, "a JSON object or null")
    if not isinstance(data.get("trtspec_version", ""), str):
        raise bad("trtspec_version", "a string")
    for role, digest in data["sources"].items():
        if not isinstance(digest, str):
            raise TrtspecError(f"{path}: field sources.{role} must be a string; rebuild the engine")
    for name, record in data["artifacts"].items():
        if not _relative(name):
            raise TrtspecError(f"{path}: artifacts entry {name!r} is not a path inside the engine directory; "
                               "rebuild the engine")
        if (not isinstance(record, dict) or not _is_int(record.get("bytes"))
                or not isinstance(record.get("sha256"), str) or len(record["sha256"]) != 64):
            raise TrtspecError(f"{path}: field artifacts.{name} must be {{\"bytes\": size, "
                               "\"sha256\": 64 hex digits}; rebuild the engine")
    for graph in (TARGET, DRAFT):
        info = data["graphs"].get(graph)
        if not isinstance(info, dict) or not _relative(info.get("file")):
            raise TrtspecError(f"{path}: field graphs.{graph}.file must name a file inside the engine directory; "
                               "rebuild the engine")
        if info["file"] not in data["artifacts"]:
            raise TrtspecError(f"{path}: graph file {info['file']} (graphs.{graph}.file) is not listed in artifacts, "
                               "so it cannot be verified; rebuild the engine")
        if info.get("cache", SHARED) not in ((SHARED, IN_PLACE) if graph == TARGET and data["backend"] == "onnxruntime"
                                             else (SHARED,)):
            raise TrtspecError(f"{path}: field graphs.{graph}.cache must be {SHARED!r}"
                               + (f" or {IN_PLACE!r}" if graph == TARGET else "") + "; rebuild the engine")
        keys = data["profiles"].get(graph)
        needed = (["prefill", 1] if graph == TARGET else []) + sizes
        if not isinstance(keys, list) or any(k not in keys for k in needed):
            raise TrtspecError(f"{path}: field profiles.{graph} must list the profiles "
                               f"{', '.join(map(str, needed))}; rebuild the engine")
    policy = data.get("policy")
    if policy is not None and (not _relative(policy.get("dir")) or not isinstance(policy.get("block_sizes"), list)):
        raise TrtspecError(f"{path}: field policy must have a dir inside the engine directory and block_sizes; "
                           "rebuild the engine")
    weights = data.get("weights")
    if weights is not None and (weights.get("format") not in WEIGHT_FORMATS or data["backend"] != "onnxruntime"
                                or not isinstance(weights.get("graphs"), list) or not weights["graphs"]
                                or any(g not in (TARGET, DRAFT) for g in weights["graphs"])
                                or not isinstance(weights.get("graph_bits"), dict)
                                or sorted(weights["graph_bits"]) != sorted(weights["graphs"])
                                or any(b not in (4, 8) for b in weights["graph_bits"].values())):
        raise TrtspecError(f"{path}: field weights must be null or, in an onnxruntime engine, have a format "
                           f"({', '.join(WEIGHT_FORMATS)}) and the graphs it applies to ({TARGET}, {DRAFT}); "
                           "rebuild the engine")
    vocab = data.get("draft_vocab")
    if vocab is not None and (not _relative(vocab.get("dir")) or not _is_int(vocab.get("size"), 2)
                              or not isinstance(vocab.get("ids_sha256"), str)):
        raise TrtspecError(f"{path}: field draft_vocab must have a dir inside the engine directory, a size >= 2 "
                           "and ids_sha256; rebuild the engine")


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
    recorded, actual = data.pop(DIGEST_FIELD, None), content_sha256(data)
    data.pop("block_size_profiles", None)
    validate_fields(data, path)  # a field of the wrong type or range is named first
    try:
        manifest = Manifest(**data)
    except TypeError as exc:
        raise TrtspecError(f"{path} does not have the fields of a version {MANIFEST_VERSION} manifest "
                           f"({exc})") from None
    for name, parse in (("target_config", lambda: manifest.target), ("drafter_config", lambda: manifest.drafter)):
        try:
            parse()
        except (TrtspecError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise TrtspecError(f"{path}: field {name} is not a valid model config ({exc}); "
                               "rebuild the engine") from None
    if recorded != actual:  # well-formed but not what the build wrote (max_context, dtype, a profile, ...)
        found = "has no manifest_sha256" if recorded is None else "does not match its manifest_sha256"
        raise TrtspecError(f"{path} was edited or damaged: its content {found} (the digest written at build "
                           "time); rebuild the engine")
    unlisted = [name for name in _files(directory) if name not in manifest.artifacts]
    if unlisted:
        raise TrtspecError(f"engine {directory} holds {unlisted[0]}, which {MANIFEST_FILE} does not list among its "
                           "artifacts (its entry was removed or the file added after the build): refusing to load "
                           "an unverified file; rebuild the engine")
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

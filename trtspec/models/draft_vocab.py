"""The draft vocabulary (FR-Spec): the drafter proposes only among the K most frequent token ids.

Token counts are made once (`trtspec draft-vocab`, over the target's own continuations or a
corpus) and kept in a directory: `counts.safetensors` (int64 [vocab_size]) and
`draft_vocab.json` (where the counts came from). A drafter's own sits in `DRAFTER/draft_vocab/`,
like its BlockPilot policy. K is chosen at load time (`--draft-vocab K`): the drafter's head is
cut to those K rows and its argmax mapped back to full-vocabulary ids (DFlashDrafter.
use_draft_vocab). Verification keeps the full vocabulary, so output is unchanged; only the
proposals, and so the acceptance, can differ.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from trtspec.errors import TrtspecError
from trtspec.limits import DRAFT_VOCAB
from trtspec.models.checkpoint import read_json
from trtspec.models.config import DFlashConfig

DRAFTER_VOCAB_DIR = "draft_vocab"
COUNTS_FILE = "counts.safetensors"
INFO_FILE = "draft_vocab.json"
KIND = "draft-vocab"


@dataclass
class TokenCounts:
    """How often each token id occurred (int64 [vocab_size]) and where the counts came from."""

    counts: torch.Tensor
    info: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.counts.numel()

    def top_ids(self, k: int) -> torch.Tensor:
        """The k most frequent ids, most frequent first (ties: the lower id first)."""
        check_size(k, self.vocab_size)
        order = torch.argsort(-self.counts, stable=True)  # stable: equal counts keep id order
        return order[:k].clone()

    def coverage(self, k: int) -> float:
        """Share of the counted tokens that the k most frequent ids cover."""
        total = int(self.counts.sum())
        return float(self.counts[self.top_ids(k)].sum()) / total if total else 0.0

    def save(self, directory: Path) -> None:
        save_file({"counts": self.counts.to(torch.int64).contiguous()}, str(directory / COUNTS_FILE))
        info = {"kind": KIND, "vocab_size": self.vocab_size, "tokens": int(self.counts.sum()), **self.info}
        (directory / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def ids_sha256(ids: torch.Tensor) -> str:
    """The fingerprint of a draft vocabulary (its ids as little-endian int64, in order)."""
    return hashlib.sha256(ids.cpu().numpy().astype("<i8").tobytes()).hexdigest()


def check_size(k: int, vocab_size: int, label: str = "--draft-vocab") -> int:
    """K in [2, vocab_size] (one line otherwise)."""
    k = DRAFT_VOCAB.check(k, label)
    if k > vocab_size:
        raise TrtspecError(f"{label} must be at most the vocabulary size {vocab_size}, got {k}")
    return k


def drafter_counts(drafter_dir: str | Path | None) -> Path | None:
    """The token counts shipped inside a drafter directory, if there are any."""
    if drafter_dir is None:
        return None
    path = Path(drafter_dir) / DRAFTER_VOCAB_DIR
    return path if (path / COUNTS_FILE).is_file() else None


def load_counts(directory: str | Path, vocab_size: int) -> TokenCounts:
    """Read and check a counts directory (written by `trtspec draft-vocab`) for a vocabulary of `vocab_size`."""
    directory = Path(directory)
    counts_file, info_file = directory / COUNTS_FILE, directory / INFO_FILE
    if not counts_file.is_file():
        raise TrtspecError(f"{directory} holds no token counts ({COUNTS_FILE}); make them with "
                           "`trtspec draft-vocab --data train.jsonl -o DIR`")
    try:
        tensors = load_file(str(counts_file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise TrtspecError(f"{counts_file}: cannot read it ({exc})") from None
    counts = tensors.get("counts")
    if counts is None or counts.dtype != torch.int64 or counts.dim() != 1:
        raise TrtspecError(f"{counts_file}: field counts must be an int64 vector")
    if counts.numel() != vocab_size:
        raise TrtspecError(f"{counts_file}: counts cover {counts.numel()} token ids, but the target's vocabulary "
                           f"has {vocab_size}; count again with this target")
    if bool((counts < 0).any()):
        raise TrtspecError(f"{counts_file}: field counts must be >= 0")
    info = {}
    if info_file.is_file():
        try:
            info = json.loads(info_file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TrtspecError(f"{info_file} is not valid JSON ({exc})") from None
        if not isinstance(info, dict):
            raise TrtspecError(f"{info_file} must hold a JSON object")
    return TokenCounts(counts, info)


def trained_draft_vocab(drafter_dir: str | Path | None) -> dict | None:
    """{"size", "ids_sha256"} of the draft vocabulary a drafter was trained with (train-drafter
    --draft-vocab records it in its config's lineage), or None."""
    config_file = Path(drafter_dir) / "config.json" if drafter_dir is not None else None
    if config_file is None or not config_file.is_file():
        return None
    trained = DFlashConfig.from_zlab(read_json(config_file, "drafter"), str(config_file)).lineage.get("draft_vocab")
    return trained if isinstance(trained, dict) and isinstance(trained.get("size"), int) else None


def select(k: int | None, counts_dir: str | Path | None, drafter_dir: str | Path | None,
           vocab_size: int) -> tuple[torch.Tensor, TokenCounts] | None:
    """The draft ids for `--draft-vocab K` (None: the drafter's trained K if it has one, else the full
    vocabulary), from `counts_dir` or the drafter's own counts; one line when K is out of range, there
    are no counts, or the drafter's own counts do not give the ids it was trained on."""
    trained = trained_draft_vocab(drafter_dir)
    if k is None and trained is not None:
        k = trained["size"]
    if k is None:
        if counts_dir is not None:
            raise TrtspecError("--draft-counts chooses the counts behind --draft-vocab K; give --draft-vocab too")
        return None
    check_size(k, vocab_size)
    source = counts_dir if counts_dir is not None else drafter_counts(drafter_dir)
    if source is None:
        raise TrtspecError(f"--draft-vocab {k} needs token counts, and the drafter {drafter_dir} has no "
                           f"{DRAFTER_VOCAB_DIR}/ directory: make one with `trtspec draft-vocab --data train.jsonl "
                           "-o DIR` and pass --draft-counts DIR")
    counts = load_counts(source, vocab_size)
    ids = counts.top_ids(k)
    own = trained is not None and k == trained["size"] and counts_dir is None  # the drafter's own K and counts
    if own and ids_sha256(ids) != trained.get("ids_sha256"):
        raise TrtspecError(f"{drafter_dir}: its {DRAFTER_VOCAB_DIR}/ counts do not rank the {k} ids it was trained to "
                           "propose among; count the training data again (trtspec draft-vocab --data) into it")
    return ids, counts

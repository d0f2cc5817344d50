"""Counting token ids for a draft vocabulary (trtspec.models.draft_vocab): over the target's own
continuations (generate-data output: the response tokens only) and/or plain-text corpora."""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from trtspec import __version__
from trtspec.engines.manifest import checkpoint_sha256
from trtspec.fileio import file_sha256
from trtspec.errors import TrtspecError
from trtspec.models.draft_vocab import TokenCounts
from trtspec.training.data import read_training_data

CORPUS_CHUNK_LINES = 256  # lines tokenized together (and one progress step) in a corpus file


def response_counts(sequences: list[tuple[list[int], int]], vocab_size: int) -> torch.Tensor:
    """int64 [vocab_size]: how often each id occurs in the responses of (ids, prompt length) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, prompt_length in sequences:
        counts += torch.bincount(torch.tensor(ids[prompt_length:], dtype=torch.long), minlength=vocab_size)
    return counts


def count_tokens(codec, vocab_size: int, data: list[str | Path] = (), corpus: list[str | Path] = (),
                 target_dir: str | Path | None = None, progress: bool = True) -> TokenCounts:
    """Counts of every token id in the responses of `data` files and the text of `corpus` files."""
    if not data and not corpus:
        raise TrtspecError("give --data FILE (generate-data output) or --corpus FILE to count tokens in")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    sources = []
    for path in data:
        sequences = read_training_data(path, codec, vocab_size)
        found = response_counts(sequences, vocab_size)
        counts += found
        tokens = int(found.sum())
        sources.append({"path": str(path), "sha256": file_sha256(Path(path)), "kind": "continuations",
                        "sequences": len(sequences), "tokens": tokens})
    for path in corpus:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
        except (OSError, UnicodeDecodeError) as exc:
            raise TrtspecError(f"cannot read corpus {path} as UTF-8 text ({exc})") from None
        tokens = 0
        chunks = range(0, len(lines), CORPUS_CHUNK_LINES)
        for start in tqdm(chunks, desc=f"count {Path(path).name}", unit="chunk", disable=not progress,
                          dynamic_ncols=True):
            ids = codec.tokenizer.encode("".join(lines[start:start + CORPUS_CHUNK_LINES]), add_special_tokens=False).ids
            chunk = torch.tensor(ids, dtype=torch.long)
            if chunk.numel() and int(chunk.max()) >= vocab_size:
                raise TrtspecError(f"corpus {path}: the tokenizer gives id {int(chunk.max())}, outside the target's "
                                   f"vocabulary of {vocab_size}")
            counts += torch.bincount(chunk, minlength=vocab_size)
            tokens += chunk.numel()
        sources.append({"path": str(path), "sha256": file_sha256(Path(path)), "kind": "corpus", "tokens": tokens})
    if int(counts.sum()) == 0:
        raise TrtspecError("no tokens to count: the data and corpus files are empty")
    info = {"sources": sources, "trtspec_version": __version__,
            "target_sha256": checkpoint_sha256(Path(target_dir)) if target_dir is not None else None}
    return TokenCounts(counts, info)

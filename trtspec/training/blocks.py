"""Packing many draft blocks into one training sequence (the DFlash recipe).

Each anchor is a response position p: block position 0 holds the true token at p, positions
1..B-1 hold the mask token, and position k must predict the token at p + k. A block token may
attend to context strictly before its anchor (j < p) and to every position of its own block,
never to another block — exactly what it sees at inference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

IGNORE = -100


def position_weights(block_size: int, gamma: float, emphasis_from: int = 0) -> torch.Tensor:
    """Loss weight of block position k: exp(-(k-1)/gamma) for k >= 1, 0 for the anchor itself.

    With `emphasis_from` = B0 > 0 (expand-block), positions k >= B0 restart the decay at full
    weight, exp(-(k-B0)/gamma), so a drafter trained at B0 learns its new positions.
    """
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    if emphasis_from > 0:
        new = k >= emphasis_from
        weights[new] = torch.exp(-(k[new] - emphasis_from) / gamma)
    weights[0] = 0.0
    return weights


def default_gamma(block_size: int) -> float:
    """The paper's decay: 7 for B=16, 5 for B=10, 4 for B=8; elsewhere the line 1 + 3B/8 through them."""
    return {8: 4.0, 10: 5.0, 16: 7.0}.get(block_size, 1 + 3 * block_size / 8)


def sample_anchors(prompt_len: int, total_len: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `count` distinct anchor positions among response tokens that have a next token."""
    first, last = prompt_len, total_len - 2
    if last < first:
        return torch.empty(0, dtype=torch.long)
    candidates = torch.arange(first, last + 1)
    chosen = torch.randperm(len(candidates), generator=generator)[:count]
    return candidates[chosen].sort().values


@dataclass
class PackedBatch:
    tokens: torch.Tensor           # [b, L] the sequences (target input), padded
    block_tokens: torch.Tensor     # [b, N] anchor token then masks, per block
    block_positions: torch.Tensor  # [b, N]
    labels: torch.Tensor           # [b, N] token each block position must predict, IGNORE elsewhere
    weights: torch.Tensor          # [b, N] per-position loss weight
    mask: torch.Tensor             # [b, N, L + N] True = may attend

    @property
    def predicted_tokens(self) -> int:
        return int((self.labels != IGNORE).sum())


def pack(sequences: list[tuple[list[int], int]], block_size: int, anchors_per_sequence: int,
         mask_token_id: int, gamma: float, generator: torch.Generator | None, pad_id: int = 0,
         emphasis_from: int = 0, anchor_sets: list[torch.Tensor] | None = None) -> PackedBatch:
    """Build one batch from (token ids, prompt length) pairs: fresh random anchors for training,
    or the given sorted `anchor_sets` (one per sequence) for evaluation."""
    if anchor_sets is None:
        anchor_sets = [sample_anchors(prompt_len, len(ids), anchors_per_sequence, generator)
                       for ids, prompt_len in sequences]
    length = max(len(ids) for ids, _ in sequences)
    blocks = max(1, max(len(a) for a in anchor_sets))
    n = blocks * block_size
    b = len(sequences)
    tokens = torch.full((b, length), pad_id, dtype=torch.long)
    block_tokens = torch.full((b, n), mask_token_id, dtype=torch.long)
    block_positions = torch.zeros((b, n), dtype=torch.long)
    labels = torch.full((b, n), IGNORE, dtype=torch.long)
    weights = torch.zeros((b, n))
    mask = torch.zeros((b, n, length + n), dtype=torch.bool)
    offsets = torch.arange(block_size)
    per_position = position_weights(block_size, gamma, emphasis_from)
    for row, ((ids, _), anchors) in enumerate(zip(sequences, anchor_sets)):
        seq = torch.tensor(ids, dtype=torch.long)
        tokens[row, :len(ids)] = seq
        for slot in range(blocks):
            cols = slice(slot * block_size, (slot + 1) * block_size)
            mask[row, cols, length + slot * block_size:length + (slot + 1) * block_size] = True  # own block
            if slot >= len(anchors):
                continue  # padding block: attends to itself only, predicts nothing
            anchor = int(anchors[slot])
            block_tokens[row, slot * block_size] = seq[anchor]
            block_positions[row, cols] = anchor + offsets
            targets = anchor + offsets[1:]
            valid = targets < len(ids)
            labels[row, slot * block_size + 1:(slot + 1) * block_size][valid] = seq[targets[valid]]
            weights[row, cols] = per_position * (labels[row, cols] != IGNORE)
            mask[row, cols, :anchor] = True  # context strictly before the anchor
    return PackedBatch(tokens, block_tokens, block_positions, labels, weights, mask)


def cosine_with_warmup(step: int, total: int, warmup: int) -> float:
    """Learning-rate multiplier: linear warm-up, then cosine decay to zero."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

"""The eager runner: PyTorch execution of the decode loop's step functions.

The runtime talks to every runner through the same four calls: `prefill`, `verify`, `draft`
and `rollback`. This one simply calls the PyTorch modules; compiled backends replay exported
graphs with the same inputs and outputs.
"""

from __future__ import annotations

import torch

from trtspec.export.bindings import MAX_BLOCK_SIZE, PREFILL_LOGITS
from trtspec.models import DFlashDrafter, KVCache, Qwen3Target


class EagerRunner:
    def __init__(self, target: Qwen3Target, drafter: DFlashDrafter | None = None):
        self.target = target
        self.drafter = drafter
        self.feature_layers = tuple(drafter.config.target_layer_ids) if drafter else ()
        self.device = target.device
        self.max_context = target.config.max_position_embeddings  # positions a request may fill
        self.mask_token_id = drafter.config.mask_token_id if drafter else None
        self.block_sizes = None  # any block size
        self._target_cache: KVCache | None = None
        self._drafter_cache: KVCache | None = None

    def reset(self, positions: int) -> None:
        """Start a request that may write up to `positions` positions (+ one block of slack)."""
        needed = positions + MAX_BLOCK_SIZE
        if self._target_cache is None or self._target_cache.max_len < needed:
            self._target_cache = self.target.new_cache(1, needed)
            if self.drafter is not None:
                self._drafter_cache = self.drafter.new_cache(1, needed)
        self._target_cache.length = 0
        if self._drafter_cache is not None:
            self._drafter_cache.length = 0

    def _tensor(self, tokens: list[int] | torch.Tensor) -> torch.Tensor:
        """[1, T] token ids on the model's device (a tensor on it is used in place)."""
        return torch.as_tensor(tokens, dtype=torch.long, device=self.device)[None]

    def prefill(self, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of the last PREFILL_LOGITS prompt positions [<=PREFILL_LOGITS, V] and the drafter
        features of every prompt position [P, F]."""
        logits, features = self.target(self._tensor(prompt), 0, self._target_cache,
                                       self.feature_layers, last_logits=PREFILL_LOGITS)
        return logits[0], (features[0] if features is not None else None)

    def verify(self, block: list[int] | torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, V] and drafter features [B, F] of `block` placed at start..start+B-1."""
        logits, features = self.target(self._tensor(block), start, self._target_cache, self.feature_layers)
        return logits[0], (features[0] if features is not None else None)

    def draft(self, context_features: torch.Tensor, block: list[int] | torch.Tensor, start: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy proposals [B-1] for block positions 1..B-1 (copied into `out` when given)."""
        drafts = self.drafter.draft(context_features[None], self._tensor(block), start, self._drafter_cache)[0]
        return out.copy_(drafts) if out is not None else drafts

    def rollback(self, length: int) -> None:
        """Forget target cache entries at positions >= length (rejected drafts)."""
        self._target_cache.rollback(length)

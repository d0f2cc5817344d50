"""The DFlash block-diffusion drafter.

One non-causal pass over a block [bonus, MASK x (B-1)] proposes B-1 tokens, conditioned on the
target's hidden states. The context (projected target features) enters every layer only as
extra keys/values, made with the layer's own k_proj/v_proj; it never passes through Q, o_proj or
the MLP, so its K/V can be cached. Embedding and lm_head are the target's (shared, frozen).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from trtspec.errors import MismatchError
from trtspec.models.checkpoint import (build_empty, checkpoint_dir, load_into, load_state_dict, read_json,
                                       save_checkpoint)
from trtspec.models.config import DFlashConfig, Qwen3Config
from trtspec.models.layers import DecoderLayer, Keys, KVCache, RMSNorm, RotaryEmbedding, key_parts
from trtspec.models.target import Qwen3Target


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(config.num_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding.of(config)
        self._shared: tuple[nn.Embedding, nn.Linear] | None = None  # a tuple: not registered as weights
        # The draft vocabulary (trtspec.models.draft_vocab): ids [K] and their head rows [K, H]; None: all ids.
        self.register_buffer("draft_ids", None, persistent=False)
        self.register_buffer("draft_head", None, persistent=False)

    def bind(self, target: Qwen3Target) -> "DFlashDrafter":
        """Share the target's embedding and lm_head (after checking the pair fits)."""
        check_pair(self.config, target.config)
        self._shared = (target.model.embed_tokens, target.lm_head)
        return self

    @property
    def lm_head(self) -> nn.Linear:
        """The target's output head, shared (not part of the drafter's weights)."""
        if self._shared is None:
            raise RuntimeError("drafter is not bound to a target; call bind(target) first")
        return self._shared[1]

    def use_draft_vocab(self, ids: torch.Tensor | None) -> "DFlashDrafter":
        """Propose only among `ids` (the K most frequent token ids; None: the whole vocabulary): the
        head keeps those K rows, and the argmax over them maps back to full-vocabulary ids."""
        if ids is None:
            self.draft_ids = self.draft_head = None
            return self
        head = self.lm_head
        if head.bias is not None:
            raise ValueError("a draft vocabulary needs an output head without a bias")
        self.draft_ids = ids.to(device=head.weight.device, dtype=torch.long)
        self.draft_head = head.weight.detach()[self.draft_ids].clone()
        return self

    @property
    def draft_vocab_size(self) -> int | None:
        return None if self.draft_ids is None else self.draft_ids.numel()

    def proposal_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., n, K] over the ids proposals come from (the draft vocabulary's K, or the whole
        vocabulary) from final hidden states [..., n, H]: greedy proposals take their argmax, a
        sampled request draws its proposals from them."""
        # Rows flattened first: a linear over a strided [R, n, H] slice multiplies through a transposed
        # copy of the whole head (10 ms a cycle for 8,192 rows in bfloat16, against 0.7 ms as one matmul).
        flat = hidden.reshape(-1, hidden.shape[-1])
        logits = self.lm_head(flat) if self.draft_ids is None else torch.nn.functional.linear(flat, self.draft_head)
        return logits.view(*hidden.shape[:-1], logits.shape[-1])

    def propose(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy proposals [..., n] (full-vocabulary ids) from final hidden states [..., n, H]."""
        return self.greedy_proposals(self.proposal_logits(hidden))

    def greedy_proposals(self, logits: torch.Tensor) -> torch.Tensor:
        """The argmax of proposal logits [..., K] as full-vocabulary ids."""
        best = logits.argmax(dim=-1)
        return best if self.draft_ids is None else self.draft_ids[best]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(c.num_hidden_layers, batch, c.num_key_value_heads, max_len, c.head_dim,
                       self.dtype, self.fc.weight.device)

    def forward(self, context_features: torch.Tensor, block_tokens: torch.Tensor, start: int,
                cache: KVCache) -> torch.Tensor:
        """Logits [b, B-1, V] for block positions 1..B-1 (inference, one block per row); see `hidden`."""
        return self.lm_head(self.hidden(context_features, block_tokens, start, cache))

    def draft(self, context_features: torch.Tensor, block_tokens: torch.Tensor, start: int,
              cache: KVCache) -> torch.Tensor:
        """Greedy proposals [b, B-1] for block positions 1..B-1, from the draft vocabulary if one is set."""
        return self.propose(self.hidden(context_features, block_tokens, start, cache))

    def hidden(self, context_features: torch.Tensor, block_tokens: torch.Tensor, start: int,
               cache: KVCache) -> torch.Tensor:
        """Final hidden states [b, B-1, H] of block positions 1..B-1 (inference, one block per row).

        context_features [b, n, F]: target features of positions start-n..start-1 that the
        drafter cache does not hold yet (n may be 0). block_tokens [b, B] sit at start..start+B-1.
        The cache grows to `start` positions; block K/V are never stored.
        """
        ctx_start = start - context_features.shape[1]
        if ctx_start != cache.length:
            raise ValueError(f"context starts at {ctx_start} but the drafter cache holds {cache.length}")
        cache.check_write(ctx_start, context_features.shape[1])
        device = block_tokens.device
        context = self.project_context(context_features)
        ctx_cos, ctx_sin = self.rotary(torch.arange(ctx_start, start, device=device), self.dtype)

        def cached_context(i: int, attn) -> tuple[torch.Tensor, torch.Tensor]:
            cache.write(i, ctx_start, *attn.project_kv(context, ctx_cos, ctx_sin))
            return cache.read(i, start)

        positions = torch.arange(start, start + block_tokens.shape[1], device=device)
        hidden = self.block_pass(block_tokens, positions, cached_context, mask=None)
        cache.length = start
        return hidden[:, 1:]

    def forward_packed(self, context_features: torch.Tensor, block_tokens: torch.Tensor,
                       block_positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Final hidden states [b, N, H] of many blocks packed in one sequence (training).

        context_features [b, L, F] are the target features of positions 0..L-1; block_tokens and
        block_positions are [b, N]; mask [b, N, L + N] says which context and block positions each
        block token may attend to (the caller builds the block-sparse pattern).
        """
        context = self.project_context(context_features)
        ctx_cos, ctx_sin = self.rotary(
            torch.arange(context.shape[1], device=context.device), self.dtype)
        return self.block_pass(block_tokens, block_positions,
                               lambda i, attn: attn.project_kv(context, ctx_cos, ctx_sin), mask[:, None])

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(features))

    def block_pass(self, block_tokens: torch.Tensor, positions: torch.Tensor,
                   context_kv: Callable[[int, nn.Module], tuple[Keys, Keys]],
                   mask: torch.Tensor | None) -> torch.Tensor:
        """The decoder stack over block tokens; context enters each layer only as keys/values."""
        if self._shared is None:
            raise RuntimeError("drafter is not bound to a target; call bind(target) first")
        h = self._shared[0](block_tokens)
        cos, sin = self.rotary(positions, self.dtype)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            ctx_k, ctx_v = context_kv(i, attn)
            x = layer.input_layernorm(h)
            q = attn.project_q(x, cos, sin)
            blk_k, blk_v = attn.project_kv(x, cos, sin)
            h = h + attn.attend(q, (*key_parts(ctx_k), blk_k), (*key_parts(ctx_v), blk_v), mask)
            h = layer.feed_forward(h)
        return self.norm(h)


def check_pair(drafter: DFlashConfig, target: Qwen3Config) -> None:
    """Refuse a drafter that was not made for this target, naming the mismatch."""
    if drafter.hidden_size != target.hidden_size:
        raise MismatchError(f"drafter hidden_size {drafter.hidden_size} != target hidden_size {target.hidden_size}")
    if drafter.vocab_size != target.vocab_size:
        raise MismatchError(f"drafter vocab_size {drafter.vocab_size} != target vocab_size {target.vocab_size}")
    if drafter.num_target_layers != target.num_hidden_layers:
        raise MismatchError(f"drafter was made for a {drafter.num_target_layers}-layer target; "
                            f"this target has {target.num_hidden_layers} layers")
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise MismatchError(f"drafter target_layer_ids {bad} are out of range for a "
                            f"{target.num_hidden_layers}-layer target")
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        raise MismatchError(f"drafter mask_token_id {drafter.mask_token_id} is outside the target "
                            f"vocabulary (size {target.vocab_size})")


def load_drafter(path: str | Path, target: Qwen3Target) -> DFlashDrafter:
    """Load a z-lab layout drafter directory and bind it to `target` (same dtype and device)."""
    directory = checkpoint_dir(path, "drafter")
    config_file = directory / "config.json"
    config = DFlashConfig.from_zlab(read_json(config_file, "drafter"), str(config_file))
    try:
        check_pair(config, target.config)
    except MismatchError as exc:
        raise MismatchError(f"{config_file}: {exc}") from None
    tensors = load_state_dict(directory, "drafter")
    drafter = build_empty(lambda: DFlashDrafter(config))
    load_into(drafter, tensors, "drafter")
    return drafter.to(device=target.device, dtype=target.dtype).eval().bind(target)


def save_drafter(drafter: DFlashDrafter, path: str | Path) -> Path:
    """Write the z-lab layout (no embedding or lm_head: those belong to the target)."""
    return save_checkpoint(path, drafter.config.to_zlab(), drafter.state_dict())

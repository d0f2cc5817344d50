"""The decode loop's step functions as pure tensor-in, tensor-out modules, ready for torch.export.

They reuse the models' own layers (`Qwen3Target.decode`, `DFlashDrafter.block_pass`); only the
cache handling differs from eager mode: the cached keys/values come in as `past_*` inputs and
the new positions' keys/values go out as `new_*` outputs (layouts in `bindings`).
"""

from __future__ import annotations

import torch
from torch import nn

from trtspec.models import DFlashDrafter, Qwen3Target


def _attend_past(past_k: torch.Tensor, past_v: torch.Tensor, new_k: list, new_v: list):
    """A KV hook that prepends layer i's cached keys/values and collects the new ones."""
    def hook(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new_k.append(k)
        new_v.append(v)
        # past [P, layers, kv_heads, D] -> layer i as [1, kv_heads, P, D]
        k_past = past_k[:, i].transpose(0, 1)[None].to(k.dtype)
        v_past = past_v[:, i].transpose(0, 1)[None].to(v.dtype)
        return torch.cat((k_past, k), dim=2), torch.cat((v_past, v), dim=2)
    return hook


def _position_major(per_layer: list[torch.Tensor]) -> torch.Tensor:
    """Layers' [1, kv_heads, T, D] -> [T, layers, kv_heads, D] (the cache layout)."""
    return torch.stack(per_layer, dim=0)[:, 0].permute(2, 0, 1, 3).contiguous()


def _valid_past(past: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """Which cache slots hold real positions: those before `end` (the rest of a fixed buffer is stale)."""
    return torch.arange(past.shape[0], device=past.device) < end


class TargetStep(nn.Module):
    """target(tokens, start, past_k, past_v) -> logits, features, new_k, new_v."""

    def __init__(self, target: Qwen3Target, feature_layers: tuple[int, ...]):
        super().__init__()
        self.target, self.feature_layers = target, tuple(feature_layers)

    def forward(self, tokens, start, past_k, past_v):
        positions = start + torch.arange(tokens.shape[0], device=tokens.device)
        key_positions = torch.cat((torch.arange(past_k.shape[0], device=tokens.device), positions))
        key_valid = torch.cat((_valid_past(past_k, start), torch.ones_like(positions, dtype=torch.bool)))
        mask = (key_positions[None, :] <= positions[:, None]) & key_valid[None, :]
        new_k, new_v = [], []
        hidden, features = self.target.decode(tokens[None], positions, _attend_past(past_k, past_v, new_k, new_v),
                                              mask, self.feature_layers)
        logits = self.target.logits(hidden)[0].float()
        return logits, features[0], _position_major(new_k), _position_major(new_v)


class DraftStep(nn.Module):
    """draft(context, block, start, past_k, past_v) -> drafts, new_k, new_v.

    `context` holds the target features of positions start-n..start-1 (those the drafter cache
    lacks); `block` = [bonus, MASK x (B-1)] sits at start..start+B-1. Proposals are greedy
    (argmax), as the decode loop uses at every temperature.
    """

    def __init__(self, drafter: DFlashDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, context, block, start, past_k, past_v):
        device = block.device
        context_start = start - context.shape[0]
        context_positions = context_start + torch.arange(context.shape[0], device=device)
        projected = self.drafter.project_context(context[None])
        cos, sin = self.drafter.rotary(context_positions, self.drafter.dtype)
        new_k, new_v = [], []
        extend = _attend_past(past_k, past_v, new_k, new_v)

        def context_kv(i: int, attn) -> tuple[torch.Tensor, torch.Tensor]:
            return extend(i, *attn.project_kv(projected, cos, sin))

        # Non-causal: every block position sees every valid context slot and the whole block.
        valid = torch.cat((_valid_past(past_k, context_start),
                           torch.ones(context.shape[0] + block.shape[0], dtype=torch.bool, device=device)))
        positions = start + torch.arange(block.shape[0], device=device)
        hidden = self.drafter.block_pass(block[None], positions, context_kv, valid[None, :])
        drafts = self.drafter.lm_head(hidden[0, 1:]).argmax(dim=-1)
        return drafts, _position_major(new_k), _position_major(new_v)

"""The decode loop's step functions as pure tensor-in, tensor-out modules, ready for torch.export.

They reuse the models' own layers (`Qwen3Target.decode`, `DFlashDrafter.block_pass`); only the
cache handling differs from eager mode: the cached keys/values come in as `past_*` inputs and
the new positions' keys/values go out as `new_*` outputs (layouts in `bindings`).
"""

from __future__ import annotations

import torch
from torch import nn

from trtspec.models import DFlashDrafter, Qwen3Target
from trtspec.models.layers import Keys
from trtspec.models.target import Packing


def _layer_past(past: torch.Tensor, slots: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer `layer` of each row's cache slot: past [P, slots, layers, kv, D] -> [b, kv, P, D].

    One gather of head_dim-long rows straight into attention's layout, by the flat index of each
    (row, kv head, position): ONNX Runtime copies on every gather, transpose and split, and the
    cache is most of what a decode step reads (gathering (slot, layer) pairs, then transposing them
    to [b, kv, P, D], would copy it twice; what that cost: docs/benchmarks.md)."""
    positions, slot_count, layers, kv_heads, head_dim = past.shape
    position = torch.arange(positions, device=past.device)[None, None, :]
    head = torch.arange(kv_heads, device=past.device)[None, :, None]
    flat = ((position * slot_count + slots[:, None, None]) * layers + layer) * kv_heads + head  # [b, kv, P]
    return past.reshape(-1, head_dim).index_select(0, flat.flatten()).view(*flat.shape, head_dim)


def _attend_past(past_k: torch.Tensor, past_v: torch.Tensor, slots: torch.Tensor, new_k: list, new_v: list):
    """A KV hook that puts layer i's cached keys/values (rows' `slots` of past [P, slots, layers,
    kv, D]) before the new ones, as parts (attention reads them where they lie), and collects the
    new ones."""
    def hook(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[Keys, Keys]:
        new_k.append(k)
        new_v.append(v)
        return (_layer_past(past_k, slots, i).to(k.dtype), k), (_layer_past(past_v, slots, i).to(v.dtype), v)
    return hook


def _position_major(per_layer: list[torch.Tensor]) -> torch.Tensor:
    """Layers' [b, kv_heads, T, D] -> [b, T, layers, kv_heads, D] (rows of the cache layout)."""
    return torch.stack(per_layer, dim=1).permute(0, 3, 1, 2, 4).contiguous()


def _below(past: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """[b, P]: which cache positions hold real entries for each row (those before its end)."""
    return torch.arange(past.shape[0], device=past.device)[None, :] < ends[:, None]


class TargetStep(nn.Module):
    """target(tokens, starts, slots, past_k, past_v, computed, scored) -> logits, features, new_k, new_v.

    `computed` [N]: the real positions among batch x tokens (flat), where rows of shorter blocks are
    padded to the call's width: every projection and feed-forward runs on those N alone
    (`DecoderTarget.decode`); features at the padding are zeros. `scored` [S]: which of them (indices
    into `computed`; without it, into batch x tokens) get logits, [S, vocab] in that order."""

    def __init__(self, target: Qwen3Target, feature_layers: tuple[int, ...]):
        super().__init__()
        self.target, self.feature_layers = target, tuple(feature_layers)

    def forward(self, tokens, starts, slots, past_k, past_v, computed=None, scored=None):
        batch, count = tokens.shape
        offsets = torch.arange(count, device=tokens.device)
        positions = starts[:, None] + offsets[None, :]                                   # [b, T]
        causal = (offsets[None, :] <= offsets[:, None])[None].expand(batch, count, count)
        mask = torch.cat((_below(past_k, starts)[:, None, :].expand(batch, count, past_k.shape[0]), causal), dim=2)
        new_k, new_v = [], []
        hook = _attend_past(past_k, past_v, slots, new_k, new_v)
        hidden, features = self.target.decode(tokens, positions, hook, mask[:, None], self.feature_layers, computed)
        if features is None:  # a target without a drafter: no features, an empty axis keeps the outputs fixed
            features = hidden.new_zeros(*hidden.shape[:2], 0)
        if computed is not None:  # packed [1, N, F]: back to the call's [b, T] rows
            features = Packing(tokens.shape, computed).unpack(features)
        # logits in the model's dtype: an upcast would write [S, vocab] float32 every verify (622 MB
        # at batch 64, B = 16 and Qwen3's vocabulary) for argmax, which bfloat16 gives exactly; the
        # sampler and BlockPilot's features upcast the rows they read
        rows = hidden.reshape(-1, hidden.shape[-1])
        if scored is not None:
            rows = rows.index_select(0, scored)
        logits = self.target.logits(rows[None])[0]  # 3-D: a MatMul, as in decode
        return logits, features, _position_major(new_k), _position_major(new_v)


class DraftStep(nn.Module):
    """draft(context, counts, block, starts, slots, past_k, past_v) -> drafts, proposal_logits, new_k, new_v.

    Row r's context holds, in its last counts[r] entries, the target features of positions
    starts[r]-counts[r]..starts[r]-1 (those the drafter cache lacks); its block [bonus, MASK x
    (B-1)] sits at starts[r]..starts[r]+B-1. `drafts` are the greedy proposals (argmax) that greedy
    requests verify; `proposal_logits` [b, B-1, K] are what a sampled request draws its proposals
    from. With a draft vocabulary, only its K logits are computed and the argmax is mapped back to
    full-vocabulary ids inside the graph (DFlashDrafter.propose).
    """

    def __init__(self, drafter: DFlashDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, context, counts, block, starts, slots, past_k, past_v):
        device = block.device
        batch, width = context.shape[:2]
        offsets = torch.arange(width, device=device)
        context_positions = starts[:, None] - width + offsets[None, :]                  # left-padded
        context_valid = offsets[None, :] >= (width - counts)[:, None]
        projected = self.drafter.project_context(context)
        cos, sin = self.drafter.rotary(context_positions, self.drafter.dtype)
        new_k, new_v = [], []
        extend = _attend_past(past_k, past_v, slots, new_k, new_v)

        def context_kv(i: int, attn) -> tuple[torch.Tensor, torch.Tensor]:
            return extend(i, *attn.project_kv(projected, cos, sin))

        # Non-causal: every block position sees its row's cached context, its new context and the whole block.
        valid = torch.cat((_below(past_k, starts - counts), context_valid,
                           torch.ones(batch, block.shape[1], dtype=torch.bool, device=device)), dim=1)
        positions = starts[:, None] + torch.arange(block.shape[1], device=device)[None, :]
        hidden = self.drafter.block_pass(block, positions, context_kv, valid[:, None, None, :])
        logits = self.drafter.proposal_logits(hidden[:, 1:])
        return self.drafter.greedy_proposals(logits), logits, _position_major(new_k), _position_major(new_v)

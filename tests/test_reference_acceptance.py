"""Acceptance, cycle by cycle, against an independent DFlash decode loop built on transformers.

Output tokens cannot show a drafter bug (speculative output is lossless whatever the drafter
proposes); the acceptance histogram can. The reference below is written from DESIGN.md §3 alone:
the target is transformers' own Qwen3ForCausalLM, run without a cache; its context features are
`output_hidden_states[id + 1]` (so the last layer's entry is the final norm's output, as in
z-lab's reference); the drafter is a few lines of plain tensor algebra over its state dict,
recomputing every context key/value each cycle. The drafter taps the target's last layer.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config as HFConfig, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from helpers import generate, predictable_pair, single
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.schedule import BlockChoice

MAX_NEW_TOKENS = 48


def _hf_target(target) -> Qwen3ForCausalLM:
    """transformers' Qwen3 carrying the same weights as a trtspec target."""
    c = target.config
    config = HFConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
                      rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
                      tie_word_embeddings=False)
    hf = Qwen3ForCausalLM(config).eval()
    weights = {k: v for k, v in target.state_dict().items() if k in hf.state_dict()}
    hf.load_state_dict(weights, strict=True)
    return hf


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class ReferenceDrafter:
    """DESIGN.md §3's drafter: fc + hidden_norm on the context; in every layer the context's K/V
    come from the layer's k_proj/v_proj (k_norm on K, no input norm), queries from the block only,
    non-causal attention over context + block, RoPE at absolute positions."""

    def __init__(self, drafter, hf: Qwen3ForCausalLM):
        self.w = {k: v.detach() for k, v in drafter.state_dict().items()}
        self.c = drafter.config
        self.layer_ids = drafter.config.target_layer_ids
        self.embed, self.head = hf.model.embed_tokens.weight, hf.lm_head.weight
        self.rotary = Qwen3RotaryEmbedding(hf.config)

    def _heads(self, x: torch.Tensor, count: int) -> torch.Tensor:  # [T, count*d] -> [1, count, T, d]
        return x.view(x.shape[0], count, self.c.head_dim).transpose(0, 1)[None]

    def propose(self, context: torch.Tensor, block: list[int], start: int) -> list[int]:
        """Greedy proposals for block positions 1..B-1; `context` [start, F] holds positions 0..start-1."""
        c, w, eps = self.c, self.w, self.c.rms_norm_eps
        ctx = _rms(context @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        x = self.embed[torch.tensor(block)]
        positions = torch.arange(start + len(block))[None]
        cos, sin = self.rotary(x[None], positions)
        ctx_rope, blk_rope = (cos[:, :start], sin[:, :start]), (cos[:, start:], sin[:, start:])
        group = c.num_attention_heads // c.num_key_value_heads
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            h = _rms(x, w[p + "input_layernorm.weight"], eps)
            q = _rms(self._heads(h @ w[p + "self_attn.q_proj.weight"].T, c.num_attention_heads),
                     w[p + "self_attn.q_norm.weight"], eps)
            keys, values = [], []
            for source, (cos_, sin_) in ((ctx, ctx_rope), (h, blk_rope)):
                k = _rms(self._heads(source @ w[p + "self_attn.k_proj.weight"].T, c.num_key_value_heads),
                         w[p + "self_attn.k_norm.weight"], eps)
                _, k = apply_rotary_pos_emb(k, k, cos_, sin_)
                keys.append(k)
                values.append(self._heads(source @ w[p + "self_attn.v_proj.weight"].T, c.num_key_value_heads))
            q, _ = apply_rotary_pos_emb(q, q, *blk_rope)
            k = torch.cat(keys, dim=2).repeat_interleave(group, dim=1)
            v = torch.cat(values, dim=2).repeat_interleave(group, dim=1)
            attended = F.scaled_dot_product_attention(q, k, v)  # no mask: non-causal
            x = x + attended[0].transpose(0, 1).reshape(len(block), -1) @ w[p + "self_attn.o_proj.weight"].T
            h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
            gated = F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
            x = x + gated @ w[p + "mlp.down_proj.weight"].T
        logits = _rms(x, w["norm.weight"], eps) @ self.head.T
        return logits[1:].argmax(-1).tolist()


def _target_pass(hf: Qwen3ForCausalLM, tokens: list[int], layer_ids) -> tuple[torch.Tensor, torch.Tensor]:
    out = hf(torch.tensor([tokens]), output_hidden_states=True)
    features = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
    return out.logits[0], features


def reference_histogram(hf, drafter: ReferenceDrafter, prompt: list[int], block_size: int) -> list[int]:
    """Greedy DFlash decoding as DESIGN.md §3 states it; accepted drafts counted per cycle."""
    logits, _ = _target_pass(hf, prompt, drafter.layer_ids)
    sequence = prompt + [int(logits[-1].argmax())]  # the first bonus token
    histogram = [0] * block_size
    mask = drafter.c.mask_token_id
    while len(sequence) - len(prompt) < MAX_NEW_TOKENS:
        start = len(sequence) - 1  # the bonus token's position
        _, features = _target_pass(hf, sequence[:start], drafter.layer_ids)
        drafts = drafter.propose(features, [sequence[-1]] + [mask] * (block_size - 1), start)
        logits, _ = _target_pass(hf, sequence + drafts, drafter.layer_ids)
        posterior = logits[start:].argmax(-1).tolist()
        accepted = 0
        while accepted < block_size - 1 and drafts[accepted] == posterior[accepted]:
            accepted += 1
        histogram[accepted] += 1
        sequence += drafts[:accepted] + [posterior[accepted]]
    return histogram


def _context_sensitive_pair():
    """A pair whose cycles accept nothing, part of the block, or all of it, and whose proposals
    depend on the context features: the drafter's attention output (where the context enters) is
    strengthened, so a feature taken from the wrong place changes which drafts are accepted."""
    target, drafter = predictable_pair(seed=2, layers=3, beta=1.5)
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.mul_(20.0)
    return target, drafter


@pytest.mark.parametrize("block_size", [4, 8])
def test_acceptance_histogram_matches_independent_reference(block_size):
    target, drafter = _context_sensitive_pair()
    assert drafter.config.target_layer_ids[-1] == target.config.num_hidden_layers - 1  # taps the last layer
    hf = _hf_target(target)
    reference = ReferenceDrafter(drafter, hf)
    engine = single(target, drafter, prompt_lookup=0)  # the drafter's acceptance alone
    gen = torch.Generator().manual_seed(block_size)
    totals = [0] * block_size
    with torch.no_grad():
        for _ in range(6):
            prompt = torch.randint(2, target.config.vocab_size, (12,), generator=gen).tolist()
            ours = generate(engine, prompt, GenerationConfig(block=BlockChoice(block_size), max_new_tokens=MAX_NEW_TOKENS))
            theirs = reference_histogram(hf, reference, prompt, block_size)
            assert ours.stats.histogram == theirs, prompt
            totals = [a + b for a, b in zip(totals, theirs)]
    # the comparison has power: cycles accept nothing, part of the block, and all of it
    assert totals[0] > 0 and sum(totals[1:-1]) > 0 and totals[-1] > 0, totals

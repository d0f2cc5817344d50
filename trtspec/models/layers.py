"""The building blocks shared by the targets and the DFlash drafter.

All are stacks of Qwen3-style decoder layers; they differ only in where keys and values come from
(so attention is split into `project_q`, `project_kv` and `attend`, and each model composes them)
and in what their config asks of a layer: q/k norm or not (Llama has none), RoPE frequency
scaling (Llama 3's `llama3`), a dense or an expert-routed MLP (Qwen3-MoE's sparse layers).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trtspec.models.config import Qwen3Config


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference so bf16/fp16 checkpoints behave the same.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def llama3_frequencies(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                       original_max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1's RoPE scaling: long wavelengths slowed by `factor`, short ones kept, the band
    between interpolated (the same float32 arithmetic as transformers')."""
    old_context = original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context / low_freq_factor, old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """RoPE (rotate-half layout) at absolute positions, optionally with Llama 3 frequency scaling."""

    def __init__(self, head_dim: int, theta: float, llama3_scaling: dict | None = None):
        super().__init__()
        # Computed per call rather than kept as a buffer: no state to move, save or re-create.
        self.head_dim, self.theta = head_dim, theta
        self.scaling = {k: v for k, v in (llama3_scaling or {}).items() if k != "rope_type"} or None

    @classmethod
    def of(cls, config: Qwen3Config) -> "RotaryEmbedding":
        return cls(config.head_dim, config.rope_theta, config.rope_scaling_parameters)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, head_dim] for positions [T], or [b, 1, T, head_dim] for positions [b, T]."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device)
        inv_freq = 1.0 / (self.theta ** (exponents / self.head_dim))
        if self.scaling is not None:
            inv_freq = llama3_frequencies(inv_freq, **self.scaling)
        freqs = positions.float()[..., None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        if positions.dim() == 2:  # per-row positions: broadcast over heads
            angles = angles[:, None]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, T, head_dim]; cos/sin: [T, head_dim] or [b, 1, T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# Keys (or values) [b, kv_heads, T, head_dim], whole or as parts to be read as one along T (e.g. a
# step graph's cached positions and its new ones, which need not be copied into one tensor).
Keys = torch.Tensor | tuple[torch.Tensor, ...]


def key_parts(keys: Keys) -> tuple[torch.Tensor, ...]:
    return keys if isinstance(keys, tuple) else (keys,)


class Attention(nn.Module):
    """Grouped-query attention, with per-head q/k RMSNorm where the family has it (Qwen3)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def _heads(self, x: torch.Tensor, count: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, count, self.head_dim).transpose(1, 2)

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values, [b, kv_heads, T, head_dim]."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def attend(self, q: torch.Tensor, k: Keys, v: Keys, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention output after o_proj, [b, Tq, hidden] (see `attention`)."""
        return self.o_proj(self.attention(q, k, v, mask))

    def attention(self, q: torch.Tensor, k: Keys, v: Keys, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention output before o_proj, heads joined: [b, Tq, heads * head_dim]. Keys and values
        come whole or in parts along the key axis (`Keys`); `mask` is boolean (True = may attend),
        [Tq, Tk] or [b, 1, Tq or 1, Tk] over all of them, or None."""
        b, _, t, _ = q.shape
        groups = self.num_heads // self.num_kv_heads
        k_parts, v_parts = key_parts(k), key_parts(v)
        if not torch.compiler.is_exporting():  # eager: the fused kernel, which never holds [Tq, Tk] scores
            k, v = (torch.cat(parts, dim=2) if len(parts) > 1 else parts[0] for parts in (k_parts, v_parts))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)
        else:
            # Exported step graphs: the queries that share a key/value head score it as one matrix
            # ([b, kv, groups x T, D] against [b, kv, P, D]), not against keys repeated per head, which
            # copies the whole cache once more per layer (SDPA's enable_gqa exports to an Expand; ONNX
            # Runtime copies at each), nor through a broadcast group axis, a product per head of a few
            # rows each (ONNX Runtime, 8 rows of 4 queries over 300 keys: 239 -> 163 us a layer). The
            # weights meet the values through the group axis ([b, kv, groups, T, P] against [b, kv, 1,
            # P, D]), whose slices export with shapes torch.export can check. Each part is attended
            # where it lies and only the scores are joined: joining the cached keys/values to the new
            # ones would copy the cache once more per layer, and the cache is most of what a batched
            # step reads.
            q = q.contiguous().view(b, self.num_kv_heads, groups * t, self.head_dim)  # (heads were a transposed axis)
            scores = torch.cat([torch.matmul(q, part.transpose(-1, -2)) for part in k_parts], dim=-1)
            scores = scores.view(b, self.num_kv_heads, groups, t, scores.shape[-1]) * self.head_dim ** -0.5
            if mask is not None:  # [Tq, Tk] or [b, 1, Tq or 1, Tk]: broadcast over kv heads and groups
                scores = scores.masked_fill(~mask.reshape(-1, 1, 1, *mask.shape[-2:]), float("-inf"))
            weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            if len(v_parts) == 1:
                out = torch.matmul(weights, v_parts[0].unsqueeze(2))
            else:  # each part weighted by its own columns of the joint softmax
                out, start = None, 0
                for part in v_parts:
                    end = start + part.shape[2]
                    term = torch.matmul(weights[..., start:end], part.unsqueeze(2))
                    out, start = term if out is None else out + term, end
        return out.reshape(b, self.num_heads, t, self.head_dim).transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Qwen3-MoE's routed MLP: softmax over `gate` logits, each token's top-k experts weighted by
    their (optionally renormalised) probabilities.

    Computed densely: every expert runs on every token and the experts a token did not pick get
    weight 0 (a scatter of the top-k gates). That is ordinary tensor ops with no data-dependent
    control flow, so it exports to ONNX / torch.export as is and gives the routed result exactly;
    it costs num_experts / top_k times the routed FLOPs, which is nothing for the tiny test models
    and a known non-goal for real MoE checkpoints (a grouped-GEMM kernel would replace the loop).
    Weight names follow the Hub layout (`gate`, `experts.<e>.{gate,up,down}_proj`).
    """

    def __init__(self, config):
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))

    def routing(self, x: torch.Tensor) -> torch.Tensor:
        """[..., num_experts] weights: the top-k probabilities in their experts' columns, 0 elsewhere."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        top, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return torch.zeros_like(probs).scatter(-1, chosen, top).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.routing(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + weights[..., e:e + 1] * expert(x)
        return out


class DecoderLayer(nn.Module):
    """Holds the weights of one decoder layer (`index` in its stack); the models decide how its
    attention is fed."""

    def __init__(self, config: Qwen3Config, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoE(config) if config.is_sparse(index) else MLP(config.hidden_size, config.intermediate_size)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.post_attention_layernorm(h))


class KVCache:
    """Preallocated keys/values for every layer: [layers, batch, kv_heads, max_len, head_dim].

    Writes happen at an explicit position; `length` is how many leading positions are valid and
    rolling back is just lowering it (later writes overwrite the stale tail).
    """

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def check_write(self, start: int, count: int) -> None:
        if start > self.length:
            raise ValueError(f"KV cache write at {start} would leave a gap after length {self.length}")
        if start + count > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; cannot write {start}..{start + count - 1}")

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = start + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll KV cache of length {self.length} back to {length}")
        self.length = length

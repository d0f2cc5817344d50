"""The target: a plain PyTorch decoder with a static KV cache, for every supported family.

Qwen3, Llama 3.x and Qwen3-MoE checkpoints are the same decoder stack read from the same Hugging
Face layout; what differs (q/k norm, RoPE scaling, routed experts) is decided by the family's
config (`config.TARGET_FAMILIES`) inside the shared layers, so this one class, its step-graph
interface (`decode`, `logits`) and everything that takes a target serve them all.

One `forward` serves prefill (many tokens from position 0), verify (B tokens at `start`) and the
autoregressive step (one token). It also returns the hidden states that DFlash drafters read:
for each requested layer i, exactly transformers' `output_hidden_states[i + 1]` — the raw output of
decoder layer i, except for the last layer, where transformers (and z-lab's reference drafters)
hold the output of the final RMSNorm. `decode` is the one place that convention lives; every
backend, the training loop, labels and preflight take their features from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from trtspec.models.checkpoint import build_empty, checkpoint_dir, load_into, load_state_dict, read_json
from trtspec.models.config import Qwen3Config, target_config_from_dict
from trtspec.models.layers import DecoderLayer, Keys, KVCache, RMSNorm, RotaryEmbedding

# (layer index, new keys, new values) -> the keys and values those tokens attend to (whole or in parts)
KVHook = Callable[[int, torch.Tensor, torch.Tensor], tuple[Keys, Keys]]


class Backbone(nn.Module):
    """`model.*` in the HF checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Packing:
    """The real positions `computed` [N] (flat indices) of a padded [b, T] call, packed into one
    [1, N] row and back. 3-D on purpose: a Linear on [N, H] would export as Gemm, which the 4-bit
    quantizer skips."""

    def __init__(self, shape: torch.Size, computed: torch.Tensor):
        self.batch, self.count = shape[0], shape[1]
        self.computed = computed

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[b, T, ...] -> [1, N, ...]."""
        return x.reshape(self.batch * self.count, *x.shape[2:]).index_select(0, self.computed)[None]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[1, N, ...] -> [b, T, ...], zeros at the padding."""
        flat = x.new_zeros(self.batch * self.count, *x.shape[2:]).index_copy(0, self.computed, x[0])
        return flat.view(self.batch, self.count, *x.shape[2:])

    def unpack_heads(self, x: torch.Tensor) -> torch.Tensor:
        """Attention's [1, heads, N, D] -> [b, heads, T, D]."""
        return self.unpack(x.transpose(1, 2)).transpose(1, 2)


class DecoderTarget(nn.Module):
    """A target of any supported family (its `config` is a `Qwen3Config` or a subclass)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding.of(config)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(c.num_hidden_layers, batch, c.num_key_value_heads, max_len, c.head_dim,
                       self.dtype, self.device)

    def forward(self, tokens: torch.Tensor, start: int, cache: KVCache | None,
                feature_layers: tuple[int, ...] = (), last_logits: int | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `tokens` [b, T] at positions start..start+T-1, causally over the cache.

        Returns logits [b, T, V] (or only the last `last_logits` positions') and the requested
        layers' features (HF `hidden_states[i + 1]`) concatenated on the feature axis, [b, T, len(feature_layers) * hidden] (None when none requested).
        Afterwards the cache holds start+T valid positions. Without a cache (training) the
        tokens attend causally among themselves and start must be 0.
        """
        count = tokens.shape[1]
        if cache is None and start != 0:
            raise ValueError("without a KV cache the tokens must start at position 0")
        if cache is not None:
            cache.check_write(start, count)
        end = start + count
        positions = torch.arange(start, end, device=tokens.device)
        causal = None
        if count > 1:
            causal = torch.arange(end, device=tokens.device)[None, :] <= positions[:, None]

        def cached(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if cache is None:
                return k, v
            cache.write(i, start, k, v)
            return cache.read(i, end)

        h, features = self.decode(tokens, positions, cached, causal, feature_layers)
        if cache is not None:
            cache.length = end
        if last_logits is not None:
            h = h[:, -last_logits:]
        return self.logits(h), features

    def features(self, tokens: torch.Tensor, feature_layers: tuple[int, ...]) -> torch.Tensor:
        """The tapped layers' features of `tokens` [b, T] from position 0 without a cache, as
        forward() gives them, but with neither the layers above the deepest tap nor the LM head run:
        training wants only the features, and on a small model the head is a fifth of the arithmetic."""
        return self._from_start(tokens, feature_layers, depth=max(feature_layers) + 1)[1]

    def features_and_logits(self, tokens: torch.Tensor,
                            feature_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """`features` and the logits [b, T, V] of the same pass (the whole stack and the LM head):
        distillation's soft labels, the target's own next-token distributions."""
        hidden, features = self._from_start(tokens, feature_layers)
        return features, self.logits(hidden)

    def _from_start(self, tokens: torch.Tensor, feature_layers: tuple[int, ...],
                    depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        count = tokens.shape[1]
        positions = torch.arange(count, device=tokens.device)
        causal = positions[None, :] <= positions[:, None] if count > 1 else None
        return self.decode(tokens, positions, lambda i, k, v: (k, v), causal, feature_layers, depth=depth)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, attend_kv: KVHook, mask: torch.Tensor | None,
               feature_layers: tuple[int, ...] = (), computed: torch.Tensor | None = None, depth: int | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder stack: final hidden states [b, T, H] (before the final norm) and the
        tapped layers' features (HF `hidden_states[i + 1]`, see the module docstring).

        `attend_kv(layer, k, v)` turns the new tokens' keys/values into the keys/values they attend
        to (a KV cache in eager mode, graph inputs and outputs in an exported step); `mask` is
        boolean [T, keys] (True = may attend) or None for "everything". `computed` [N] (flat
        indices into b x T): the real positions, where the rest are padding after each row's real
        ones (a short block in a wider call). Then every projection and feed-forward runs on those
        N alone, packed, and only attention sees the [b, T] layout (padding there has zero
        queries, keys and values; the mask keeps real positions off it); the hidden states and
        features come back packed, [1, N, ...] in `computed`'s order. `depth`: run only the first
        `depth` layers (the hidden states returned are then not the stack's last).
        """
        packing = Packing(tokens.shape, computed) if computed is not None else None
        if packing is not None:
            tokens, positions = packing.pack(tokens), packing.pack(positions)
        cos, sin = self.rotary(positions, self.dtype)
        wanted = set(feature_layers)
        last = len(self.model.layers) - 1
        taps: dict[int, torch.Tensor] = {}
        h = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers[:depth]):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, (k, v) = attn.project_q(x, cos, sin), attn.project_kv(x, cos, sin)
            if packing is not None:
                q, k, v = packing.unpack_heads(q), packing.unpack_heads(k), packing.unpack_heads(v)
            out = attn.attention(q, *attend_kv(i, k, v), mask)
            h = layer.feed_forward(h + attn.o_proj(out if packing is None else packing.pack(out)))
            if i in wanted:  # HF's hidden_states[i + 1]: the last entry is already normalised
                taps[i] = self.model.norm(h) if i == last else h
        features = torch.cat([taps[i] for i in feature_layers], dim=-1) if feature_layers else None
        return h, features

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))


Qwen3Target = DecoderTarget  # the name it had when Qwen3 was the only family; callers still use it


def load_target_config(path: str | Path) -> Qwen3Config:
    """A target directory's config (its `model_type` picks the family), without reading its weights."""
    config_file = checkpoint_dir(path, "target") / "config.json"
    return target_config_from_dict(read_json(config_file, "target"), str(config_file))


def load_target(path: str | Path, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> DecoderTarget:
    """Load a local Hugging Face Qwen3, Llama 3.x or Qwen3-MoE directory (single-file or sharded
    safetensors); its `model_type` picks the family."""
    directory = checkpoint_dir(path, "target")
    config = load_target_config(directory)
    tensors = load_state_dict(directory, "target")
    if config.tie_word_embeddings and "model.embed_tokens.weight" in tensors:
        tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
    target = build_empty(lambda: DecoderTarget(config))
    if config.tie_word_embeddings:  # materialising from meta unties shared weights; tie them again
        target.lm_head.weight = target.model.embed_tokens.weight
    load_into(target, tensors, "target", ignore_suffixes=("rotary_emb.inv_freq",))
    return target.to(device=device, dtype=dtype).eval()

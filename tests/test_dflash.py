"""The DFlash drafter: semantics against a from-scratch reference, the z-lab layout, refusals."""

import json

import pytest
import torch
import torch.nn.functional as F

from helpers import random_drafter, save_random_drafter
from trtspec.errors import CheckpointError, MismatchError
from trtspec.models import default_target_layer_ids, load_drafter, load_target, save_drafter


def _rms(x, weight, eps=1e-6):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, positions, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = positions.float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_block_logits(drafter, target, features, block, start):
    """DESIGN.md section 3 written out directly: no cache, explicit GQA, explicit softmax."""
    c = drafter.config
    ctx_pos, blk_pos = torch.arange(0, start), torch.arange(start, start + len(block))
    ctx = _rms(features @ drafter.fc.weight.T, drafter.hidden_norm.weight)
    h = target.model.embed_tokens.weight[block]
    for layer in drafter.layers:
        a = layer.self_attn
        x = _rms(h, layer.input_layernorm.weight)

        def heads(t, n):
            return t.view(t.shape[0], n, c.head_dim).transpose(0, 1)

        q = _rope(_rms(heads(x @ a.q_proj.weight.T, c.num_attention_heads), a.q_norm.weight), blk_pos, c.rope_theta)
        both = torch.cat([ctx, x])  # context K/V first, then the block's own
        k = _rope(_rms(heads(both @ a.k_proj.weight.T, c.num_key_value_heads), a.k_norm.weight),
                  torch.cat([ctx_pos, blk_pos]), c.rope_theta)
        v = heads(both @ a.v_proj.weight.T, c.num_key_value_heads)
        group = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        weights = torch.softmax(q @ k.transpose(1, 2) / c.head_dim ** 0.5, dim=-1)  # non-causal
        out = (weights @ v).transpose(0, 1).reshape(len(block), -1)
        h = h + out @ a.o_proj.weight.T
        m = layer.mlp
        y = _rms(h, layer.post_attention_layernorm.weight)
        h = h + (F.silu(y @ m.gate_proj.weight.T) * (y @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return _rms(h, drafter.norm.weight)[1:] @ target.lm_head.weight.T


def test_drafter_matches_reference_with_incremental_context_cache(target_dir):
    target = load_target(target_dir)
    drafter = random_drafter(target, layers=2, layer_ids=(0, 1), mask_token_id=1)
    tokens = torch.randint(0, 300, (1, 30), generator=torch.Generator().manual_seed(0))
    mask = drafter.config.mask_token_id
    with torch.no_grad():
        _, features = target(tokens, 0, target.new_cache(1, 64), feature_layers=(0, 1))
        cache = drafter.new_cache(1, 64)
        for start, bonus in ((20, 17), (30, 5)):  # the second call adds 10 new context positions
            block = torch.tensor([[bonus] + [mask] * 7])
            new = features[:, cache.length:start]
            ours = drafter(new, block, start, cache)[0]
            expected = reference_block_logits(drafter, target, features[0, :start], block[0], start)
            assert (ours - expected).abs().max() < 1e-4
            assert cache.length == start  # only context is cached, never the block


def test_zlab_layout_round_trip(target_dir, tmp_path):
    target = load_target(target_dir)
    drafter = random_drafter(target, layers=2, layer_ids=(1, 0), block_size=12, mask_token_id=1)
    directory = save_drafter(drafter, tmp_path / "d")
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"mask_token_id": 1, "target_layer_ids": [1, 0]}
    assert config["block_size"] == 12 and config["num_target_layers"] == 2
    from safetensors.torch import load_file
    names = set(load_file(directory / "model.safetensors"))
    assert "fc.weight" in names and "hidden_norm.weight" in names and "norm.weight" in names
    assert "layers.0.self_attn.q_proj.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)  # shared with the target

    loaded = load_drafter(directory, target)
    features = torch.randn(1, 9, 2 * target.config.hidden_size)
    block = torch.tensor([[5] + [1] * 11])
    with torch.no_grad():
        a = drafter(features, block, 9, drafter.new_cache(1, 32))
        b = loaded(features, block, 9, loaded.new_cache(1, 32))
    assert torch.equal(a, b)


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28, 1) == [14]
    # targets too shallow for DFlash's spread: every layer in range, rising (2 layers gave [1, -1])
    assert default_target_layer_ids(2, 2) == [0, 1] and default_target_layer_ids(3, 2) == [0, 2]
    assert default_target_layer_ids(3, 3) == [0, 1, 2]


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if key in ("mask_token_id", "target_layer_ids"):
            config["dflash_config"][key] = value
        else:
            config[key] = value
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("changes, message", [
    ({"hidden_size": 48, "head_dim": 12}, "hidden_size 48 != target hidden_size 64"),
    ({"target_layer_ids": [0, 7]}, r"target_layer_ids \[7\] are out of range"),
    ({"mask_token_id": 320}, r"config.json: dflash_config.mask_token_id must be a token id in \[0, 320\), got 320"),
    ({"num_target_layers": 36}, "made for a 36-layer target"),
    ({"vocab_size": 1000}, "vocab_size 1000 != target vocab_size 320"),
    ({"intermediate_size": 100}, r"tensor layers.0.mlp.\w+_proj.weight has shape"),
])
def test_mismatched_drafters_are_refused_by_name(target_dir, tmp_path, changes, message):
    target = load_target(target_dir)
    directory = save_random_drafter(tmp_path / "d", target)
    _edit_config(directory, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(directory, target)


def test_missing_drafter_tensor_is_named(target_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    target = load_target(target_dir)
    directory = save_random_drafter(tmp_path / "d", target)
    tensors = load_file(directory / "model.safetensors")
    del tensors["fc.weight"]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match="lacks tensor fc.weight"):
        load_drafter(directory, target)


def test_mismatch_error_is_a_checkpoint_error():
    assert issubclass(MismatchError, CheckpointError)

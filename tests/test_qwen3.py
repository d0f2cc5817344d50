"""The Qwen3 target against transformers' implementation as an independent oracle."""

import json

import pytest
import torch
from transformers import Qwen3ForCausalLM

from helpers import save_hf_target
from trtspec.errors import CheckpointError
from trtspec.models import load_target


def _oracle(directory):
    return Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.mark.parametrize("tie", [False, True])
def test_the_target_matches_transformers(tmp_path, tie):
    """Logits and every layer's features, in one prefill and token by token through the KV cache: one
    oracle load serves every comparison (tied weights stay one tensor)."""
    directory = save_hf_target(tmp_path / "t", tie=tie, with_tokenizer=False, seed=3)
    hf, ours = _oracle(directory), load_target(directory)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tie  # tied weights stay shared
    prompts = torch.randint(0, ours.config.vocab_size, (4, 23), generator=torch.Generator().manual_seed(0))
    layers = tuple(range(ours.config.num_hidden_layers))  # every layer, the last (post-norm) too
    with torch.no_grad():
        expected = hf(prompts, output_hidden_states=True)
        logits, features = ours(prompts, 0, ours.new_cache(4, 64), feature_layers=layers)
        assert (logits - expected.logits).abs().max() < 1e-4
        for n, layer in enumerate(layers):
            width = ours.config.hidden_size
            tapped = features[..., n * width:(n + 1) * width]
            assert (tapped - expected.hidden_states[layer + 1]).abs().max() < 1e-4

        # token by token through the KV cache, after a short prefill
        cache = ours.new_cache(4, 64)
        steps = [ours(prompts[:, :5], 0, cache)[0]]
        steps += [ours(prompts[:, i:i + 1], i, cache)[0] for i in range(5, prompts.shape[1])]
        assert (torch.cat(steps, dim=1) - expected.logits).abs().max() < 1e-4


def test_rollback_then_rewrite_matches_fresh_pass(tmp_path):
    directory = save_hf_target(tmp_path / "t", with_tokenizer=False)
    ours = load_target(directory)
    tokens = torch.randint(0, ours.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    other = torch.randint(0, ours.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = ours.new_cache(1, 64)
        ours(tokens[:, :14], 0, cache)
        ours(other, 14, cache)          # a rejected block
        cache.rollback(14)
        rewritten, _ = ours(tokens[:, 14:], 14, cache)
        fresh, _ = ours(tokens, 0, ours.new_cache(1, 64))
    assert (rewritten - fresh[:, 14:]).abs().max() < 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny target written by transformers, and its float32 logits of one prompt as we load it."""
    directory = save_hf_target(tmp_path_factory.mktemp("qwen3") / "t", with_tokenizer=False)
    prompt = torch.randint(0, 320, (1, 9), generator=torch.Generator().manual_seed(0))
    target = load_target(directory)
    with torch.no_grad():
        full = target(prompt, 0, None)[0]
    return directory, target, prompt, full


def test_a_sharded_checkpoint_loads_the_same_weights(checkpoint, tmp_path):
    directory, _, prompt, full = checkpoint
    sharded = tmp_path / "sharded"
    _oracle(directory).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    with torch.no_grad():
        assert torch.equal(load_target(sharded)(prompt, 0, None)[0], full)


def test_a_bfloat16_target_stays_close_to_float32(checkpoint):
    directory, _, prompt, full = checkpoint
    with torch.no_grad():
        bf16 = load_target(directory, dtype=torch.bfloat16)
        assert bf16.dtype == torch.bfloat16
        assert (bf16(prompt, 0, None)[0].float() - full).abs().max() < 0.25


def test_the_cache_refuses_a_gap(checkpoint):
    ours = checkpoint[1]
    with torch.no_grad(), pytest.raises(ValueError, match="gap"):
        ours(torch.zeros(1, 2, dtype=torch.long), 3, ours.new_cache(1, 8))


def test_the_cache_refuses_an_overflow(checkpoint):
    ours = checkpoint[1]
    with torch.no_grad(), pytest.raises(ValueError, match="holds 8"):
        ours(torch.zeros(1, 9, dtype=torch.long), 0, ours.new_cache(1, 8))


@pytest.mark.parametrize("damage, message", [
    ("missing_dir", "directory not found"),
    ("no_config", "missing config.json"),
    ("bad_json", "not valid JSON"),
    ("no_weights", "no model.safetensors"),
    ("corrupt_weights", "cannot read"),
    ("missing_tensor", "lacks tensor"),
    ("wrong_type", "model_type"),
])
def test_bad_target_checkpoints_are_refused_by_name(tmp_path, damage, message):
    directory = save_hf_target(tmp_path / "t", with_tokenizer=False)
    weights = directory / "model.safetensors"
    if damage == "missing_dir":
        directory = tmp_path / "nowhere"
    elif damage == "no_config":
        (directory / "config.json").unlink()
    elif damage == "bad_json":
        (directory / "config.json").write_text("{not json")
    elif damage == "no_weights":
        weights.unlink()
    elif damage == "corrupt_weights":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "missing_tensor":
        from safetensors.torch import load_file, save_file
        tensors = load_file(weights)
        del tensors["model.layers.1.mlp.up_proj.weight"]
        save_file(tensors, weights)
    elif damage == "wrong_type":
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(CheckpointError, match=message):
        load_target(directory)


@pytest.mark.parametrize("parts", [1, 2])
def test_the_exported_attention_equals_the_fused_kernel(monkeypatch, parts):
    """The step graphs' attention (written for export: a key/value head's queries scored as one
    matrix, cached and new keys attended where they lie) against PyTorch's fused kernel, with three
    query heads to a key/value head, several queries a row, padding masked off and rows of their
    own lengths."""
    from helpers import tiny_config
    from trtspec.models.layers import Attention

    torch.manual_seed(0)
    attention = Attention(tiny_config(hidden=96, heads=6, kv_heads=2))
    batch, tokens, past, dim = 3, 4, 7, attention.head_dim
    q = torch.randn(batch, tokens, attention.num_heads, dim).transpose(1, 2)  # a transposed axis, as projected
    keys = [torch.randn(batch, attention.num_kv_heads, n, dim) for n in (past, tokens)]
    values = [torch.randn(batch, attention.num_kv_heads, n, dim) for n in (past, tokens)]
    causal = torch.ones(tokens, tokens).tril().bool()
    cached = torch.arange(past)[None, :] < torch.tensor([7, 3, 0])[:, None]  # rows of their own lengths
    seen = torch.cat((cached, torch.ones(batch, tokens).bool()), 1)
    mask = (seen[:, None, :] & torch.cat((torch.ones(tokens, past).bool(), causal), 1)[None])[:, None]  # [b, 1, T, P+T]
    as_given = (lambda x: tuple(x)) if parts == 2 else (lambda x: torch.cat(x, dim=2))
    fused = attention.attention(q, as_given(keys), as_given(values), mask)
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    exported = attention.attention(q, as_given(keys), as_given(values), mask)
    assert exported.shape == (batch, tokens, attention.num_heads * dim)
    torch.testing.assert_close(exported, fused, atol=1e-5, rtol=1e-5)

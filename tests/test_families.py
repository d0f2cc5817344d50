"""The Llama 3.x and Qwen3-MoE target families, end to end.

Random tiny checkpoints written by transformers (Llama with llama3 RoPE scaling and attention
biases; Qwen3-MoE with 4 experts, top-2, one dense layer) are checked against transformers as the
oracle (logits and every layer's features, prefill and token by token), then decoded: greedy
speculative with a random drafter == greedy autoregressive == transformers' greedy `generate`,
eager and through an ONNX Runtime engine, and through `trtspec run`. Configs asking for what the
runtime does not implement are refused with one line naming the field.
"""

import json

import pytest
import torch
from helpers import ar_of, generate, opened, single
from helpers import (assert_one_line_error, random_drafter, save_drafter, save_hf_target, trtspec_in_process)

from trtspec.build import BuildConfig, build_engine
from trtspec.errors import CheckpointError
from trtspec.models import LlamaConfig, Qwen3MoeConfig, load_target, target_config_from_dict
from trtspec.models.layers import MLP, SparseMoE
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.schedule import BlockChoice

FAMILIES = ("llama", "qwen3_moe")
LAYER_IDS = (0, 1)  # the random drafters read both layers of the two-layer targets (half the export time of four)


def _oracle(directory):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.mark.parametrize("family, options", [
    ("llama", {}),
    ("llama", {"tie": True, "attention_bias": False}),
    ("qwen3_moe", {}),
    ("qwen3_moe", {"norm_topk_prob": False, "mlp_only_layers": [], "decoder_sparse_step": 2}),
], ids=["llama-llama3-rope-bias", "llama-tied", "moe-top2-norm-dense1", "moe-unnormed-step2"])
def test_the_family_target_matches_transformers(tmp_path, family, options):
    """Logits, every layer's features, and token-by-token steps through the KV cache, plus what makes
    the family itself (llama3 RoPE scaling, sparse and dense MoE layers): one oracle load serves all."""
    directory = save_hf_target(tmp_path / "t", family=family, with_tokenizer=False, seed=3, **options)
    hf, ours = _oracle(directory), load_target(directory)
    assert ours.config.model_type == family
    prompts = torch.randint(0, ours.config.vocab_size, (2, 80), generator=torch.Generator().manual_seed(0))
    layers = tuple(range(ours.config.num_hidden_layers))  # every layer, the last (post-norm) too
    width = ours.config.hidden_size
    with torch.no_grad():
        expected = hf(prompts, output_hidden_states=True)
        logits, features = ours(prompts, 0, ours.new_cache(2, 96), feature_layers=layers)
        assert (logits - expected.logits).abs().max() < 1e-4
        for n, layer in enumerate(layers):
            assert (features[..., n * width:(n + 1) * width] - expected.hidden_states[layer + 1]).abs().max() < 1e-4
        cache = ours.new_cache(2, 96)  # token by token through the KV cache, after a short prefill
        steps = [ours(prompts[:, :5], 0, cache)[0]]
        steps += [ours(prompts[:, i:i + 1], i, cache)[0] for i in range(5, prompts.shape[1])]
        assert (torch.cat(steps, dim=1) - expected.logits).abs().max() < 1e-4

        if family == "llama" and not options:  # the test sees the llama3 scaling: without it the logits move
            assert ours.config.rope_scaling["rope_type"] == "llama3" and ours.config.attention_bias
            ours.rotary.scaling = None
            assert (ours(prompts, 0, None)[0] - expected.logits).abs().max() > 1e-2
        if family == "qwen3_moe":
            sparse = [isinstance(layer.mlp, SparseMoE) for layer in ours.model.layers]
            assert sparse == ([True, False, True, True] if not options else [False, True, False, True])
            assert all(isinstance(layer.mlp, MLP) for layer, s in zip(ours.model.layers, sparse) if not s)


def tiny_configs(vocab_size: int, hidden: int, heads: int, kv_heads: int, rope_span: int):
    """A llama3-RoPE Llama and a top-2-of-4 Qwen3-MoE (layer 1 dense), two layers each, built directly."""
    shape = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8)
    return [LlamaConfig(**shape, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": rope_span}),
            Qwen3MoeConfig(**shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True,
                           mlp_only_layers=(1,))]


@pytest.mark.parametrize("config", tiny_configs(64, 32, 4, 2, 64), ids=["llama", "qwen3_moe"])
def test_family_configs_round_trip_through_their_dict(config):
    """What engine manifests and training fingerprints hold reads back as the same family and config."""
    data = json.loads(json.dumps(config.to_dict()))
    assert data["model_type"] == config.model_type
    assert target_config_from_dict(data) == config


@pytest.fixture(scope="module", params=FAMILIES)
def family_pair(request, tmp_path_factory):
    """A tokenizer-equipped target of the family, a random drafter for it, and both loaded."""
    root = tmp_path_factory.mktemp(request.param)
    target_dir = save_hf_target(root / "target", family=request.param, seed=5, layers=2)
    target = load_target(target_dir)
    drafter_dir = save_drafter(random_drafter(target, layer_ids=LAYER_IDS, block_size=8), root / "drafter")
    from trtspec.models import load_drafter
    return request.param, target_dir, drafter_dir, target, load_drafter(drafter_dir, target)


def _greedy(runner, prompts, block_size, tokens=20):
    return [generate(runner, prompt, GenerationConfig(block=BlockChoice(block_size), max_new_tokens=tokens)).tokens
            for prompt in prompts]


PROMPTS = [[5, 9, 33, 2, 7], [100], list(range(40, 70))]


@pytest.fixture(scope="module")
def family_ar(family_pair):
    """Greedy autoregressive tokens of PROMPTS, eager: the reference of the family's decode tests."""
    return _greedy(single(family_pair[3]), PROMPTS, 1)


def test_greedy_autoregressive_equals_transformers_generate(family_pair, family_ar):
    _, target_dir, _, _, _ = family_pair
    ar = family_ar
    hf = _oracle(target_dir)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        for prompt, tokens in zip(PROMPTS, ar):
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, min_new_tokens=20,
                              pad_token_id=0)
            assert out[0, len(prompt):].tolist() == tokens


def test_greedy_speculative_equals_autoregressive(family_pair, family_ar):
    _, _, _, target, drafter = family_pair
    for block_size in (4, 8, 16):
        assert _greedy(single(target, drafter), PROMPTS, block_size) == family_ar


@pytest.fixture(scope="module")
def family_engine(family_pair, tmp_path_factory):
    pytest.importorskip("onnxruntime", reason="the onnxruntime backend needs the [onnx] extra")
    family, target_dir, drafter_dir, _, _ = family_pair
    output = tmp_path_factory.mktemp(f"{family}-engine") / "ort"
    manifest = build_engine(target_dir, drafter_dir, output, BuildConfig(block_sizes=(4, 8), backend="onnxruntime",
                                                                         max_batch=2), progress=False)
    # the target held to float32's self-check; the drafter in 8 bits (the default) is not
    assert manifest.target.model_type == family and manifest.check["target_max_abs_logit_diff"] < 1e-4
    return output


def test_onnxruntime_engine_equals_eager(family_pair, family_engine):
    _, _, _, target, drafter = family_pair
    engine = opened(family_engine, torch.device("cpu"))
    for block_size in (4, 8):
        assert _greedy(engine, PROMPTS, block_size) == _greedy(single(target, drafter), PROMPTS, block_size)
    assert _greedy(ar_of(engine), PROMPTS[:2], 1) == _greedy(single(target), PROMPTS[:2], 1)


def test_cli_run_on_the_family_engine_decodes_like_eager(family_pair, family_engine, tmp_path):
    _, target_dir, drafter_dir, _, _ = family_pair
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def add(a, b):\n")
    common = ("--max-new-tokens", 16, "--json")
    eager = trtspec_in_process("run", prompt, "--target", target_dir, "--drafter", drafter_dir, "--block-size", 4,
                               *common)
    assert eager.returncode == 0, eager.stderr.decode()
    built = trtspec_in_process("run", prompt, "--engine", family_engine, "--block-size", 8, *common)
    assert built.returncode == 0, built.stderr.decode()
    assert json.loads(built.stdout)["tokens"] == json.loads(eager.stdout)["tokens"]


def _edited(tmp_path, family, **changes):
    directory = save_hf_target(tmp_path / "t", family=family, layers=2,
                               with_tokenizer=changes.get("model_type") == "mistral")  # that one runs the CLI too
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("family, changes, fragments", [
    ("llama", {"model_type": "mistral"}, ("model_type 'mistral' is not supported", "llama, qwen3_moe")),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
     ("rope_parameters.rope_type 'yarn' is not supported",)),
    ("llama", {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}},
     ("rope_scaling.type 'linear' is not supported",)),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
     ("rope_parameters.rope_type 'llama3' is not supported for model_type 'qwen3_moe'",)),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 16}, ("use_sliding_window",)),
    ("llama", {"mlp_bias": True}, ("mlp_bias",)),
    ("llama", {"hidden_act": "gelu"}, ("hidden_act 'gelu'",)),
    ("qwen3_moe", {"num_experts_per_tok": 9}, ("num_experts_per_tok (9) exceeds num_experts (4)",)),
])
def test_unsupported_configs_are_refused_in_one_line_naming_the_field(tmp_path, family, changes, fragments):
    directory = _edited(tmp_path, family, **changes)
    with pytest.raises(CheckpointError) as error:
        load_target(directory)
    assert "\n" not in str(error.value) and str(directory / "config.json") in str(error.value)
    for fragment in fragments:
        assert fragment in str(error.value)
    if changes.get("model_type") == "mistral":  # and on the command line: one `Error:` line, no traceback
        prompt = tmp_path / "prompt.txt"
        prompt.write_text("hi")
        assert_one_line_error(trtspec_in_process("run", prompt, "--target", directory, "--ar"), "mistral")


def test_a_drafter_trained_on_the_family_decodes_losslessly(family_pair, tmp_path):
    """The training commands take these targets too (generate-data, then train-drafter on its data)."""
    _, target_dir, _, target, _ = family_pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(4)))
    data = tmp_path / "train.jsonl"
    made = trtspec_in_process("generate-data", "--target", target_dir, "--prompts", prompts, "-o", data,
                              "--max-new-tokens", 16)
    assert made.returncode == 0, made.stderr.decode()
    trained = trtspec_in_process("train-drafter", "--target", target_dir, "--data", data, "--block-size", 4,
                                 "-o", tmp_path / "d", "--steps", 3, "--batch-size", 2, "--num-features", 2)
    assert trained.returncode == 0, trained.stderr.decode()
    from trtspec.models import load_drafter
    drafter = load_drafter(tmp_path / "d", target)
    assert _greedy(single(target, drafter), PROMPTS[:2], 4) == _greedy(single(target), PROMPTS[:2], 1)


@pytest.mark.slow
@pytest.mark.parametrize("config", tiny_configs(8, 16, 2, 1, 4), ids=["llama", "qwen3_moe"])
def test_sampling_at_t1_follows_each_familys_target(config):
    """Speculative sampling at T = 1 through each family's target: the first three tokens follow the
    target's exact distribution (the statistics of tests/test_sampling.py, 3,000 seeded requests)."""
    from helpers import exact_distribution, pvalues, sample_three_tokens
    from trtspec.models import DecoderTarget

    torch.manual_seed(0)
    target = DecoderTarget(config).eval()
    with torch.no_grad():  # logits far from uniform, so a wrong distribution would show
        target.lm_head.weight.mul_(4.0)
    samples = sample_three_tokens((target, random_drafter(target, layer_ids=(0, 1), block_size=4, mask_token_id=1)),
                                  3_000)
    results = pvalues(samples, exact_distribution(target, 3))
    assert min(results.values()) > 1e-3, results

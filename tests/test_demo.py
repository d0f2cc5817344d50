"""The bundled demo pair: it ships, fits the size budget, and decodes losslessly out of the box."""

import json
from pathlib import Path

import pytest
from helpers import trtspec_in_process

from trtspec.api import Pipeline
from trtspec.assets import ASSETS, resolve_drafter, resolve_target
from trtspec.perf.bench import load_prompts
from trtspec.errors import TrtspecError
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.schedule import AR, AUTO, BlockChoice

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fibonacci.py.txt"


def _non_embedding_parameters(module) -> int:
    return sum(p.numel() for n, p in module.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)


@pytest.fixture(scope="module")
def demo():
    return Pipeline(resolve_target(None), resolve_drafter(None, None))


def test_the_demo_pair_ships_within_budget(demo):
    size = sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file())
    assert size <= 55 * 10**6, f"bundled assets are {size / 10**6:.1f} MB"  # the working tree stays under 60 MB
    assert _non_embedding_parameters(demo.drafter) <= _non_embedding_parameters(demo.target) / 4
    assert demo.drafter.config.block_size == 16
    assert resolve_drafter("demo-b16", "elsewhere") == ASSETS / "demo-b16"
    with pytest.raises(TrtspecError, match="no bundled drafter named 'demo-b99'"):
        resolve_drafter("demo-b99", None)


def test_demo_speculative_equals_autoregressive_on_humaneval(demo):
    _, prompts = load_prompts("humaneval", limit=4)
    baseline = demo.autoregressive()
    for prompt in prompts:
        expected = baseline.generate(prompt, GenerationConfig(block=AR, max_new_tokens=48)).tokens
        for block_size in (8, 16):
            result = demo.generate(prompt, GenerationConfig(block=BlockChoice(block_size), max_new_tokens=48))
            assert result.tokens == expected
            assert result.generation.stats.tau > 1.5  # a trained drafter, not a random one


def _trtspec_json(*args) -> dict:
    result = trtspec_in_process("--threads", "1", *args)
    assert result.returncode == 0, result.stderr.decode()
    return json.loads(result.stdout)


def test_run_defaults_to_the_demo_pair_and_its_blockpilot_policy(demo):
    """The demo drafter ships a BlockPilot policy, so a plain run lets it choose the block size."""
    output = _trtspec_json("run", EXAMPLE, "--json", "--max-new-tokens", "40")
    choices = {c.size for c in demo.policy.choices} | {c.grow_to for c in demo.policy.choices}
    assert output["stats"]["block_size_auto"] and output["stats"]["block_size"] in choices
    assert output["text"].strip()
    fixed = _trtspec_json("run", EXAMPLE, "--json", "--max-new-tokens", "40", "--block-size", "16")
    assert fixed["stats"]["block_size"] == 16 and not fixed["stats"]["block_size_auto"]
    assert fixed["tokens"] == output["tokens"]  # greedy: lossless whatever the block size


def test_run_compares_with_autoregressive_decoding():
    """The quick start's `--compare-ar`: the speed-up over AR through the same backend, and at T=0
    the proof that the two outputs are the same tokens."""
    output = _trtspec_json("run", EXAMPLE, "--json", "--max-new-tokens", "32", "--compare-ar")
    comparison = output["compare_ar"]
    assert comparison["identical"] is True and comparison["ar_decode_tokens_per_s"] > 0
    assert comparison["speedup"] == pytest.approx(
        output["stats"]["decode_tokens_per_s"] / comparison["ar_decode_tokens_per_s"])


def test_auto_works_out_of_the_box(tmp_path):
    """`--block-size auto` needs no policy flag on a fresh install: run, bench, and a default build."""
    assert _trtspec_json("run", EXAMPLE, "--json", "--max-new-tokens", "24", "--block-size", "auto")[
        "stats"]["block_size_auto"]
    report = tmp_path / "bench.json"
    result = trtspec_in_process("--threads", "1", "bench", "--block-sizes", "12,16,auto", "--limit", "2",
                                "--max-new-tokens", "16", "--repeats", "1", "--json", report)
    assert result.returncode == 0, result.stderr.decode()
    assert "auto" in result.stdout.decode() and report.is_file()


def test_demo_engine_built_with_defaults_reproduces_eager(demo, tmp_path):
    """`trtspec build` with its defaults (demo pair, 8/12/16/20/24, best backend here), then the
    ONNX Runtime engine's greedy output equals eager PyTorch's on HumanEval prompts."""
    pytest.importorskip("onnxruntime", reason="the onnxruntime backend needs the [onnx] extra")
    result = trtspec_in_process("--threads", "1", "build", "-o", tmp_path / "engine")
    assert result.returncode == 0, result.stderr.decode()
    assert "B=12 (target profile 3, draft profile 1)" in result.stdout.decode()
    engine = Pipeline(resolve_target(None), resolve_drafter(None, None), engine=tmp_path / "engine")
    assert engine.backend == "onnxruntime" and engine.runner.block_sizes == (8, 12, 16, 20, 24)
    assert engine.policy is not None and engine.default_block == AUTO  # the demo policy, embedded
    _, prompts = load_prompts("humaneval", limit=6)
    for prompt in prompts:
        for block_size in (12, 24):
            config = GenerationConfig(block=BlockChoice(block_size), max_new_tokens=48)
            assert engine.generate(prompt, config).tokens == demo.generate(prompt, config).tokens


def test_expanded_demo_drafter_ships_with_its_lineage(demo):
    """demo-b24: demo-b16 post-trained to B=24 by `trtspec expand-block` (scripts/demo/README.md)."""
    expanded = Pipeline(resolve_target(None), resolve_drafter("demo-b24", None))
    lineage = expanded.drafter.config.lineage
    assert expanded.drafter.config.block_size == 24 and lineage["source_block_size"] == 16
    _, prompts = load_prompts("humaneval", limit=2)
    for prompt in prompts:
        config = GenerationConfig(block=BlockChoice(24), max_new_tokens=48)
        assert expanded.generate(prompt, config).tokens == demo.autoregressive().generate(
            prompt, GenerationConfig(block=AR, max_new_tokens=48)).tokens

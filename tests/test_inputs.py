"""Everything trtspec reads from disk and every numeric flag, through the real CLI: a bad value is
exit 1, one `Error:` line naming the file and field (or the flag), no traceback, nothing written
and the inputs untouched. Ends with a hypothesis fuzz test over configs, labels, policies and flags."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import load_file, save_file

from helpers import assert_one_line_error
from trtspec.cli import cli


def trtspec(*args) -> SimpleNamespace:
    """The real `trtspec` command, in-process (click's runner): the fields of a finished subprocess,
    with an uncaught exception written out as the traceback a user would see."""
    result = CliRunner().invoke(cli, [str(a) for a in args], env={"TRTSPEC_DEBUG": None})
    stderr = result.stderr_bytes or b""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception)).encode()
    return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout_bytes, stderr=stderr)


def digest(*paths: Path) -> str:
    """Every file under `paths` (names and bytes), to show that inputs are untouched."""
    h = hashlib.sha256()
    for root in paths:
        for path in sorted(p for p in [root, *root.rglob("*")] if p.is_file()):
            h.update(str(path).encode() + path.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompt") / "prompt.txt"
    path.write_text("def add(a, b):\n")
    return path


def _edit(directory: Path, name: str, edit) -> None:
    path = directory / name
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _set(dotted: str, value):
    def edit(data):
        *parents, key = dotted.split(".")
        for parent in parents:
            data = data[parent]
        data[key] = value
    return edit


# --- configs, indexes and tokenizer settings ------------------------------------------------------

TARGET_CASES = [
    ("hidden_size", "64", 'config.json: hidden_size must be an integer >= 1, got "64"'),
    ("num_hidden_layers", [4], "config.json: num_hidden_layers must be an integer >= 1, got [4]"),
    ("vocab_size", 0, "config.json: vocab_size must be an integer >= 1, got 0"),
    ("rope_theta", -1.0, "config.json: rope_theta must be a number > 0, got -1.0"),
    ("rope_theta", "1e6", 'config.json: rope_theta must be a number > 0, got "1e6"'),
    ("rms_norm_eps", 0, "config.json: rms_norm_eps must be a number > 0, got 0"),
    ("rms_norm_eps", -1e-6, "config.json: rms_norm_eps must be a number > 0"),
    ("rope_scaling", ["default"], "config.json: rope_scaling must be an object, got a list"),
    ("num_key_value_heads", 3, "num_attention_heads (4) is not a multiple of num_key_value_heads (3)"),
    ("tie_word_embeddings", "yes", 'config.json: tie_word_embeddings must be true or false, got "yes"'),
    ("eos_token_id", "eos", "config.json: eos_token_id must be a token id or a list of token ids"),
]


@pytest.mark.parametrize("field, value, message", TARGET_CASES, ids=[f"{c[0]}={c[1]!r}" for c in TARGET_CASES])
def test_bad_target_config_fields_are_named(field, value, message, target_dir, drafter_dir, prompt_file, tmp_path):
    target = _edited_copy(target_dir, tmp_path / "target", field, value)
    assert_one_line_error(trtspec("run", prompt_file, "--target", target, "--drafter", drafter_dir), message)


def _edited_copy(source, copy, field, value):
    """A copy of a checkpoint directory whose config.json has `field` set to `value`."""
    shutil.copytree(source, copy)
    _edit(copy, "config.json", _set(field, value))
    return copy


DRAFTER_CASES = [
    ("dflash_config", [1, 2], "config.json: dflash_config must be an object, got a list"),
    ("dflash_config.target_layer_ids", "0,2", 'dflash_config.target_layer_ids must be a list of integers, got "0,2"'),
    ("dflash_config.target_layer_ids", [0, 9], "dflash_config.target_layer_ids [9] are out of range for a 2-layer"),
    ("dflash_config.mask_token_id", 1.5, "config.json: dflash_config.mask_token_id must be an integer"),
    ("block_size", "16", 'config.json: block_size must be an integer >= 1, got "16"'),
    ("block_size", 80, "config.json: block_size must be an integer in [2, 64], got 80"),
    ("num_target_layers", -4, "config.json: num_target_layers must be an integer >= 1, got -4"),
    ("rms_norm_eps", -0.5, "config.json: rms_norm_eps must be a number > 0, got -0.5"),
]


@pytest.mark.parametrize("field, value, message", DRAFTER_CASES, ids=[f"{c[0]}={c[1]!r}" for c in DRAFTER_CASES])
def test_bad_drafter_config_fields_are_named(field, value, message, target_dir, drafter_dir, prompt_file, tmp_path):
    drafter = _edited_copy(drafter_dir, tmp_path / "drafter", field, value)
    assert_one_line_error(trtspec("run", prompt_file, "--target", target_dir, "--drafter", drafter), message)


def test_a_negative_rope_theta_is_refused(target_dir, drafter_dir, prompt_file, tmp_path):
    """Its NaN logits would decode as EOS: `run` would exit 0 with an empty output."""
    target = tmp_path / "target"
    shutil.copytree(target_dir, target)
    _edit(target, "config.json", _set("rope_theta", -1e6))
    result = trtspec("run", prompt_file, "--target", target, "--ar", "--json")
    assert_one_line_error(result, str(target / "config.json"), "rope_theta")


@pytest.mark.parametrize("damage, message", [
    ("value not a string", "weight_map.model.norm.weight must be a shard file name, got [\"model.safetensors\"]"),
    ("missing shard", "weight_map.model.norm.weight names shard-2.safetensors, which is missing"),
    ("path outside", "must name a file beside the index"),
    ("weight_map a list", "model.safetensors.index.json: weight_map must be an object, got a list"),
])
def test_bad_sharded_index_is_named(damage, message, target_dir, prompt_file, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(target_dir, target)
    tensors = load_file(target / "model.safetensors")
    (target / "model.safetensors").unlink()
    save_file(tensors, target / "shard-1.safetensors")
    weight_map = {name: "shard-1.safetensors" for name in tensors}
    if damage == "value not a string":
        weight_map["model.norm.weight"] = ["model.safetensors"]
    elif damage == "missing shard":
        weight_map["model.norm.weight"] = "shard-2.safetensors"
    elif damage == "path outside":
        weight_map["model.norm.weight"] = "../target/shard-1.safetensors"
    index = {"weight_map": list(weight_map) if damage == "weight_map a list" else weight_map}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_one_line_error(trtspec("run", prompt_file, "--target", target, "--ar"), message)


@pytest.fixture
def chat(target_dir, prompt_file, tmp_path):
    """A copy of the target whose chat template a test edits, its template, and a `run --chat`."""
    target = tmp_path / "target"
    shutil.copytree(target_dir, target)
    template = json.loads((target / "tokenizer_config.json").read_text())["chat_template"]
    return target, template, ("run", prompt_file, "--target", target, "--ar", "--chat", "--json", "--max-new-tokens", 6)


def test_a_chat_template_list_uses_its_default_template(chat):
    """Hugging Face's list form: the "default" template is used, the same text as the string form."""
    target, template, args = chat
    plain = trtspec(*args)
    assert plain.returncode == 0, plain.stderr.decode()
    _edit(target, "tokenizer_config.json", _set("chat_template", [{"name": "tool_use", "template": "{{ oops"},
                                                                   {"name": "default", "template": template}]))
    listed = trtspec(*args)
    assert listed.returncode == 0, listed.stderr.decode()
    assert json.loads(listed.stdout)["tokens"] == json.loads(plain.stdout)["tokens"]


def test_a_chat_template_list_without_a_default_is_one_line(chat):
    target, template, args = chat
    _edit(target, "tokenizer_config.json", _set("chat_template", [{"name": "tool_use", "template": template}]))
    assert_one_line_error(trtspec(*args), "tokenizer_config.json: chat_template lists templates ['tool_use'] "
                                          'but no "default" one')


def test_a_chat_template_that_raises_is_one_line(chat):
    target, _, args = chat
    for raising in ("{{ 1 / 0 }}", "{{ '%d' % messages[0]['content'] }}", "{{ raise_exception('no') }}"):
        _edit(target, "tokenizer_config.json", _set("chat_template", raising))
        assert_one_line_error(trtspec(*args), "--chat: the target's chat template failed")


# --- label sets, features, policies ---------------------------------------------------------------

@pytest.fixture(scope="module")
def blockpilot(target_dir, drafter_dir, tmp_path_factory) -> tuple[Path, Path]:
    """A real label set (label-blocks on the tiny pair) and a policy trained on it."""
    root = tmp_path_factory.mktemp("blockpilot")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n"}) + "\n" for i in range(4)))
    made = trtspec("label-blocks", "--target", target_dir, "--drafter", drafter_dir, "--prompts", prompts,
                   "--block-sizes", "4,8", "--max-new-tokens", 12, "-o", root / "labels.jsonl")
    assert made.returncode == 0, made.stderr.decode()
    trained = trtspec("train-policy", root / "labels.jsonl", "--steps", 5, "--hidden", 4, "-o", root / "policy")
    assert trained.returncode == 0, trained.stderr.decode()
    return root / "labels.jsonl", root / "policy"


def _edit_labels(path: Path, row: int, edit) -> None:
    lines = path.read_text().splitlines()
    data = json.loads(lines[row])
    edit(data)
    lines[row] = json.dumps(data)
    path.write_text("\n".join(lines) + "\n")


def _copy(blockpilot, tmp_path) -> tuple[Path, Path]:
    labels, policy = blockpilot
    shutil.copytree(labels.parent, tmp_path / "bp")
    return tmp_path / "bp" / labels.name, tmp_path / "bp" / policy.name


LABEL_CASES = [
    (0, "cycle_cost_s.4", "fast", 'labels.jsonl:1: cycle_cost_s.4 must be a number > 0, got "fast"'),
    (0, "cycle_cost_s", [1, 2], "labels.jsonl:1: cycle_cost_s must be an object, got a list"),
    (0, "ar_token_s", 0, "labels.jsonl:1: ar_token_s must be a number > 0, got 0"),
    (0, "block_sizes", "4,8", 'labels.jsonl:1: block_sizes must be a list of block sizes'),
    (0, "block_sizes", [4, 99], "labels.jsonl:1: block_sizes holds a bad block size"),
    (0, "vocab_size", "320", 'labels.jsonl:1: vocab_size must be an integer >= 1, got "320"'),
    (1, "runs.4.tau", "high", 'labels.jsonl:2: runs.4.tau must be a number >= 0, got "high"'),
    (1, "runs.8", None, "labels.jsonl:2: runs.8 is missing"),
    (1, "runs.1.cycles", -3, "labels.jsonl:2: runs.1.cycles must be an integer >= 0, got -3"),
    (2, "prompt_tokens", 2.5, "labels.jsonl:3: prompt_tokens must be an integer >= 1, got 2.5"),
]


@pytest.mark.parametrize("row, field, value, message", LABEL_CASES, ids=[f"{c[1]}={c[2]!r}" for c in LABEL_CASES])
def test_bad_label_fields_are_named(row, field, value, message, blockpilot, tmp_path):
    labels, policy = _copy(blockpilot, tmp_path)
    _edit_labels(labels, row, _set(field, value))
    before = digest(labels.parent)
    assert_one_line_error(trtspec("train-policy", labels, "-o", tmp_path / "out"), message)
    assert_one_line_error(trtspec("eval-policy", "--policy", policy, "--labels", labels, "--json", tmp_path / "e.json"),
                          message)
    assert digest(labels.parent) == before and not (tmp_path / "out").exists() and not (tmp_path / "e.json").exists()


@pytest.mark.parametrize("damage, message", [
    ("truncated", "label features: cannot read"),
    ("missing kind", "has no tensor 'confidence'"),
    ("extra row", "tensor 'last' must be a float [4, D] tensor (one row per prompt)"),
    ("NaN", "tensor 'mean' holds NaN or infinite values"),
])
def test_damaged_feature_files_are_named(damage, message, blockpilot, tmp_path):
    labels, _ = _copy(blockpilot, tmp_path)
    features = labels.with_name("labels.features.safetensors")
    tensors = load_file(features)
    if damage == "truncated":
        features.write_bytes(features.read_bytes()[:100])
    else:
        if damage == "missing kind":
            del tensors["confidence"]
        elif damage == "extra row":
            tensors["last"] = tensors["last"].repeat(2, 1)
        else:
            tensors["mean"][0, 0] = float("nan")
        save_file(tensors, features)
    assert_one_line_error(trtspec("train-policy", labels, "-o", tmp_path / "out"), "features.safetensors", message)
    assert not (tmp_path / "out").exists()


POLICY_CASES = [
    ("choices", [], "policy.json: choices must not be empty"),
    ("choices", ["4", "x"], "policy.json: choices holds a bad block size"),
    ("features", ["last", "vibes"], "policy.json: features holds unknown kinds ['vibes']"),
    ("features", "last", 'policy.json: features must be a list of strings, got "last"'),
    ("inputs", 0, "policy.json: inputs must be an integer >= 1, got 0"),
    ("hidden", "4", 'policy.json: hidden must be an integer >= 1, got "4"'),
    ("hidden", 5, "does not fit policy.json"),
]


@pytest.mark.parametrize("field, value, message", POLICY_CASES, ids=[f"{c[0]}={c[1]!r}" for c in POLICY_CASES])
def test_bad_policy_fields_are_named(field, value, message, blockpilot, tmp_path):
    labels, policy = _copy(blockpilot, tmp_path)
    _edit(policy, "policy.json", _set(field, value))
    assert_one_line_error(trtspec("eval-policy", "--policy", policy, "--labels", labels), message)


def test_policy_that_is_not_an_object_or_has_truncated_weights(blockpilot, tmp_path):
    labels, policy = _copy(blockpilot, tmp_path)
    weights = policy / "policy.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    assert_one_line_error(trtspec("eval-policy", "--policy", policy, "--labels", labels),
                          "BlockPilot policy: cannot read", "policy.safetensors")
    (policy / "policy.json").write_text("[1, 2]")
    assert_one_line_error(trtspec("eval-policy", "--policy", policy, "--labels", labels),
                          "policy.json must hold a JSON object, got a list")


# --- prompt sets and training data ----------------------------------------------------------------

@pytest.mark.parametrize("line, message", [
    ({"prompt": 5}, "prompts.jsonl:2: prompt must be a string, got an integer"),
    ({"prompt": "x", "prompt_ids": "1 2"}, 'prompts.jsonl:2: prompt_ids must be a list of integers, got "1 2"'),
    ({"prompt": "x", "prompt_ids": []}, "prompts.jsonl:2: prompt_ids must not be empty"),
    ({"prompt": "x", "prompt_ids": [1, 10**6]}, "prompt 2: prompt_ids holds token id 1000000, outside the vocabulary"),
    ({"prompt": "   "}, "prompts.jsonl:2: prompt is empty"),
])
def test_a_bad_prompt_set_is_refused_before_anything_is_written(line, message, target_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n" + json.dumps(line) + "\n")
    out = tmp_path / "data.jsonl"
    assert_one_line_error(trtspec("generate-data", "--target", target_dir, "--prompts", prompts, "-o", out,
                                  "--max-new-tokens", 4), message)
    assert not out.exists()


def test_generate_data_through_an_engine_needs_a_pair(target_dir, tmp_path):
    """generate-data decodes through `run`'s backend; an engine holds a target and its drafter, and
    the command takes no --drafter, so a target without a bundled one says so (auto decodes eagerly)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    out = tmp_path / "data.jsonl"
    assert_one_line_error(trtspec("generate-data", "--target", target_dir, "--prompts", prompts, "-o", out,
                                  "--max-new-tokens", 4, "--backend", "onnxruntime"), "has no bundled drafter")
    assert not out.exists()


def test_a_gzip_prompt_set_reads_like_its_plain_text_and_a_cut_one_is_one_line(tmp_path):
    """Shards are committed as .jsonl.gz (the drafter recipe): every JSONL input reads them."""
    import gzip

    from trtspec.training.data import read_prompt_set

    lines = "".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(50))
    plain, packed = tmp_path / "p.jsonl", tmp_path / "p.jsonl.gz"
    plain.write_text(lines)
    packed.write_bytes(gzip.compress(lines.encode()))
    assert read_prompt_set(packed) == read_prompt_set(plain)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed.read_bytes()[:-12])
    out = tmp_path / "data.jsonl"
    for damaged, message in ((cut, "cut.jsonl.gz is not a whole gzip file"), (plain.rename(tmp_path / "x.jsonl.gz"),
                                                                             "x.jsonl.gz is not a whole gzip file")):
        assert_one_line_error(trtspec("generate-data", "--prompts", damaged, "-o", out, "--max-new-tokens", 4), message)
    assert not out.exists()


@pytest.mark.parametrize("command", ["generate-data", "run --batch", "bench", "train-drafter"])
def test_lone_surrogates_in_jsonl_text_are_refused_at_the_door(command, target_dir, drafter_dir, tmp_path):
    """Before: a "\\ud800" escape in a prompt or response gave a Python stack (UnicodeEncodeError in
    the tokenizer) in every command that reads JSONL; now one line naming the file, line and field."""
    data = tmp_path / "data.jsonl"
    field = "response" if command == "train-drafter" else "prompt"
    bad = {"prompt": "def f(x):", "response": "    return x"}
    bad[field] = "def g(x):\udfff" if field == "prompt" else "  return \ud800"
    data.write_text(json.dumps({"prompt": "def f(x):", "response": "    return x"}) + "\n" + json.dumps(bad) + "\n")
    assert "\\ud" in data.read_text()  # the file holds the JSON escape, as a client would write it
    out = tmp_path / "out"
    args = {"generate-data": ["generate-data", "--target", target_dir, "--prompts", data, "-o", out],
            "run --batch": ["run", "--batch", data, "--target", target_dir, "--drafter", drafter_dir],
            "bench": ["bench", "--prompts", data, "--target", target_dir, "--drafter", drafter_dir,
                      "--block-sizes", "4", "--max-new-tokens", "4", "--json", out],
            "train-drafter": ["train-drafter", "--data", data, "--target", target_dir, "--block-size", "4",
                              "--num-features", "2", "-o", out]}[command]
    character = "U+DFFF at character 9" if field == "prompt" else "U+D800 at character 9"
    assert_one_line_error(trtspec(*args), f"{data}:2: {field} is not valid text: it holds a lone surrogate "
                                          f"({character}")
    assert not out.exists()


def test_generate_data_limit_below_one_is_refused(target_dir, tmp_path):
    """Before: --limit -1 silently dropped the last prompt and --limit 0 wrote an empty file."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(3)))
    for limit in (0, -1):
        out = tmp_path / f"data{limit}.jsonl"
        assert_one_line_error(trtspec("generate-data", "--target", target_dir, "--prompts", prompts, "-o", out,
                                      "--limit", limit), f"--limit must be an integer in [1, 2**31-1], got {limit}")
        assert not out.exists()


def test_train_drafter_resumes_only_its_own_intact_checkpoint(target_dir, tmp_path):
    """Other data, other options or a truncated checkpoint: one line each, nothing changed; one
    training run makes the checkpoint they all try."""
    data = tmp_path / "a.jsonl"
    data.write_text("".join(json.dumps({"prompt": "def f(x):", "response": f" return x + {i}\n"}) + "\n"
                            for i in range(8)))
    other = tmp_path / "b.jsonl"
    other.write_text(data.read_text().replace("return x", "return y"))
    common = ("train-drafter", "--target", target_dir, "--block-size", 4, "--steps", 2, "--batch-size", 2,
              "--num-features", 2, "--checkpoint-every", 1, "-o", tmp_path / "d")
    first = trtspec(*common, "--data", data)
    assert first.returncode == 0, first.stderr.decode()
    checkpoint = tmp_path / "d.work" / "checkpoint.pt"
    before = digest(tmp_path / "d", tmp_path / "d.work")
    assert_one_line_error(trtspec(*common, "--data", other), str(checkpoint),
                          "another training run: the training data (--data) differ")
    assert_one_line_error(trtspec(*common[:-2], "--layers", 2, "-o", tmp_path / "d", "--data", data),
                          "another training run: num_layers (checkpoint 1, now 2) differ")
    assert digest(tmp_path / "d", tmp_path / "d.work") == before
    checkpoint.write_bytes(checkpoint.read_bytes()[:4096])
    assert_one_line_error(trtspec(*common, "--data", data), str(checkpoint),
                          "cannot read the training checkpoint", "delete it to start over")


# --- flags -----------------------------------------------------------------------------------------

FLAG_CASES = [
    (("run", "P", "--block-size", "²"), "--block-size must be an integer B or B:G (B growing to G), or auto, or AR; "
                                         "got '²'"),
    (("run", "P", "--temperature", "-0.1"), "--temperature must be a number >= 0, got -0.1"),
    (("run", "P", "--temperature", "inf"), "--temperature must be a number >= 0, got inf"),
    (("run", "P", "--proposal-temperature", "-1"), "--proposal-temperature must be a number >= 0, got -1"),
    (("serve", "--proposal-temperature", "nan"), "--proposal-temperature must be a number >= 0, got nan"),
    (("run", "P", "--top-k", "-2"), "--top-k must be an integer in [-1, 2**31-1], got -2"),  # -1: off, as vLLM
    (("run", "P", "--top-p", "1.5"), "--top-p must be a number in (0, 1], got 1.5"),
    (("run", "P", "--seed", str(2**63)), "--seed must be an integer in [0, 2**63-1], got 9223372036854775808"),
    (("run", "P", "--seed", "-1"), "--seed must be an integer in [0, 2**63-1], got -1"),
    (("run", "P", "--max-new-tokens", "0"), "--max-new-tokens must be an integer in [1, 2**31-1], got 0"),
    (("run", "P", "--max-context", "1"), "--max-context must be an integer in [2, 2**31-1], got 1"),
    (("run", "P", "--device", "tpu"), "--device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    (("run", "P", "--device", "cuda:x"), "--device must be auto, cpu, cuda or cuda:N, got 'cuda:x'"),
    (("serve", "--gpu-memory-fraction", "0"), "--gpu-memory-fraction must be a number in (0, 1], got 0.0"),
    (("run", "P", "--gpu-memory-fraction", "1.5"), "--gpu-memory-fraction must be a number in (0, 1], got 1.5"),
    (("preflight", "--block-size", "0"), "--block-size must be in [2, 64], got 0"),
    (("preflight", "--block-size", "6:12"), "give plain block sizes here"),
    (("eval-policy", "--policy", "P", "--labels", "P", "--fixed-block-size", "0"),
     "--fixed-block-size must be in [2, 64], got 0"),
    (("bench", "--limit", "-1"), "--limit must be an integer in [1, 2**31-1], got -1"),
    (("bench", "--against-engine", "E"), "--against-eager/--against-engine compare a built engine with another "
                                         "backend; give --engine DIR"),
    (("bench", "--block-sizes", "8,1_6"), "--block-sizes must be an integer B or B:G"),
    (("build", "--block-sizes", "4:8", "-o", "OUT"), "give plain block sizes here"),
    (("train-drafter", "--data", "P", "--block-size", "65", "-o", "OUT"), "--block-size must be in [2, 64], got 65"),
    (("train-drafter", "--data", "P", "--block-size", "4", "--lr", "0", "-o", "OUT"),
     "--lr must be a number > 0, got 0"),
    (("expand-block", "--to", "0", "--data", "P", "-o", "OUT"), "--to must be in [2, 64], got 0"),
    (("expand-block", "--to", "24", "--data", "P", "--distill", "-1", "-o", "OUT"),
     "--distill must be a number >= 0, got -1"),
    (("triton-repo", "--engine", "P", "-o", "OUT", "--instances", "0"),
     "--instances must be an integer in [1, 2**31-1], got 0"),
    (("train-policy", "P", "-o", "OUT", "--hidden", "0"), "--hidden must be an integer in [1, 2**31-1], got 0"),
    (("serve", "--port", "0", "--max-concurrency", "100000"),  # was an allocation traceback
     "--max-concurrency must be an integer in [1, 4096], got 100000"),
]


@pytest.mark.parametrize("args, message", FLAG_CASES, ids=[" ".join(c[0][:1] + c[0][2:4]) for c in FLAG_CASES])
def test_numeric_flags_out_of_range_are_refused_before_any_work(args, message, prompt_file, tmp_path):
    args = [prompt_file if a == "P" else tmp_path / "out" if a == "OUT" else a for a in args]
    assert_one_line_error(trtspec(*args), message)
    assert not (tmp_path / "out").exists()


def test_a_tiny_temperature_with_the_largest_seed_decodes_like_greedy(target_dir, drafter_dir, prompt_file):
    """T = 1e-30 overflows a plain softmax (inf/inf); the seed is the largest a 64-bit generator takes."""
    common = ("run", prompt_file, "--target", target_dir, "--drafter", drafter_dir, "--block-size", 4,
              "--max-new-tokens", 16, "--json")
    greedy = trtspec(*common)
    tiny = trtspec(*common, "--temperature", "1e-30", "--seed", 2**63 - 1)
    assert greedy.returncode == 0 and tiny.returncode == 0, tiny.stderr.decode()
    assert json.loads(tiny.stdout)["tokens"] == json.loads(greedy.stdout)["tokens"]


def test_stop_values_that_isdigit_accepts_but_int_refuses(target_dir, drafter_dir, prompt_file):
    """'²'.isdigit() is True but int('²') raises: it is text, one token or a clear error."""
    result = trtspec("run", prompt_file, "--target", target_dir, "--drafter", drafter_dir, "--stop", "²",
                     "--max-new-tokens", 4)
    assert "Traceback" not in result.stderr.decode()
    if result.returncode:
        assert_one_line_error(result, "--stop '²' is")


def test_subprocess_entry_point_agrees(prompt_file):
    """The in-process runner above is the same command as the installed entry point."""
    import sys

    result = subprocess.run([sys.executable, "-m", "trtspec", "run", prompt_file, "--top-p", "0"],
                            capture_output=True, timeout=120)
    assert_one_line_error(result, "--top-p must be a number in (0, 1], got 0")


def test_threads_beyond_the_cores_are_refused_in_one_line():
    """Before: `--threads 3000` (then inside the range) started ~9,500 threads, exhausting the process
    limit, and did not exit. The bound is the cores this process may use, from the flag or the env."""
    import torch

    from trtspec.limits import cpu_cores

    cores, threads = cpu_cores(), torch.get_num_threads()
    expected = f"must be an integer in [1, {cores}] (the CPU cores this process may use), got {cores + 1}"
    try:
        assert_one_line_error(trtspec("--threads", cores + 1, "run", "--help"), f"--threads {expected}")
        result = CliRunner().invoke(cli, ["run", "--help"], env={"TRTSPEC_THREADS": str(cores + 1), "TRTSPEC_DEBUG": None})
        assert_one_line_error(SimpleNamespace(returncode=result.exit_code, stdout=result.stdout_bytes,
                                              stderr=result.stderr_bytes), f"TRTSPEC_THREADS {expected}")
        assert_one_line_error(trtspec("--threads", "0", "run", "--help"), "--threads must be an integer in [1, ")
        assert trtspec("--threads", cores, "run", "--help").returncode == 0
    finally:
        torch.set_num_threads(threads)


# --- fuzz ------------------------------------------------------------------------------------------

BAD_VALUES = {
    "int": st.sampled_from([-1, -64, 1.5, "64", [64], {"n": 64}, True, ""]),
    "real": st.sampled_from([-1e-6, -1e6, "1e6", [1.0], {"x": 1}, True, float("inf"), float("nan")]),
    "bool": st.sampled_from(["yes", 1, [], {}, "true"]),
    "object": st.sampled_from([[], "x", 5, [{"a": 1}]]),
}
TARGET_FIELDS = {**{f: "int" for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                       "num_attention_heads", "num_key_value_heads", "head_dim",
                                       "max_position_embeddings")},
                 "rope_theta": "real", "rms_norm_eps": "real", "tie_word_embeddings": "bool",
                 "attention_bias": "bool", "rope_scaling": "object"}
DRAFTER_FIELDS = {**TARGET_FIELDS, "block_size": "int", "num_target_layers": "int",
                  "dflash_config": "object", "dflash_config.mask_token_id": "int"}
LABEL_FIELDS = {(0, "cycle_cost_s.8"): "real", (0, "ar_token_s"): "real", (0, "vocab_size"): "int",
                (0, "cycle_cost_s"): "object", (1, "prompt_tokens"): "int", (1, "runs.4.cycles"): "int",
                (2, "runs.8.decode_s"): "real", (1, "runs"): "object", (3, "runs.1"): "object"}
POLICY_FIELDS = {"inputs": "int", "hidden": "int"}
FLAGS = [("run", "P", "--temperature"), ("run", "P", "--top-p"), ("run", "P", "--max-new-tokens"),
         ("run", "P", "--seed"), ("run", "P", "--top-k"), ("run", "P", "--block-size"),
         ("preflight", "--block-size"), ("bench", "--limit"), ("generate-data", "--prompts", "P", "-o", "OUT",
                                                                 "--limit"),
         ("train-drafter", "--data", "P", "-o", "OUT", "--block-size")]
BAD_FLAG_VALUES = st.sampled_from(["-1", "0", "nan", "-inf", "1e400", "²", "1_0", "x", str(2**64), "-0.5",
                                   "65", "", " "])

cases = st.one_of(
    st.tuples(st.just("target"), st.sampled_from(sorted(TARGET_FIELDS))),
    st.tuples(st.just("drafter"), st.sampled_from(sorted(DRAFTER_FIELDS))),
    st.tuples(st.just("labels"), st.sampled_from(sorted(LABEL_FIELDS))),
    st.tuples(st.just("policy"), st.sampled_from(sorted(POLICY_FIELDS))),
    st.tuples(st.just("flag"), st.sampled_from(FLAGS)),
)


def _expected_bad(flag: str, value: str) -> bool:
    """Whether a flag value is out of its documented range (a few fuzzed values are valid for some flags)."""
    try:
        number = float(value)
    except ValueError:
        return True
    if flag == "--temperature":
        return not number >= 0 or number == float("inf")
    if flag == "--top-p":
        return not 0 < number <= 1
    if flag in ("--top-k", "--seed"):  # top-k -1 is off (vLLM's)
        return value.strip() in ("-1", "nan", "-inf", "1e400", "-0.5", str(2**64)) and (flag, value) != ("--top-k", "-1")
    return not (value.strip().isascii() and value.strip().isdigit()) or int(value) < (2 if "block" in flag else 1) \
        or (flag == "--block-size" and int(value) > 64)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases, value=st.data())
def test_fuzzed_bad_inputs_give_one_line(case, value, target_dir, drafter_dir, blockpilot, prompt_file,
                                         tmp_path_factory):
    kind, what = case
    work = tmp_path_factory.mktemp("fuzz")
    labels, policy = _copy(blockpilot, work)
    target, drafter = work / "target", work / "drafter"
    shutil.copytree(target_dir, target)
    shutil.copytree(drafter_dir, drafter)
    out = work / "out"
    if kind == "flag":
        bad = value.draw(BAD_FLAG_VALUES)
        if not _expected_bad(what[-1], bad):
            return
        args = [prompt_file if a == "P" else out if a == "OUT" else a for a in what] + [bad]
        if what[0] in ("run", "preflight"):
            args += ["--target", target, "--drafter", drafter]
    elif kind in ("target", "drafter"):
        fields = TARGET_FIELDS if kind == "target" else DRAFTER_FIELDS
        _edit(target if kind == "target" else drafter, "config.json", _set(what, value.draw(BAD_VALUES[fields[what]])))
        args = ["run", prompt_file, "--target", target, "--drafter", drafter, "--max-new-tokens", 2]
    elif kind == "labels":
        row, field = what
        _edit_labels(labels, row, _set(field, value.draw(BAD_VALUES[LABEL_FIELDS[what]])))
        args = ["train-policy", labels, "-o", out, "--steps", 2]
    else:
        _edit(policy, "policy.json", _set(what, value.draw(BAD_VALUES[POLICY_FIELDS[what]])))
        args = ["eval-policy", "--policy", policy, "--labels", labels, "--json", out]
    before = digest(work)
    result = trtspec(*args)
    assert_one_line_error(result)
    assert not out.exists() and digest(work) == before, "a failed command wrote or changed files"

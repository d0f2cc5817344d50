"""`trtspec run` end to end through the real entry point, including every kind of bad input."""

import json
import subprocess
import sys

import pytest
from helpers import assert_one_line_error, trtspec, trtspec_in_process

from trtspec.api import Pipeline
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.schedule import BlockChoice




@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompt.txt"
    path.write_text("def add(a, b):\n")
    return path


@pytest.fixture(scope="module")
def spec_json(target_dir, drafter_dir, prompt_file):
    """One speculative `run --json` (B=8, 40 tokens), read by the tests of its format and of its tokens.
    In-process, as the other `run` checks that need no interpreter of their own; the entry point's
    subprocess tests: streaming below, SUBPROCESS_CASES, the debug switch, test_inputs.py."""
    spec = trtspec_in_process("run", prompt_file, "--target", target_dir, "--drafter", drafter_dir,
                              "--block-size", 8, "--max-new-tokens", 40, "--json")
    assert spec.returncode == 0, spec.stderr.decode()
    return json.loads(spec.stdout)


def test_json_output_holds_the_documented_fields(spec_json):
    result = spec_json
    stats = result["stats"]
    assert set(result) == {"text", "tokens", "stats"}
    assert set(stats) == {"block_size", "grow_to", "block_size_auto", "tau", "histogram", "ceiling_fraction",
                          "cycles", "grown_cycles", "copied_cycles", "draft_tokens", "turned_ar_at", "prompt_tokens",
                          "new_tokens", "finish_reason", "prefill_s", "decode_s", "decode_tokens_per_s", "queue_s",
                          "ttft_s", "batch_mean"}
    assert stats["block_size"] == "8" and len(stats["histogram"]) == 8
    assert stats["new_tokens"] == len(result["tokens"]) and 1 <= len(result["tokens"]) <= 40
    assert isinstance(result["text"], str)


def test_ar_run_returns_the_speculative_runs_tokens(spec_json, target_dir, prompt_file):
    """Greedy `--ar` is the baseline speculation must equal, at block size 1 and tau 1."""
    ar = trtspec_in_process("run", prompt_file, "--target", target_dir, "--ar", "--max-new-tokens", 40, "--json")
    assert ar.returncode == 0, ar.stderr.decode()
    baseline = json.loads(ar.stdout)
    assert baseline["tokens"] == spec_json["tokens"] and baseline["text"] == spec_json["text"]
    assert baseline["stats"]["block_size"] == "AR" and baseline["stats"]["tau"] == 1.0


def test_run_compares_with_autoregressive_decoding(target_dir, drafter_dir, prompt_file):
    """The quick start's `--compare-ar`: the speed-up over AR through the same backend, and at T=0
    the proof that the two outputs are the same tokens."""
    result = trtspec_in_process("--threads", 1, "run", prompt_file, "--target", target_dir, "--drafter", drafter_dir,
                                "--json", "--max-new-tokens", 32, "--compare-ar")
    assert result.returncode == 0, result.stderr.decode()
    output = json.loads(result.stdout)
    comparison = output["compare_ar"]
    assert comparison["identical"] is True and comparison["ar_decode_tokens_per_s"] > 0
    assert comparison["speedup"] == pytest.approx(
        output["stats"]["decode_tokens_per_s"] / comparison["ar_decode_tokens_per_s"])


def test_run_takes_what_a_request_takes(target_dir, drafter_dir, prompt_file):
    """Issue 57, Build 6: one rule in every front end. `--block-size 1` is AR, as a request's
    block_size 1 and `serve --block-size 1` are; `--top-k -1` is off, as a request's top_k -1 is
    (vLLM's); an unasked --max-new-tokens is capped at the context (an asked one that does not fit
    is refused: test_bad_input_gives_one_clear_line)."""
    def run(*args):
        result = trtspec_in_process("run", prompt_file, "--target", target_dir, "--drafter", drafter_dir, "--json",
                                    "--max-new-tokens", 12, *args)
        assert result.returncode == 0, result.stderr.decode()
        return json.loads(result.stdout)

    ar = run("--ar")
    assert run("--block-size", 1)["tokens"] == ar["tokens"] and run("--block-size", "AR")["stats"]["block_size"] == "AR"
    sampled = ("--temperature", 1, "--seed", 7)
    assert run(*sampled, "--top-k", -1)["tokens"] == run(*sampled, "--top-k", 0)["tokens"]
    capped = trtspec_in_process("run", prompt_file, "--target", target_dir, "--drafter", drafter_dir, "--json",
                                "--max-context", 16)
    assert capped.returncode == 0 and json.loads(capped.stdout)["stats"]["finish_reason"] == "length"


def test_a_streamed_run_keeps_its_stats_off_stdout(target_dir, drafter_dir, prompt_file):
    """stdout holds only the text (a pipe gets the answer), stderr the stats: one subprocess shows both.
    The entry point in its own process, the prompt on stdin; the JSON form of the same run in-process."""
    args = ("--target", target_dir, "--drafter", drafter_dir, "--max-new-tokens", 30)
    streamed = trtspec("run", "-", *args, stdin=prompt_file.read_bytes())
    assert streamed.returncode == 0, streamed.stderr.decode()
    as_json = json.loads(trtspec_in_process("run", prompt_file, *args, "--json").stdout)
    assert streamed.stdout.decode() == as_json["text"] + "\n"
    assert "tau" in streamed.stderr.decode() and "B=16" in streamed.stderr.decode()


def test_a_stop_token_id_ends_the_output_at_it(target_dir, drafter_dir, prompt_file):
    plain = json.loads(trtspec_in_process("run", prompt_file, "--target", target_dir, "--drafter", drafter_dir,
                                          "--json", "--max-new-tokens", 30).stdout)
    stop = plain["tokens"][4]
    stopped = trtspec_in_process("run", prompt_file, "--target", target_dir, "--drafter", drafter_dir, "--json",
                                 "--max-new-tokens", 30, "--stop-token-id", stop)
    tokens = json.loads(stopped.stdout)["tokens"]
    assert tokens == plain["tokens"][:plain["tokens"].index(stop) + 1]


def test_a_chat_run_exits_cleanly(target_dir, drafter_dir, prompt_file):
    chat = trtspec_in_process("run", prompt_file, "--target", target_dir, "--drafter", drafter_dir, "--chat",
                              "--json", "--max-new-tokens", 5)
    assert chat.returncode == 0, chat.stderr.decode()


def _bad_inputs(tmp, target_dir, drafter_dir, prompt_file):
    import shutil
    corrupt = tmp / "corrupt"
    shutil.copytree(target_dir, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 64)
    mismatched = tmp / "mismatched"
    shutil.copytree(drafter_dir, mismatched)
    config = json.loads((mismatched / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 9]
    (mismatched / "config.json").write_text(json.dumps(config))
    empty = tmp / "empty.txt"
    empty.write_text("")
    long = tmp / "long.txt"
    long.write_text("def add(a, b):\n    return a + b\n" * 20)
    latin1 = tmp / "latin1.txt"
    latin1.write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    common = ("--target", target_dir, "--drafter", drafter_dir)
    return {
        "missing target": (("run", prompt_file, "--target", tmp / "nope", "--drafter", drafter_dir),
                           "target directory not found"),
        "missing drafter": (("run", prompt_file, "--target", target_dir, "--drafter", tmp / "nope"),
                            "drafter directory not found"),
        "missing prompt": (("run", tmp / "nope.txt", *common), "prompt file not found"),
        "no drafter given": (("run", prompt_file, "--target", target_dir), "give --drafter"),
        "corrupt safetensors": (("run", prompt_file, "--target", corrupt, "--drafter", drafter_dir),
                                "cannot read"),
        "mismatched pair": (("run", prompt_file, "--target", target_dir, "--drafter", mismatched),
                            "out of range"),
        "empty prompt": (("run", empty, *common), "the prompt is empty"),
        "prompt longer than context": (("run", long, *common, "--max-context", 32), "the context holds 32"),
        "block size too large": (("run", prompt_file, *common, "--block-size", 65), "--block-size must be in [2, 64], got 65"),
        "block size zero": (("run", prompt_file, *common, "--block-size", 0), "--block-size must be in [2, 64], got 0"),
        "more tokens than the context": (("run", prompt_file, *common, "--max-new-tokens", 32, "--max-context", 16),
                                         "lower --max-new-tokens"),
        "negative temperature": (("run", prompt_file, *common, "--temperature", -0.5), "temperature must be"),
        "non-UTF-8 prompt": (("run", latin1, *common), "not valid UTF-8"),
        "bad top-p": (("run", prompt_file, *common, "--top-p", 0), "top-p must be"),
        "stop id out of range": (("run", prompt_file, *common, "--stop-token-id", 99999), "is not a token id"),
    }


CASES = ["missing target", "missing drafter", "missing prompt", "no drafter given", "corrupt safetensors",
         "mismatched pair", "empty prompt", "prompt longer than context", "block size too large",
         "block size zero", "more tokens than the context", "negative temperature", "non-UTF-8 prompt", "bad top-p",
         "stop id out of range"]


# Through the real entry point in a subprocess (interpreter start-up, exit status, stderr); the
# others through the same click command in-process, which raises anything that would be a traceback.
SUBPROCESS_CASES = {"missing target", "corrupt safetensors"}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_gives_one_clear_line(case, tmp_path, target_dir, drafter_dir, prompt_file):
    args, message = _bad_inputs(tmp_path, target_dir, drafter_dir, prompt_file)[case]
    invoke = trtspec if case in SUBPROCESS_CASES else trtspec_in_process
    assert_one_line_error(invoke(*args), message)


def test_debug_switch_shows_the_traceback(tmp_path, target_dir, drafter_dir):
    import os
    env = {**os.environ, "TRTSPEC_DEBUG": "1"}
    result = subprocess.run([sys.executable, "-m", "trtspec", "run", tmp_path / "nope.txt", "--target", target_dir,
                             "--drafter", drafter_dir], capture_output=True, env=env, timeout=300)
    assert result.returncode != 0 and b"Traceback" in result.stderr


def test_run_batch_decodes_a_file_of_prompts_together(target_dir, drafter_dir, prompt_file, tmp_path):
    prompts = ["def add(a, b):\n", "class Point:\n", "import os\n", "for i in range(3):\n"]
    batch = tmp_path / "prompts.jsonl"
    batch.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    result = trtspec_in_process("run", "--batch", batch, "--target", target_dir, "--drafter", drafter_dir,
                                "--block-size", 4, "--max-new-tokens", 20, "--max-running", 3)
    assert result.returncode == 0, result.stderr.decode()
    lines = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert len(lines) == len(prompts) and b"4 prompts" in result.stderr
    pipeline = Pipeline(target_dir, drafter_dir)
    for prompt, line in zip(prompts, lines):  # in the file's order, each equal to the prompt decoded alone
        alone = pipeline.generate(prompt, GenerationConfig(block=BlockChoice(4), max_new_tokens=20)).to_dict()
        assert line["tokens"] == alone["tokens"] and line["stats"]["histogram"] == alone["stats"]["histogram"]
    assert max(line["stats"]["batch_mean"] for line in lines) > 1.0


def test_bad_batch_arguments_are_one_line(target_dir, drafter_dir, prompt_file, tmp_path):
    """PROMPT_FILE or --batch, exactly one; --compare-ar compares one request, so never with --batch."""
    batch = tmp_path / "prompts.jsonl"
    batch.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n")
    for args, message in ((("--batch", batch, prompt_file), "give one PROMPT_FILE, or --batch"),
                          (("--batch", batch, "--compare-ar"), "--compare-ar compares one request"),
                          ((), "give one PROMPT_FILE, or --batch")):
        assert_one_line_error(trtspec_in_process("run", *args, "--target", target_dir, "--drafter", drafter_dir),
                              message)

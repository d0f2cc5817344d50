"""No output inside an input (issue 38): a file or directory output, a --work directory and a
sidecar file may not be an input, lie inside an input model directory (or the bundled models), or
share a path with another output of the same command. Every case here overwrote data with exit 0
(or gave a traceback) before.

Through the real CLI in-process: each command refuses before any work, so nothing is loaded.
"""

import json
import shutil

import pytest
from helpers import assert_one_line_error
from helpers import trtspec_in_process as cli

from trtspec.assets import ASSETS
from trtspec.fileio import MARKER


def snapshot(directory) -> dict:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def place(target_dir, drafter_dir, tmp_path):
    """Copies of the tiny pair as downloaded (no trtspec marker, which would refuse for its own
    reason) with a policy in the drafter, a prompts file, labels with their features sidecar, and
    a plain file."""
    shutil.copytree(target_dir, tmp_path / "tgt")
    shutil.copytree(drafter_dir, tmp_path / "drf")
    (tmp_path / "drf" / MARKER).unlink(missing_ok=True)
    (tmp_path / "drf" / "blockpilot").mkdir(exist_ok=True)
    (tmp_path / "drf" / "blockpilot" / "policy.json").write_text('{"choices": ["4"]}')
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "def f():"}) + "\n")
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "def f():", "response": " pass"}) + "\n")
    (tmp_path / "labels.jsonl").write_text("{}\n")
    (tmp_path / "labels.features.safetensors").write_bytes(b"features")
    (tmp_path / "a-file").write_text("not a directory")
    return tmp_path


def _cases(t):
    pair = ("--target", t / "tgt", "--drafter", t / "drf")
    train = ("train-drafter", "--target", t / "tgt", "--data", t / "d.jsonl", "--block-size", 4)
    expand = ("expand-block", *pair, "--to", 20, "--data", t / "d.jsonl")
    return {
        # file outputs inside a directory input
        "data over the target's weights": (("generate-data", "--target", t / "tgt", "--prompts", t / "p.jsonl",
                                            "-o", t / "tgt" / "model.safetensors"), "inside the input"),
        "bench json over the drafter's weights": (("bench", *pair, "--json", t / "drf" / "model.safetensors"),
                                                  "inside the input"),
        "bench json over the drafter's policy": (("bench", *pair, "--json", t / "drf" / "blockpilot" / "policy.json"),
                                                 "inside the input"),
        "preflight json over the target's config": (("preflight", *pair, "--json", t / "tgt" / "config.json"),
                                                    "inside the input"),
        # a file input protects the model directory holding it
        "json beside an input policy, in its drafter": (("bench", "--policy", t / "drf" / "blockpilot",
                                                         "--json", t / "drf" / "notes.json"),
                                                        "the model directory holding the input"),
        "data beside its prompts, in a model directory": (("generate-data", "--target", t / "tgt", "--prompts",
                                                           t / "tgt" / "p.jsonl", "-o", t / "tgt" / "data.jsonl"),
                                                          "inside the input"),
        # the bundled models are an input of every command
        "bench json into the bundled drafter": (("bench", "--json", ASSETS / "demo-b16" / "model.safetensors"),
                                                "bundled models"),
        "data into the bundled target": (("generate-data", "--prompts", t / "p.jsonl",
                                          "-o", ASSETS / "demo-target" / "out.jsonl"), "bundled models"),
        # a sidecar input: the labels' features file
        "eval json over the labels' features": (("eval-policy", "--policy", t / "drf" / "blockpilot", "--labels",
                                                 t / "labels.jsonl", "--json", t / "labels.features.safetensors"),
                                                "also an input"),
        # directory outputs and work directories inside an input
        "engine inside its target": (("build", *pair, "--block-sizes", 4, "-o", t / "tgt" / "engine"),
                                     "inside the input"),
        "counts inside their target": (("draft-vocab", "--target", t / "tgt", "--data", t / "d.jsonl",
                                        "-o", t / "tgt" / "draft_vocab"), "inside the input"),
        "training work inside the target": ((*train, "-o", t / "out", "--work", t / "tgt" / "work"),
                                            "inside the input"),
        "expansion work inside the drafter": ((*expand, "-o", t / "out", "--work", t / "drf" / "work"),
                                              "inside the input"),
        # outputs of one command that collide
        "json and plot at one path": (("preflight", *pair, "--json", t / "x.png", "--plot", t / "x.png"),
                                      "given for two outputs"),
        "training work inside the output": ((*train, "-o", t / "out", "--work", t / "out" / "work"),
                                            "is inside the output"),
        # --work naming a file: one line, not a traceback
        "training work that is a file": ((*train, "-o", t / "out", "--work", t / "a-file"), "is not a directory"),
        "expansion work that is a file": ((*expand, "-o", t / "out", "--work", t / "a-file"), "is not a directory"),
    }


CASES = list(_cases(ASSETS))


@pytest.mark.parametrize("case", CASES)
def test_an_output_inside_an_input_is_refused_naming_both(case, place):
    args, message = _cases(place)[case]
    before, bundled = snapshot(place), snapshot(ASSETS)
    result = cli(*args)
    assert_one_line_error(result, message)
    assert str(args[-1]) in result.stderr.decode()  # the output is named (the input is, by the message)
    assert snapshot(place) == before and snapshot(ASSETS) == bundled


def test_outputs_beside_inputs_and_default_work_directories_are_still_accepted(place):
    """The rule does not catch what it should not: an output next to a plain prompts file, and a
    drafter's default OUTPUT.work beside it (checked, not refused)."""
    from trtspec.fileio import check_distinct_outputs, check_output_file, check_work_dir

    assert check_output_file(place / "data.jsonl", (place / "p.jsonl", place / "tgt")) == place / "data.jsonl"
    assert check_work_dir(place / "out.work", (place / "tgt", place / "d.jsonl")) == place / "out.work"
    check_distinct_outputs(place / "out", place / "out.work", None)


# --- bundled names ------------------------------------------------------------------------------------------------

def test_a_local_directory_with_a_bundled_name_wins(target_dir, drafter_dir, tmp_path, monkeypatch):
    """`--target demo-target` with ./demo-target in the current directory is that directory, not
    the bundled model that shadowed it (and then implies no bundled drafter); likewise a drafter."""
    from trtspec.assets import resolve_drafter, resolve_target

    monkeypatch.chdir(tmp_path)
    assert resolve_target("demo-target") == ASSETS / "demo-target"  # nothing local yet: the bundled one
    shutil.copytree(target_dir, tmp_path / "demo-target")
    shutil.copytree(drafter_dir, tmp_path / "demo-b16")
    assert resolve_target("demo-target").resolve() == tmp_path / "demo-target"
    assert resolve_drafter(None, "demo-target") is None  # a local target implies no bundled drafter
    assert resolve_drafter("demo-b16", "demo-target").resolve() == tmp_path / "demo-b16"
    assert resolve_target(None) == ASSETS / "demo-target" and resolve_drafter(None, None) == ASSETS / "demo-b16"

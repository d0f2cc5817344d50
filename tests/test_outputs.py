"""Outputs: a command replaces only its own previous output, checks every output path before any
work, and stages under unique names that no exit path leaves behind.

Through the real CLI: click's CliRunner in-process where the command refuses before any work
(fast), a subprocess where signals or a real build are involved.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import assert_one_line_error
from helpers import trtspec_in_process as cli

from trtspec.fileio import MARKER, atomic_write_text
from trtspec.engines.manifest import checkpoint_sha256, read_manifest


def snapshot(directory) -> dict:
    """Every file below `directory` with its contents: what must survive a refused command."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def hidden_siblings(path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


@pytest.fixture
def engine(ort_engine_dir, tmp_path):
    copy = tmp_path / "engine"
    shutil.copytree(ort_engine_dir, copy)
    return copy


# --- the three data-loss cases of issue 15 (each destroyed data before the fix) ----------------------------------

def test_triton_repo_into_the_current_directory_keeps_its_files(engine, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("the user's own file")
    shutil.copytree(engine, work / "eng")
    before = snapshot(work)
    monkeypatch.chdir(work)
    assert_one_line_error(cli("triton-repo", "--engine", "eng", "-o", "."), "current directory")
    assert snapshot(work) == before


def test_triton_repo_over_its_own_engine_keeps_the_engine(engine):
    before = snapshot(engine)
    assert_one_line_error(cli("triton-repo", "--engine", engine, "-o", engine), "also an input")
    assert snapshot(engine) == before
    read_manifest(engine)


def test_build_over_its_source_checkpoint_refuses_before_loading_it(target_dir, drafter_dir, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(target_dir, target)
    before = snapshot(target)
    began = time.monotonic()
    assert_one_line_error(cli("build", "--target", target, "--drafter", drafter_dir, "--block-sizes", 4,
                              "--backend", "onnxruntime", "-o", target), "also an input")
    assert time.monotonic() - began < 5  # refused before any export
    assert snapshot(target) == before and checkpoint_sha256(target) == checkpoint_sha256(target_dir)
    assert hidden_siblings(target) == []


# --- what may be replaced -----------------------------------------------------------------------------------------

def _refusals(tmp, engine):
    foreign = tmp / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"\xff\xd8 a cat")
    a_file = tmp / "a-file"
    a_file.write_text("not a directory")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f():"}) + "\n")
    return {
        "foreign directory": (("triton-repo", "--engine", engine, "-o", foreign), "not a previous trtspec"),
        "output of another kind": (("triton-repo", "--engine", engine, "-o", tmp / "other-engine"),
                                   "is a trtspec engine directory, not a Triton model repository"),
        "a parent of the input": (("triton-repo", "--engine", engine, "-o", tmp), "holds the input"),
        "inside an engine": (("triton-repo", "--engine", engine, "-o", engine / "repo"), "inside the engine directory"),
        "a file where a directory goes": (("triton-repo", "--engine", engine, "-o", a_file), "is not a directory"),
        "policy over a foreign directory": (("train-policy", tmp / "missing.jsonl", "-o", foreign),
                                            "not a previous trtspec BlockPilot policy"),
        "drafter over its data": (("train-drafter", "--data", prompts, "--block-size", 4, "-o", prompts),
                                  "also an input"),
        "drafter into the current directory": (("train-drafter", "--data", prompts, "--block-size", 4, "-o", "."),
                                               "current directory"),
        # single files: checked before the model is even looked for (the engine below does not exist)
        "json into a directory": (("bench", "--engine", tmp / "no-engine", "--json", foreign), "is a directory"),
        "json onto a device": (("bench", "--engine", tmp / "no-engine", "--json", "/dev/full"),
                               "not a regular file"),
        "json below a file": (("eval-policy", "--policy", tmp / "no-policy", "--labels", tmp / "no.jsonl",
                               "--json", a_file / "report.json"), "is not a directory"),
        "labels without .jsonl": (("label-blocks", "--engine", tmp / "no-engine", "--prompts", prompts,
                                   "-o", tmp / "labels.txt"), "*.jsonl"),
        "data over its prompts": (("generate-data", "--prompts", prompts, "-o", prompts), "also an input"),
        "plot that is not a PNG": (("preflight", "--engine", tmp / "no-engine", "--plot", tmp / "plot.pdf"), "*.png"),
        # issue 57, Build 5: an empty path wrote nothing and said nothing (--json ''), or named the current
        # directory ("it is a directory"); refused in one line by every output option
        "empty preflight --json": (("preflight", "--engine", tmp / "no-engine", "--json", ""), "--json is empty"),
        "empty preflight --plot": (("preflight", "--engine", tmp / "no-engine", "--plot", ""), "--plot is empty"),
        "empty bench --json": (("bench", "--engine", tmp / "no-engine", "--json", " "), "--json is empty"),
        "empty eval-policy --json": (("eval-policy", "--policy", tmp / "no-policy", "--labels", tmp / "no.jsonl",
                                      "--json", ""), "--json is empty"),
        "empty generate-data -o": (("generate-data", "--prompts", prompts, "-o", ""), "output path is empty"),
        "empty label-blocks -o": (("label-blocks", "--engine", tmp / "no-engine", "--prompts", prompts, "-o", ""),
                                  "--output is empty"),
        "empty build -o": (("build", "--block-sizes", 4, "-o", ""), "--output is empty"),
        "empty triton-repo -o": (("triton-repo", "--engine", engine, "-o", ""), "--output is empty"),
        "empty train-drafter -o": (("train-drafter", "--data", prompts, "--block-size", 4, "-o", ""), "path is empty"),
        "empty --ray-config": (("serve", "--replicas", 1, "--ray-config", ""), "--ray-config is empty"),
    }


REFUSALS = ["foreign directory", "output of another kind", "a parent of the input", "inside an engine",
            "a file where a directory goes", "policy over a foreign directory", "drafter over its data",
            "drafter into the current directory",
            "json into a directory", "json onto a device", "json below a file", "labels without .jsonl",
            "data over its prompts", "plot that is not a PNG", "empty preflight --json", "empty preflight --plot",
            "empty bench --json", "empty eval-policy --json", "empty generate-data -o", "empty label-blocks -o",
            "empty build -o", "empty triton-repo -o", "empty train-drafter -o", "empty --ray-config"]


@pytest.mark.parametrize("case", REFUSALS)
def test_outputs_that_would_destroy_or_fail_are_refused_before_any_work(case, engine, tmp_path, monkeypatch):
    shutil.copytree(engine, tmp_path / "other-engine")
    args, message = _refusals(tmp_path, engine)[case]
    if case == "drafter into the current directory":
        monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    assert_one_line_error(cli(*args), message)
    assert snapshot(tmp_path) == before  # nothing written, nothing removed, no temporary left


def test_a_link_into_a_missing_directory_is_refused_not_written_through(tmp_path, monkeypatch, target_dir,
                                                                           drafter_dir):
    """Issue 57, Build 5: `-o link.json`, the link dangling into a directory that does not exist, made
    that directory and wrote through the link. Missing directories are made only along the path as
    given; through a dangling link the output is refused."""
    monkeypatch.chdir(tmp_path)
    os.symlink(tmp_path / "missing" / "deploy.json", "link.json")
    os.symlink(tmp_path / "gone", "linked-dir")
    serve = ("serve", "--target", target_dir, "--drafter", drafter_dir, "--replicas", 1, "--ray-config")
    for output in ("link.json", "linked-dir/deploy.json"):
        assert_one_line_error(cli(*serve, output), "is a symbolic link", "create it")
    assert not (tmp_path / "missing").exists() and not (tmp_path / "gone").exists()
    (tmp_path / "missing").mkdir()  # the link's directory exists: written through the link, which stays
    assert cli(*serve, "link.json").returncode == 0
    assert os.path.islink("link.json") and json.loads((tmp_path / "missing" / "deploy.json").read_text())
    assert cli(*serve, "new/deploy.json").returncode == 0  # along the path given


def test_a_previous_output_of_the_same_kind_is_replaced(engine, tmp_path):
    repo = tmp_path / "repo"
    empty = tmp_path / "empty"
    empty.mkdir()
    for output in (repo, repo, empty):  # new, then its own previous output, then an empty directory
        result = cli("triton-repo", "--engine", engine, "-o", output, "--name", "again")
        assert result.returncode == 0, result.stderr.decode()
        assert sorted(p.name for p in output.iterdir()) == [MARKER, "again", "again_stream"]
    assert hidden_siblings(repo) == [] and hidden_siblings(empty) == []


# --- staging: signals, killed runs, unique temporary names --------------------------------------------------------

def _build_until_staging(target_dir, drafter_dir, output) -> tuple[subprocess.Popen, list[str]]:
    """Start a real `trtspec build` and wait until it is filling its staging directory."""
    process = subprocess.Popen([sys.executable, "-m", "trtspec", "build", "--target", target_dir, "--drafter",
                                drafter_dir, "--block-sizes", "4", "--backend", "onnxruntime", "-o", output],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (staging := hidden_siblings(output)):
        assert process.poll() is None, process.stderr.read().decode()
        assert time.monotonic() < deadline, "the build never started staging"
        time.sleep(0.05)
    return process, staging


def test_sigterm_during_build_leaves_no_staging_directory(target_dir, drafter_dir, tmp_path):
    output = tmp_path / "engine"
    process, staging = _build_until_staging(target_dir, drafter_dir, output)
    assert staging[0].startswith(".engine.trtspec-staging.")
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 128 + signal.SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no staging directory, no half engine


def test_a_signal_during_an_import_waits_for_the_import(tmp_path):
    """SIGTERM while staging raises an exception where the program is; inside a native module's
    initialisation (a build imports onnx lazily) that crashed the process (SIGSEGV, about one build
    in twenty). So a signal that lands mid-import is taken again once the import is done."""
    (tmp_path / "slow_import.py").write_text("import os, signal, time\n"
                                             "os.kill(os.getpid(), signal.SIGTERM)\n"
                                             "time.sleep(0.3)\n"
                                             "print('imported', flush=True)\n")
    output = tmp_path / "out"
    script = (f"import sys, time; sys.path.insert(0, {str(tmp_path)!r})\n"
              "from trtspec.fileio import DRAFT_VOCAB, staged_directory\n"
              f"with staged_directory({str(output)!r}, DRAFT_VOCAB):\n"
              "    import slow_import\n"
              "    time.sleep(10)\n"
              "print('finished')\n")
    result = subprocess.run([sys.executable, "-B", "-c", script], capture_output=True, timeout=60)  # -B: no __pycache__
    assert result.returncode == 128 + signal.SIGTERM, result.stderr.decode()
    assert result.stdout.decode().split() == ["imported"]  # the import completed; the work after it did not
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slow_import.py"]  # no staging directory, no output


def test_a_killed_runs_staging_directory_is_removed_by_the_next_run(target_dir, drafter_dir, engine, tmp_path):
    output = tmp_path / "out"
    process, staging = _build_until_staging(target_dir, drafter_dir, output)
    process.kill()  # SIGKILL: nothing in the process can clean up
    process.wait(60)
    assert hidden_siblings(output) == staging and not output.exists()
    alive = tmp_path / f".out.trtspec-staging.{staging[0].split('.')[3]}.{os.getpid()}.abcdefgh"
    alive.mkdir()  # a concurrent writer that is still running (this process): left alone
    result = cli("triton-repo", "--engine", engine, "-o", output)
    assert result.returncode == 0, result.stderr.decode()
    assert hidden_siblings(output) == [alive.name]


def test_concurrent_writers_of_one_file_do_not_share_a_temporary(tmp_path):
    """Two writers of the same file (two runs with the same --json): with one fixed `.NAME.tmp`
    they wrote into and renamed each other's temporary file."""
    path = tmp_path / "report.json"
    errors, texts = [], {name: name * 200_000 for name in ("a", "b")}

    def write(name: str) -> None:
        try:
            for _ in range(20):
                atomic_write_text(path, texts[name])
        except Exception as exc:  # noqa: BLE001 - any failure of either writer fails the test below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(name,)) for name in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert path.read_text() in texts.values()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_failed_write_leaves_no_temporary(tmp_path):
    from trtspec.fileio import staged_file

    with pytest.raises(RuntimeError):
        with staged_file(tmp_path / "checkpoint.pt") as temporary:
            temporary.write_bytes(b"half a checkpoint")
            raise RuntimeError("disk went away")
    assert list(tmp_path.iterdir()) == []

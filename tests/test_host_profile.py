"""`trtspec bench --profile`: draft, verify and host time per cycle, native core vs the Python oracle."""

import json

import pytest
from helpers import trtspec_in_process


def test_profile_host_end_to_end(ort_engine_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def add(a, b):\n", "class Point:\n"]))
    out = tmp_path / "profile.json"
    result = trtspec_in_process("--threads", 1, "bench", "--engine", ort_engine_dir, "--prompts", prompts, "--block-sizes", "4,8",
                                "--max-new-tokens", 12, "--repeats", 1, "--profile", "--json", out)
    assert result.returncode == 0, result.stderr.decode()
    rows = json.loads(out.read_text())["host_profile"]
    assert [(r["block_size"], r["controller"]) for r in rows] == [
        (b, c) for b in (1, 4, 8) for c in ("python", "native")]
    for row in rows:
        assert row["identical_outputs"] == row["requests"] == 2  # both controllers decode the same tokens
        assert 0 < row["model_ms"] < row["cycle_ms"] and row["host_us"] > 0 and 0 < row["host_fraction"] < 1
        assert abs(row["draft_ms"] + row["verify_ms"] - row["model_ms"]) < 1e-6 + 1e-3 * row["model_ms"]
        assert row["verify_ms"] > 0 and (row["draft_ms"] == 0) == (row["block_size"] == 1)  # AR drafts nothing
    assert "native host time is" in result.stdout.decode() and "draft ms" in result.stdout.decode()


def test_profile_needs_a_built_engine(target_dir, drafter_dir):
    result = trtspec_in_process("bench", "--target", target_dir, "--drafter", drafter_dir, "--profile-host")  # the old name too
    stderr = result.stderr.decode()
    assert result.returncode == 1 and "Traceback" not in stderr and "--engine DIR" in stderr, stderr


def test_profile_runs_on_the_cached_engine_of_the_onnxruntime_backend(target_dir, drafter_dir, tmp_path,
                                                                      empty_cache):
    """No --engine: the backend that builds one on first use is as good (the default `auto` on a CPU)."""
    pytest.importorskip("onnxruntime", reason="the onnxruntime backend needs the [onnx] extra")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n")
    result = trtspec_in_process("--threads", 1, "bench", "--target", target_dir, "--drafter", drafter_dir,
                                "--prompts", prompts, "--block-sizes", 4, "--max-new-tokens", 8, "--repeats", 1, "--profile",
                                env={"TRTSPEC_CACHE": str(empty_cache), "TRTSPEC_BACKEND": "onnxruntime"})
    assert result.returncode == 0, result.stderr.decode()
    assert "building an ONNX Runtime engine" in result.stderr.decode() and "draft ms" in result.stdout.decode()

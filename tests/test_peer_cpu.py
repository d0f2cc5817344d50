"""The peer benchmark (scripts/peer_cpu.py) end to end on the suite's tiny pair: trtspec AR and
speculative and transformers `generate` measured for real, llama-cpp-python made absent (its import
blocked in the child process), so it is reported as skipped with the command that installs it."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from trtspec.device import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "peer_cpu.py"
# python -c BLOCK_LLAMA_CPP SCRIPT ARGS...: the script as its own process, `import llama_cpp` failing
BLOCK_LLAMA_CPP = ("import runpy, sys\nsys.modules['llama_cpp'] = None\nsys.argv = sys.argv[1:]\n"
                   "runpy.run_path(sys.argv[0], run_name='__main__')")


def test_peer_benchmark_measures_trtspec_and_transformers_and_skips_a_missing_llama_cpp(target_dir, drafter_dir,
                                                                                         tmp_path):
    out = tmp_path / "peer.json"
    args = ["--target", target_dir, "--drafter", drafter_dir, "--limit", "2", "--max-new-tokens", "8",
            "--repeats", "2", "--dtype", "float32", "--json", out]
    result = subprocess.run([sys.executable, "-c", BLOCK_LLAMA_CPP, SCRIPT, *map(str, args)],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr

    report = json.loads(out.read_text())
    systems = {s["name"]: s for s in report["systems"]}
    assert list(systems) == ["trtspec-ar", "trtspec-spec", "llama.cpp", "llama.cpp-lookup", "transformers"]
    for name in ("trtspec-ar", "trtspec-spec", "transformers"):
        ran = systems[name]
        assert ran["skipped"] is None and ran["tokens_per_s"] > 0 and ran["vs_llama.cpp"] is None
        assert [(c["repeat"], c["prompt"]) for c in ran["calls"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert all(c["new_tokens"] == 8 and c["seconds"] > 0 for c in ran["calls"])
    assert systems["trtspec-ar"]["prefill_tokens_per_s"] > 0 and systems["trtspec-ar"]["decode_tokens_per_s"] > 0
    assert systems["transformers"]["decode_tokens_per_s"] is None  # it times no prefill of its own
    assert systems["trtspec-spec"]["tau"] >= 1
    for name in ("llama.cpp", "llama.cpp-lookup"):  # one readable reason, naming what installs it
        assert "llama_cpp is not installed" in systems[name]["skipped"]
        assert "pip install 'llama-cpp-python" in systems[name]["skipped"] and not systems[name]["calls"]

    # float32: speculative output is AR's token for token, and so is transformers' on the same ids
    agreement = {(a["system"], a["reference"]): a for a in report["agreement"]}
    assert set(agreement) == {("trtspec-spec", "trtspec-ar"), ("transformers", "trtspec-ar")}
    for found in agreement.values():
        assert found["identical"] == found["prompts"] == 2 and found["unit"] == "token"

    table = result.stdout
    assert "trtspec speculative B=4" in table and "transformers generate (float32)" in table
    hint = "CMAKE_ARGS=" if "amx_tile" in cpu_flags() else "pip install"  # AMX's kernels miscompile: built without
    assert f"skipped llama.cpp, llama.cpp-lookup: llama_cpp is not installed: {hint}" in table
    assert "trtspec-spec vs trtspec-ar: identical output on 2/2 prompts" in table


def test_transformers_runs_in_its_own_dtype_when_asked(target_dir, drafter_dir, tmp_path, monkeypatch):
    """--transformers-dtype bfloat16 (issue 59's bar) while trtspec runs float32: the table names it.
    In-process (the script's main), so no second interpreter's imports."""
    spec = importlib.util.spec_from_file_location("peer_cpu", SCRIPT)
    peer_cpu = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "peer_cpu", peer_cpu)  # its dataclasses look their module up
    spec.loader.exec_module(peer_cpu)
    out = tmp_path / "peer.json"
    peer_cpu.main(list(map(str, ["--target", target_dir, "--drafter", drafter_dir, "--limit", "1", "--max-new-tokens",
                                 "4", "--repeats", "1", "--dtype", "float32", "--transformers-dtype", "bfloat16",
                                 "--systems", "trtspec-ar,transformers", "--json", out])))
    systems = {s["name"]: s for s in json.loads(out.read_text())["systems"]}
    assert systems["transformers"]["label"] == "transformers generate (bfloat16)"
    assert systems["transformers"]["tokens_per_s"] > 0

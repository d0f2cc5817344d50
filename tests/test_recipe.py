"""The shipped drafter's recipe (scripts/drafter/recipe.sh) end to end on the tiny pair: response
shards, training in chunks saved as committed parts, the held-out curve, the shipped drafter with
its BlockPilot policy, and a rerun that resumes instead of starting over."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trtspec.api import Pipeline
from trtspec.tokenizer import TextCodec
from trtspec.training.data import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def run_recipe(target_dir: Path, data: Path, work: Path, **overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TARGET": str(target_dir), "DATA": str(data), "WORK": str(work), "THREADS": "1",
           "SHARD_SIZE": "3", "MAX_NEW_TOKENS": "12", "STEPS": "6", "CHUNK_MINUTES": "5", "MASK": "3", "HELD_OUT": "3",
           "SAMPLED_EVERY": "2", "NUM_FEATURES": "2", "DRAFT_VOCAB": "40",
           "STUB_MODULES": "", "MORE_STUB_MODULES": "",  # three stub sets of five: each set's steps are alike
           "POLICY_PROMPTS": "3", "POLICY_SIZES": "4", "POLICY_TOKENS": "8", "POLICY_STEPS": "20", "INT4_POLICY": "0",
           "SHIP_TO": str(work.parent / "shipped"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **overrides}
    return subprocess.run(["bash", "scripts/drafter/recipe.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)


@pytest.mark.slow
def test_a_rerun_of_the_recipe_resumes_from_committed_state(target_dir, tmp_path):
    data, work = tmp_path / "data", tmp_path / "work"
    data.mkdir()
    codec = TextCodec(target_dir)
    texts = [f"def function_{i}(x):\n    return x + {i}" for i in range(9)]
    (data / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t, "prompt_ids": codec.encode(t)}) + "\n"
                                                for t in texts))
    stubs = {"stubs": [f'def function_{i}(x):\n    """Add {i}."""\n' for i in range(3)],
             "stubs-submodules": [f'def parse_{i}(s):\n    """Parse {i}."""\n' for i in range(6)],  # 3 the policy's
             "stubs-libraries": [f'def format_{i}(s):\n    """Format {i}."""\n' for i in range(3)]}  # all trained
    for name, stub_texts in stubs.items():
        (data / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": t, "prompt_ids": codec.encode(t)}) + "\n"
                                                    for t in stub_texts))
    first = run_recipe(target_dir, data, work)
    assert first.returncode == 0, first.stderr[-2000:]

    shards = sorted(p.name for p in (data / "responses").glob("shard-*"))
    assert shards == ["shard-0000.jsonl.gz", "shard-0001.jsonl.gz"]  # the last 3 prompts are the policy's
    manifest = json.loads((data / "responses" / "manifest.json").read_text())
    assert sum(s["prompts"] for s in manifest["shards"].values()) == 6
    assert [manifest["shards"][name]["temperature"] for name in shards] == [0.0, 1.0]  # every 2nd sampled
    assert all(0 <= shard["cpu_seconds"] and shard["backend"] == "torch-eager" for shard in manifest["shards"].values())
    for name in stubs:
        assert sorted(p.name for p in (data / f"responses-{name}").glob("shard-*")) == ["shard-0000.jsonl.gz"]
    trained = (work / "train.jsonl").read_text().splitlines()
    assert len(trained) == 3 + 3 + 3 + 3  # shard-0000 of the requests is held out; every stub shard trains
    prompts = [json.loads(line)["prompt"] for line in trained]
    assert [set(prompts[i:i + 3]) for i in (3, 6, 9)] == [set(stubs[name][:3]) for name in stubs]  # the sets in order
    held_out = {record["prompt"] for record in read_jsonl(data / "responses" / "shard-0000.jsonl.gz", ("prompt",))}
    assert not held_out & {json.loads(line)["prompt"] for line in trained}

    index = json.loads((data / "checkpoint" / "index.json").read_text())
    assert index["step"] == 6 and index["parts"]
    curve = [json.loads(line) for line in (data / "curve.jsonl").read_text().splitlines()]
    assert [point["step"] for point in curve] == [6]
    assert 1.0 <= curve[0]["tau"] <= 16 and sum(curve[0]["histogram"]) > 0 and curve[0]["draft_vocab"] == 40
    shipped = tmp_path / "shipped"
    assert (shipped / "config.json").is_file() and (shipped / "draft_vocab" / "counts.safetensors").is_file()
    config = json.loads((shipped / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["trtspec_lineage"]["draft_vocab"]["size"] == 40
    shipped_pair = Pipeline(target_dir, shipped)
    assert shipped_pair.draft_vocab_size == 40  # it drafts among the ids it was trained on
    labelled = [json.loads(line)["prompt"] for line in (work / "policy" / "prompts.jsonl").read_text().splitlines()]
    assert labelled == texts[-3:] and shipped_pair.policy is not None  # auto decides with the shipped policy
    labelled = [json.loads(line)["prompt"] for line in (work / "policy" / "stubs.jsonl").read_text().splitlines()]
    assert labelled == stubs["stubs-submodules"][-3:]  # held out of the fourth set's shards, though a set follows it
    # requests and stubs labelled greedy and sampled, so the policy tells a sampled request from a greedy one;
    # its inputs chosen by cross-validation
    policy = shipped_pair.policy
    assert policy.kinds[-1] == "sampled" and policy.info["labels"].count("(T=") == 4 and policy.info["ablation"]

    # A new machine: only the committed state (data/) is left. The rerun generates nothing, restores
    # the checkpoint from its parts and does not train again (the run had finished).
    for path in sorted(work.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    # and one shard decoded but cut off before its compression: the rerun compresses it, to the same bytes
    packed = data / "responses" / "shard-0001.jsonl.gz"
    original = packed.read_bytes()
    packed.with_suffix("").write_bytes(gzip.decompress(original))
    packed.unlink()
    shard_times = {str(p.relative_to(data)): p.stat().st_mtime_ns for p in data.glob("responses*/shard-*")
                   if p.name != "shard-0001.jsonl" or p.parent.name != "responses"}
    second = run_recipe(target_dir, data, work, SHIP_POLICY="0")  # the policy's steps ran above
    assert second.returncode == 0, second.stderr[-2000:]
    assert packed.read_bytes() == original and not packed.with_suffix("").exists()
    assert "shard-0001.jsonl.gz:" in first.stdout and "shard-0001.jsonl.gz:" not in second.stdout  # not decoded again
    assert {str(p.relative_to(data)): p.stat().st_mtime_ns for p in data.glob("responses*/shard-*")
            if p != packed} == shard_times
    assert "restored step 6" in second.stdout
    assert "| 1/6" in first.stderr and "| 1/6" not in second.stderr  # no training step was taken again
    assert [json.loads(line)["step"] for line in (data / "curve.jsonl").read_text().splitlines()] == [6, 6]

    # A new run (the recipe names a run by its data, start and options: here another horizon) does not
    # restore the committed run's checkpoint, which train-drafter would refuse to resume: it starts afresh.
    run = (work / "drafter-work" / "run").read_text().strip()
    assert "steps=6" in run
    fresh = tmp_path / "work-2"
    other = subprocess.run([sys.executable, "scripts/drafter/checkpoint.py", "restore", str(data / "checkpoint"),
                            str(fresh), "--run", run.replace("steps=6", "steps=4")], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    assert other.returncode == 0 and "starts afresh" in other.stdout, other.stderr
    assert not fresh.exists() or not any(fresh.iterdir())

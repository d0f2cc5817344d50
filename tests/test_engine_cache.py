"""`--backend auto`: an ONNX Runtime engine built on first use into the cache, reused after, and
decoding exactly what eager PyTorch decodes."""

import json
import subprocess

import pytest
from helpers import assert_one_line_error, trtspec_in_process

pytest.importorskip("onnxruntime", reason="the onnxruntime backend needs the [onnx] extra")


def _run(cache, *args, backend: str | None = None) -> subprocess.CompletedProcess:
    # backend None: not the suite's eager default but the CLI's own default
    return trtspec_in_process(*args, env={"TRTSPEC_CACHE": str(cache), "TRTSPEC_BACKEND": backend})


def _engines(cache) -> list:
    root = cache / "engines"
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []


def test_auto_keeps_one_sound_engine_per_pair_in_the_cache(target_dir, drafter_dir, tmp_path, empty_cache):
    """Built on first use, reused after, passed over for a block size it lacks, rebuilt when damaged,
    and decoding as eager does throughout: steps of one engine's life, so one build serves them."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def add(a, b):\n")
    cache = empty_cache
    request = ("--threads", 1, "run", prompt, "--target", target_dir, "--drafter", drafter_dir, "--block-size", 6,
               "--max-new-tokens", 24, "--json")
    first = _run(cache, *request)
    assert first.returncode == 0, first.stderr.decode()
    assert "building an ONNX Runtime engine" in first.stderr.decode()
    assert len(_engines(cache)) == 1

    again = _run(cache, *request)
    assert again.returncode == 0 and "using the ONNX Runtime engine built" in again.stderr.decode()
    assert "building" not in again.stderr.decode() and len(_engines(cache)) == 1

    eager = _run(cache, *request, backend="eager")
    assert eager.returncode == 0 and "engine" not in eager.stderr.decode()
    assert json.loads(eager.stdout)["tokens"] == json.loads(first.stdout)["tokens"] == json.loads(again.stdout)["tokens"]

    # B = 2 has no compiled form: auto decodes it eagerly rather than failing or building
    small = _run(cache, *request[:-5], "--block-size", 2, "--max-new-tokens", 8)
    assert small.returncode == 0 and "engine" not in small.stderr.decode() and len(_engines(cache)) == 1

    # a damaged entry made every later default run fail until the user deleted it: now it is rebuilt, saying so
    graph = next((cache / "engines" / _engines(cache)[0]).glob("*.onnx"))
    graph.write_bytes(graph.read_bytes()[:-1] + b"\0")  # one byte changed
    repaired = _run(cache, *request)
    assert repaired.returncode == 0, repaired.stderr.decode()
    err = repaired.stderr.decode()
    assert "is damaged, rebuilding it" in err and graph.name in err and "building an ONNX Runtime engine" in err
    assert json.loads(repaired.stdout)["tokens"] == json.loads(first.stdout)["tokens"] and len(_engines(cache)) == 1


def test_an_explicit_onnxruntime_backend_refuses_what_it_cannot_build(target_dir, drafter_dir, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("x = 1\n")
    alone = _run(tmp_path / "cache", "run", prompt, "--target", target_dir, "--backend", "onnxruntime")
    assert_one_line_error(alone, "--backend onnxruntime", "--drafter")
    bf16 = _run(tmp_path / "cache", "run", prompt, "--target", target_dir, "--drafter", drafter_dir,
                "--backend", "onnxruntime", "--dtype", "bfloat16")
    assert_one_line_error(bf16, "float32", "--dtype bfloat16")
    # a bad draft vocabulary is refused before a build is announced (or started)
    pair = ("run", prompt, "--target", target_dir, "--drafter", drafter_dir, "--backend", "onnxruntime")
    assert_one_line_error(_run(tmp_path / "cache", *pair, "--draft-vocab", 321), "at most the vocabulary size 320")
    assert_one_line_error(_run(tmp_path / "cache", *pair, "--draft-vocab", 24), "needs token counts")
    assert not (tmp_path / "cache").exists()


def test_the_cache_key_changes_with_the_drafters_shipped_policy(target_dir, drafter_dir, tmp_path):
    """The engine embeds the drafter's BlockPilot policy, so a new policy must not reuse an engine
    built with the old one."""
    import shutil

    from trtspec.blockpilot.policy import DRAFTER_POLICY_DIR, POLICY_CONFIG
    from trtspec.engine_cache import engine_key

    drafter = tmp_path / "drafter"
    shutil.copytree(drafter_dir, drafter)
    shutil.rmtree(drafter / DRAFTER_POLICY_DIR, ignore_errors=True)
    bare = engine_key(target_dir, drafter, (4, 8))
    assert engine_key(target_dir, drafter, (4, 8)) == bare and engine_key(target_dir, drafter, (4, 12)) != bare
    (drafter / DRAFTER_POLICY_DIR).mkdir()
    (drafter / DRAFTER_POLICY_DIR / POLICY_CONFIG).write_text('{"choices": ["8"]}')
    first = engine_key(target_dir, drafter, (4, 8))
    (drafter / DRAFTER_POLICY_DIR / POLICY_CONFIG).write_text('{"choices": ["12"]}')
    assert len({bare, first, engine_key(target_dir, drafter, (4, 8))}) == 3


def test_the_cache_key_changes_with_the_code_the_graphs_come_from(target_dir, drafter_dir, monkeypatch):
    """An upgrade that changes what the step graphs compute (or how fast) must not reuse engines
    built from the old graphs."""
    from trtspec.engine_cache import engine_key
    from trtspec.export import cache

    before = engine_key(target_dir, drafter_dir, (4, 8))
    monkeypatch.setattr(cache, "code_sha256", lambda: "other graph code")
    assert engine_key(target_dir, drafter_dir, (4, 8)) != before


@pytest.fixture
def unwritable(target_dir, drafter_dir, tmp_path):
    """A cache path that is a file, and a run request."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("x = 1\n")
    cache = tmp_path / "cache-is-a-file"
    cache.write_text("not a directory")
    return cache, ("run", prompt, "--target", target_dir, "--drafter", drafter_dir, "--max-new-tokens", 8, "--json")


def test_an_unwritable_cache_decodes_eagerly_under_auto(unwritable):
    cache, request = unwritable
    auto = _run(cache, *request)
    assert auto.returncode == 0, auto.stderr.decode()
    lines = auto.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in auto.stderr.decode(), lines  # one message (--json: stats on stdout)
    assert f"the engine cache {cache / 'engines'} cannot be written" in lines[0] and "decoding eagerly" in lines[0]
    eager = _run(cache, *request, backend="eager")
    assert json.loads(auto.stdout)["tokens"] == json.loads(eager.stdout)["tokens"]
    assert cache.read_text() == "not a directory"


def test_an_unwritable_cache_is_one_line_under_onnxruntime(unwritable):
    cache, request = unwritable
    assert_one_line_error(_run(cache, *request, "--backend", "onnxruntime"), "cannot be written", CACHE_FILE_HINT)
    assert cache.read_text() == "not a directory"


CACHE_FILE_HINT = "TRTSPEC_CACHE to a writable directory"

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from helpers import save_hf_target, save_random_drafter, train_tiny_drafter  # noqa: E402
from trtspec.export.cache import GRAPHS_DIR  # noqa: E402

torch.set_num_threads(1)  # tiny models: one thread is fastest and immune to a busy machine
# The CLI's default backend builds an ONNX Runtime engine of each new pair on first use; the suite
# tests eager unless a test names a backend (tests/test_engine_cache.py tests that default itself).
os.environ.setdefault("TRTSPEC_BACKEND", "eager")
# `--dtype auto` is bfloat16 on CPUs with AMX; the suite checks exactness in float32 on every machine
# (tests/test_dtype.py tests what auto means).
os.environ.setdefault("TRTSPEC_DTYPE", "float32")


# The files that take longest (seconds on a quiet 2-core machine, `--durations`), longest first. xdist
# hands each worker whole files (--dist=loadfile) in collection order, so these start first and the
# short files fill the end of the run instead of one long file running alone at the end.
LONGEST_FILES = ("test_default_pair.py", "test_engines.py", "test_recipe.py", "test_sampling.py", "test_ray.py",
                 "test_gpu_recipe.py", "test_engine.py", "test_weights_int4.py", "test_families.py", "test_outputs.py",
                 "test_training.py", "test_serve_door.py",
                 "test_serve.py", "test_triton.py", "test_policy.py", "test_gguf.py", "test_draft_vocab.py",
                 "test_decode.py", "test_cli.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept


@pytest.fixture(scope="session", autouse=True)
def suite_cache(tmp_path_factory) -> Path:
    """The suite's cache directory ($TRTSPEC_CACHE), never the user's, and one for all xdist workers
    of a run: a graph exported once (trtspec/export/cache.py) serves every later build of its pair."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "trtspec-cache"
    (root / GRAPHS_DIR).mkdir(parents=True, exist_ok=True)
    os.environ["TRTSPEC_CACHE"] = str(root)
    return root


@pytest.fixture
def empty_cache(tmp_path, suite_cache) -> Path:
    """A cache with no engines in it, for tests of building one on first use; its exported graphs
    are the suite's (what those tests check is the engine cache, not the export)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / GRAPHS_DIR).symlink_to(suite_cache / GRAPHS_DIR, target_is_directory=True)
    return cache


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory) -> Path:
    """A random two-layer Qwen3 written by transformers (4096 positions), with a trained BPE tokenizer
    and chat template."""
    return save_hf_target(tmp_path_factory.mktemp("ckpt") / "target", layers=2)


@pytest.fixture(scope="session")
def drafter_dir(target_dir, tmp_path_factory) -> Path:
    from trtspec.models import load_target
    return save_random_drafter(tmp_path_factory.mktemp("ckpt") / "drafter", load_target(target_dir))


@pytest.fixture(scope="session")
def trained_drafter_dir(target_dir, suite_cache) -> Path:
    """A drafter trained for the tiny target, shipping a BlockPilot policy (`helpers.train_tiny_drafter`):
    the suite's stand-in for a trained pair, where a test needs acceptance (high on
    `helpers.code_prompts`) or a drafter's own policy. Trained once per run, in the suite's cache,
    whichever xdist worker asks first (the tiny target is the same on every worker: seeded)."""
    from trtspec.fileio import file_sha256, take_turns

    directory = suite_cache / f"trained-drafter-{file_sha256(target_dir / 'model.safetensors')[:12]}"
    with take_turns(suite_cache / f".{directory.name}.lock"):
        if not (directory / "blockpilot" / "policy.json").is_file():
            staging = directory.with_name(directory.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)  # a worker that died while training it
            train_tiny_drafter(target_dir, staging / "drafter")
            (staging / "drafter").rename(directory)
    return directory


@pytest.fixture(scope="session")
def ort_engine_dir(target_dir, drafter_dir, tmp_path_factory) -> Path:
    """The tiny pair built into an ONNX Runtime engine at block sizes 4 and 8, its drafter in float32
    (the default rounds it to 8 bits: test_engines.py checks that build; a float draft graph is
    checked against eager drafting exactly)."""
    pytest.importorskip("onnxruntime", reason="the onnxruntime backend needs the [onnx] extra")
    from trtspec.build import BuildConfig, build_engine

    output = tmp_path_factory.mktemp("engines") / "ort"
    build_engine(target_dir, drafter_dir, output,
                 BuildConfig(block_sizes=(4, 8), backend="onnxruntime", draft_weights="float"), progress=False)
    return output

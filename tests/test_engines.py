"""Compiled step graphs: export, ONNX Runtime and torch.export engines, manifests, TensorRT profiles.

The tiny random pair from conftest is exported and built for real; every engine must reproduce
eager PyTorch (logits to float tolerance, greedy tokens exactly), and every damaged or foreign
engine directory must be refused with one clear line.
"""

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import (ar_of, assert_one_line_error, exported_graphs, generate, opened, save_random_drafter, single,
                     trtspec_in_process)

from trtspec.build import BuildConfig, build_engine
from trtspec.engines import tensorrt as trt_engine
from trtspec.errors import TrtspecError
from trtspec.export.bindings import DRAFT, IN_PLACE, TARGET, graph_specs
from trtspec.export.steps import DraftStep, TargetStep
from trtspec.engines.manifest import MANIFEST_FILE, read_manifest
from trtspec.models import load_drafter, load_target
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.schedule import BlockChoice

BLOCK_SIZES = (4, 8)


@pytest.fixture(scope="module")
def pair(target_dir, drafter_dir):
    target = load_target(target_dir)
    return target, load_drafter(drafter_dir, target)


@pytest.fixture(scope="module")
def ort_engine(ort_engine_dir):
    return ort_engine_dir  # built once per session in conftest, at BLOCK_SIZES


def _rows(cache, end):
    """Eager KVCache [layers, 1, heads, T, D] -> the graphs' [T, layers, heads, D] for positions < end."""
    return cache.k[:, 0, :, :end].permute(2, 0, 1, 3), cache.v[:, 0, :, :end].permute(2, 0, 1, 3)


def test_step_graphs_match_eager_for_a_batch_of_slots_over_a_stale_buffer(pair):
    """Two requests at different positions, in slots 2 and 0 of a buffer whose other entries are
    garbage: each row equals its own eager run (target: logits, features, new keys; draft: proposals
    from a left-padded context, and the new keys of its real context entries)."""
    target, drafter = pair
    layers = tuple(drafter.config.target_layer_ids)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(2, target.config.vocab_size, (n,), generator=generator) for n in (30, 23)]
    starts, slots, contexts = [22, 15], [2, 0], [(20, 29), (10, 15)]
    eager, caches = [], []
    with torch.inference_mode():
        for tokens in sequences:
            cache = target.new_cache(1, 64)
            eager.append(target(tokens[None], 0, cache, layers))
            caches.append(cache)
        width = (40, 3, *_rows(caches[0], 1)[0].shape[1:])
        buffer_k, buffer_v = torch.full(width, 9.0), torch.full(width, -9.0)
        for cache, start, slot in zip(caches, starts, slots):
            buffer_k[:start, slot], buffer_v[:start, slot] = _rows(cache, start)
        step = TargetStep(target, layers)
        tokens = torch.stack([seq[start:start + 8] for seq, start in zip(sequences, starts)])
        for past in (max(starts), 40):  # the valid prefix, and the whole fixed buffer
            logits, features, new_k, _ = step(tokens, torch.tensor(starts), torch.tensor(slots),
                                              buffer_k[:past], buffer_v[:past])
            logits = logits.view(*tokens.shape, -1)  # [batch x tokens, V]
            for row, ((want_logits, want_features), cache, start) in enumerate(zip(eager, caches, starts)):
                assert (logits[row] - want_logits[0, start:start + 8]).abs().max() < 1e-5
                assert (features[row] - want_features[0, start:start + 8]).abs().max() < 1e-5
                assert torch.allclose(new_k[row], _rows(cache, start + 8)[0][start:], atol=1e-6)

        mask = drafter.config.mask_token_id
        draft_buffer_k, draft_buffer_v = torch.full(width, 9.0), torch.full(width, -9.0)
        blocks, expected, wanted_keys, padded = [], [], [], torch.zeros(2, 9, features.shape[-1])
        for row, ((_, feats), seq, (first, end), slot) in enumerate(zip(eager, sequences, contexts, slots)):
            cache = drafter.new_cache(1, 64)
            block = torch.tensor([int(seq[end])] + [mask] * 7)
            drafter(feats[:, :first], block[None], first, cache)  # the drafter cache holds `first` positions
            draft_buffer_k[:first, slot], draft_buffer_v[:first, slot] = _rows(cache, first)
            expected.append(drafter(feats[:, first:end], block[None], end, cache)[0])
            wanted_keys.append(_rows(cache, end)[0][first:])
            padded[row, 9 - (end - first):] = feats[0, first:end]
            blocks.append(block)
        counts = torch.tensor([end - first for first, end in contexts])
        drafts, proposal_logits, new_k, _ = DraftStep(drafter)(padded, counts, torch.stack(blocks),
                                                               torch.tensor([end for _, end in contexts]),
                                                               torch.tensor(slots), draft_buffer_k[:29], draft_buffer_v[:29])
        assert drafts.tolist() == [logits.argmax(-1).tolist() for logits in expected]
        assert all(torch.allclose(got, want, atol=1e-5) for got, want in zip(proposal_logits, expected))
        for row, keys in enumerate(wanted_keys):
            assert torch.allclose(new_k[row, 9 - len(keys):], keys, atol=1e-6)


def test_build_writes_a_manifest_with_one_profile_per_block_size(ort_engine, pair):
    import onnx

    manifest = read_manifest(ort_engine)
    assert manifest.backend == "onnxruntime" and manifest.dtype == "float32"
    assert manifest.block_sizes == list(BLOCK_SIZES) and manifest.profiles[TARGET] == ["prefill", 1, 4, 8]
    assert [row["block_size"] for row in manifest.block_size_table()] == [4, 8]
    assert [row["draft_profile"] for row in manifest.block_size_table()] == [0, 1]
    assert {"target.onnx", "draft.onnx", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"} <= set(
        manifest.artifacts)
    assert manifest.check["max_abs_logit_diff"] < 1e-4
    assert [p["key"] for p in manifest.tensorrt_profiles[TARGET]] == ["prefill", 1, 4, 8]  # recorded on CPU too
    assert manifest.graphs[TARGET]["cache"] == IN_PLACE  # a float32 CPU engine's target: export/ort_target.py
    for graph, spec in manifest.specs().items():
        model = onnx.load(str(ort_engine / f"{graph}.onnx"), load_external_data=False)
        assert [i.name for i in model.graph.input] == [t.name for t in spec.inputs]
        assert [o.name for o in model.graph.output] == [t.name for t in spec.outputs]


def test_an_onnxruntime_cpu_engine_drafts_in_8_bits_by_default(target_dir, drafter_dir, ort_engine, pair, tmp_path):
    """--draft-weights auto: the drafter's matmuls as 8-bit MatMulNBits blocks (most of a small draft
    call's cost is reading its weights), the target's float32 and held to float32's self-check, so
    greedy output stays eager's token for token; a float draft (ort_engine) stays exact."""
    output = tmp_path / "engine"
    manifest = build_engine(target_dir, drafter_dir, output, BuildConfig(block_sizes=(4,), backend="onnxruntime"),
                            progress=False)
    assert manifest.graphs[DRAFT]["file"] == "draft.int8.onnx" and manifest.graphs[TARGET]["file"] == "target.onnx"
    assert manifest.weights["format"] == "int8" and manifest.weights["graph_bits"] == {DRAFT: 8}
    assert manifest.label == "onnxruntime int8 (draft)" and read_manifest(output).label == manifest.label
    assert manifest.check["target_max_abs_logit_diff"] < 1e-4 < manifest.check["draft_max_abs_logit_diff"]
    exact = read_manifest(ort_engine)
    assert exact.weights is None and exact.check["draft_max_abs_logit_diff"] < 1e-4
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 300, (n,), generator=generator).tolist() for n in (5, 30)]
    assert _greedy(opened(output, torch.device("cpu")), prompts, 4) == _greedy(single(*pair), prompts, 4)


def test_8_bit_drafts_need_an_onnxruntime_cpu_float32_build(target_dir, drafter_dir, tmp_path):
    assert_one_line_error(trtspec_in_process("build", "--target", target_dir, "--drafter", drafter_dir, "--backend",
                                             "torch", "--draft-weights", "int8", "-o", tmp_path / "e"),
                          "--draft-weights int8 is ONNX Runtime's MatMulNBits format")
    with pytest.raises(TrtspecError, match="--draft-weights int8 is ONNX Runtime's MatMulNBits format"):
        BuildConfig(block_sizes=(4,), backend="torch", draft_weights="int8")
    with pytest.raises(TrtspecError, match="--draft-weights int8 builds an ONNX Runtime engine for the CPU in float32"):
        build_engine(target_dir, drafter_dir, tmp_path / "e", BuildConfig(block_sizes=(4,), backend="onnxruntime",
                                                                          dtype="float16", draft_weights="int8"))
    assert not (tmp_path / "e").exists()


def _greedy(engine, prompts, block_size, tokens=24):
    return [generate(engine, prompt, GenerationConfig(block=BlockChoice(block_size), max_new_tokens=tokens)).tokens
            for prompt in prompts]


@pytest.mark.parametrize("block_size", [1, *BLOCK_SIZES])
def test_onnxruntime_greedy_equals_eager(ort_engine, pair, block_size):
    generator = torch.Generator().manual_seed(block_size)
    prompts = [torch.randint(2, 300, (n,), generator=generator).tolist() for n in (1, 5, 17, 40)]
    graph_engine = opened(ort_engine, torch.device("cpu"))
    if block_size == 1:
        graph_engine = ar_of(graph_engine)
    assert _greedy(graph_engine, prompts, block_size) == _greedy(single(*pair), prompts, block_size)


def test_ar_rows_beside_blocks_in_one_engine_call_decode_like_eager(ort_engine, pair):
    """AR and greedy B = 4 / B = 8 requests batched through the ONNX Runtime engine: the engine's
    verify calls hold AR rows padded beside wider blocks (the target graph's `computed`), and every
    request's tokens are what eager decoding gives it alone."""
    from trtspec.runtime.engine import EngineConfig, LocalEngine
    from trtspec.runtime.runner import BatchRunner

    runner = BatchRunner.open(ort_engine, torch.device("cpu"), slots=6)
    widths = []
    verify = runner.verify
    runner.verify = lambda slots, blocks, starts: (widths.append(sorted(len(b) for b in blocks)),
                                                   verify(slots, blocks, starts))[1]
    engine = LocalEngine(runner, config=EngineConfig(max_running=6))
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 300, (n,), generator=generator).tolist() for n in (3, 9, 17, 5, 30, 12)]
    configs = [GenerationConfig(block=BlockChoice(size), max_new_tokens=24) for size in (1, 4, 8, 1, 1, 4)]
    batched = engine.generate(prompts, configs)
    assert any(1 in lengths and max(lengths) > 1 for lengths in widths)  # AR rows did share calls with blocks
    eager = single(*pair)
    for prompt, config, generation in zip(prompts, configs, batched):
        assert generation.tokens == generate(eager, prompt, config).tokens


def test_torch_export_backend_equals_eager(target_dir, drafter_dir, pair, tmp_path, monkeypatch):
    """Also: opening the engine right after its build shares the programs the build's self-check
    loaded (same bytes, same device) instead of loading them again (seconds per graph)."""
    loads, real_load = [], torch.export.load
    monkeypatch.setattr(torch.export, "load",
                        lambda path, *args, **kwargs: loads.append(Path(path).name) or real_load(path, *args, **kwargs))
    output = tmp_path / "torch-engine"
    manifest = build_engine(target_dir, drafter_dir, output, BuildConfig(block_sizes=(4,), backend="torch"),
                            progress=False)
    assert {"target.pt2", "draft.pt2"} <= set(manifest.artifacts) and sorted(loads) == ["draft.pt2", "target.pt2"]
    prompts = [[5, 9, 33, 2, 7], [100]]
    assert _greedy(opened(output, torch.device("cpu")), prompts, 4) == _greedy(single(*pair), prompts, 4)
    assert len(loads) == 2


@pytest.mark.slow
def test_an_inductor_engine_decodes_like_eager(target_dir, drafter_dir, pair, tmp_path):
    """`trtspec build --backend inductor`: AOTInductor packages (C++ here) listed and hashed in the
    manifest; `trtspec run --engine` on it and a batch of mixed requests decode like eager PyTorch.
    A second build takes the compiled packages from the cache. One costly compile serves every check."""
    engine = tmp_path / "inductor"
    made = trtspec_in_process("--threads", 1, "build", "--target", target_dir, "--drafter", drafter_dir,
                              "--backend", "inductor", "--block-sizes", "4,8", "-o", engine)
    assert made.returncode == 0, made.stderr
    manifest = read_manifest(engine)
    assert manifest.backend == "inductor" and {"target.pt2", "draft.pt2"} <= set(manifest.artifacts)
    assert not any(name.endswith(".export.pt2") for name in manifest.artifacts)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def add(a, b):\n")
    runs = [trtspec_in_process("run", prompt, *source, "--block-size", 8, "--max-new-tokens", 20, "--json")
            for source in (("--engine", engine), ("--target", target_dir, "--drafter", drafter_dir))]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    assert json.loads(runs[0].stdout)["tokens"] == json.loads(runs[1].stdout)["tokens"]
    prompts = [[5, 9, 33, 2, 7], [100], [40, 41, 42, 43, 44, 45]]
    assert _greedy(opened(engine, torch.device("cpu")), prompts, 4) == _greedy(single(*pair), prompts, 4)
    began = time.monotonic()
    build_engine(target_dir, drafter_dir, tmp_path / "again", BuildConfig(block_sizes=(4,), backend="inductor"),
                 progress=False)
    assert time.monotonic() - began < 15  # nothing compiled again


def test_run_on_a_built_engine_decodes_like_eager(target_dir, drafter_dir, ort_engine, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def add(a, b):\n")
    common = ("--max-new-tokens", 20, "--json")
    eager = trtspec_in_process("run", prompt, "--target", target_dir, "--drafter", drafter_dir, "--block-size", 8, *common)
    built = trtspec_in_process("run", prompt, "--engine", ort_engine, "--block-size", 8, *common)
    assert eager.returncode == 0 and built.returncode == 0, built.stderr.decode()
    assert json.loads(built.stdout)["tokens"] == json.loads(eager.stdout)["tokens"]
    ar = trtspec_in_process("run", prompt, "--engine", ort_engine, "--ar", *common)
    assert json.loads(ar.stdout)["tokens"] == json.loads(eager.stdout)["tokens"]  # greedy spec == AR


def test_a_target_step_computes_only_the_computed_positions(pair):
    """A mixed call pads an AR row to the widest block; `computed` lists the real positions, whose
    features and keys must be what the whole padded computation gives them, with nothing computed
    at the padding (zeros there: no projection ran), and `scored` picks whose logits come back, in
    its order. Row 0 here is an AR row beside a 4-token block."""
    target, drafter = pair
    step = TargetStep(target, tuple(drafter.config.target_layer_ids))
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(2, target.config.vocab_size, (2, 4), generator=generator)
    starts, slots = torch.tensor([3, 6]), torch.tensor([0, 1])
    shape = (10, 2, target.config.num_hidden_layers, target.config.num_key_value_heads, target.config.head_dim)
    past_k, past_v = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    computed = torch.tensor([0, 4, 5, 6, 7])
    with torch.inference_mode():
        want_logits, want_features, want_k, want_v = step(tokens, starts, slots, past_k[:6], past_v[:6])
        logits, features, new_k, new_v = step(tokens, starts, slots, past_k[:6], past_v[:6], computed)
        last = step(tokens, starts, slots, past_k[:6], past_v[:6], computed, torch.tensor([4, 0]))[0]
    assert logits.shape == (5, want_logits.shape[-1]) and torch.allclose(logits, want_logits[computed], atol=1e-5)
    assert torch.allclose(last, want_logits[[7, 0]], atol=1e-5)  # each row's last position, in `scored`'s order
    real = [(0, slice(0, 1)), (1, slice(0, 4))]
    for got, want in ((features, want_features), (new_k, want_k), (new_v, want_v)):
        assert all(torch.allclose(got[row, where], want[row, where], atol=1e-5) for row, where in real)
        assert (got[0, 1:] == 0).all() and not (want[0, 1:] == 0).all()


def test_training_data_generated_through_an_engine_equals_eager(target_dir, ort_engine, tmp_path):
    """The drafter recipe's generation (scripts/drafter/generate.py) decodes through the cached engine
    where that is faster: its records must be eager's, token for token (greedy, float32)."""
    from trtspec.api import Pipeline
    from trtspec.training.data import generate_data, read_jsonl

    prompts = [{"prompt": p} for p in ("def add(a, b):\n", "class Stack:\n", "import os\n")]
    config = GenerationConfig(max_new_tokens=12)
    paths = [generate_data(pipeline.autoregressive(), prompts, config, tmp_path / f"{name}.jsonl", progress=False)
             for name, pipeline in (("engine", Pipeline(engine=ort_engine)), ("eager", Pipeline(target_dir)))]
    engine, eager = (read_jsonl(path, ("response_ids",)) for path in paths)
    assert engine == eager and all(len(record["response_ids"]) > 0 for record in eager)


def test_a_block_size_the_engine_lacks_is_one_line(ort_engine, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def add(a, b):\n")
    assert_one_line_error(trtspec_in_process("run", prompt, "--engine", ort_engine, "--block-size", 16),
                          "built for block sizes 4, 8")


def _damaged(source, tmp_path, how):
    engine = tmp_path / "engine"
    shutil.copytree(source, engine)
    manifest_path = engine / MANIFEST_FILE
    if how == "other manifest version":
        data = json.loads(manifest_path.read_text())
        data["manifest_version"], data["trtspec_version"] = 99, "9.9.9"
        manifest_path.write_text(json.dumps(data))
    elif how == "truncated graph":
        data = (engine / "target.onnx").read_bytes()
        (engine / "target.onnx").write_bytes(data[: len(data) // 2])
    elif how == "corrupted graph":
        data = bytearray((engine / "draft.onnx").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (engine / "draft.onnx").write_bytes(bytes(data))
    elif how == "missing graph":
        (engine / "draft.onnx").unlink()
    elif how == "no manifest":
        manifest_path.unlink()
    elif how == "manifest not JSON":
        manifest_path.write_text("{ half a manifest")
    return engine


@pytest.mark.parametrize("how, message", [
    ("other manifest version", "manifest version 99"),
    ("truncated graph", "truncated"),
    ("corrupted graph", "SHA-256"),
    ("missing graph", "draft.onnx is missing"),
    ("no manifest", "not an engine directory"),
    ("manifest not JSON", "not valid JSON"),
])
def test_damaged_engine_directories_are_refused(ort_engine, tmp_path, how, message):
    with pytest.raises(TrtspecError, match=message.replace("(", r"\(")):
        opened(_damaged(ort_engine, tmp_path, how), torch.device("cpu"))


def test_engine_from_other_checkpoints_is_refused_on_the_command_line(ort_engine, target_dir, pair, tmp_path):
    other = save_random_drafter(tmp_path / "other-drafter", pair[0], seed=7)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def add(a, b):\n")
    assert_one_line_error(trtspec_in_process("run", prompt, "--engine", ort_engine, "--target", target_dir,
                                             "--drafter", other), "built from another drafter checkpoint")
    assert_one_line_error(trtspec_in_process("run", prompt, "--engine", _damaged(ort_engine, tmp_path, "corrupted graph")),
                          "does not match its SHA-256")


def test_a_failed_build_leaves_nothing_that_looks_complete(target_dir, drafter_dir, ort_engine, tmp_path, monkeypatch,
                                                           tmp_path_factory):
    import trtspec.build

    def broken_export(*args, **kwargs):
        (args[-1]).write_bytes(b"half a graph")
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-export
    monkeypatch.setattr(trtspec.build, "export_onnx", broken_export)
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path_factory.mktemp("cache")))  # no cached graph to skip the export
    existing = tmp_path / "existing"
    shutil.copytree(ort_engine, existing)
    for output in (tmp_path / "fresh", existing):
        with pytest.raises(KeyboardInterrupt):
            build_engine(target_dir, drafter_dir, output, BuildConfig(block_sizes=(4,), backend="onnxruntime"),
                         progress=False)
    assert not (tmp_path / "fresh").exists()
    read_manifest(existing)  # the previous engine is untouched and still verifies
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]  # no staging directories left behind


def test_a_rebuild_exports_only_the_graphs_the_cache_cannot_supply(target_dir, drafter_dir, ort_engine, suite_cache,
                                                                   tmp_path, monkeypatch):
    """ort_engine's build left this pair's graphs in the suite's cache: a build at other block sizes
    exports nothing and holds the cached graphs; an entry whose bytes changed is exported afresh
    (by a stand-in that writes the graph's real bytes: what is checked is that the build exports
    that graph, and only it, and mends the entry; a real export costs ~8 s and ran for ort_engine).
    (That a new draft graph of the same target exports only itself is checked by the draft-vocabulary
    build, test_draft_vocab.py: one draft graph export fewer.)"""
    from trtspec.export.cache import GRAPHS_DIR

    exported = exported_graphs(monkeypatch)
    rebuilt = tmp_path / "rebuilt"
    float_drafts = {"backend": "onnxruntime", "draft_weights": "float"}  # ort_engine's graphs
    build_engine(target_dir, drafter_dir, rebuilt, BuildConfig(block_sizes=(6, 12), **float_drafts), progress=False)
    entries = {path.read_bytes(): path.name for path in (suite_cache / GRAPHS_DIR).glob("*.onnx")}
    assert exported == [] and all((rebuilt / name).read_bytes() in entries for name in ("target.onnx", "draft.onnx"))

    cache = tmp_path / "cache"  # a copy of the suite's entries, the draft graph's damaged
    shutil.copytree(suite_cache / GRAPHS_DIR, cache / GRAPHS_DIR)
    damaged = cache / GRAPHS_DIR / entries[(rebuilt / "draft.onnx").read_bytes()]
    damaged.write_bytes(damaged.read_bytes()[:-100])
    monkeypatch.setenv("TRTSPEC_CACHE", str(cache))
    graph = (rebuilt / "draft.onnx").read_bytes()
    exported = exported_graphs(monkeypatch, stand_in=graph)
    build_engine(target_dir, drafter_dir, tmp_path / "again", BuildConfig(block_sizes=(4,), **float_drafts),
                 progress=False)
    assert exported == ["draft.onnx"]
    assert damaged.read_bytes() == (tmp_path / "again" / "draft.onnx").read_bytes() == graph


# export_cached's rules, with a stand-in export (any callable that writes the file).


@pytest.fixture
def graph_cache(tmp_path, monkeypatch):
    """The cache module over an empty cache, and a stand-in export that numbers the graphs it writes."""
    import trtspec.export.cache as cache

    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path / "cache"))
    calls = []

    def export(path):
        calls.append(path.name)
        path.write_bytes(b"graph " + str(len(calls)).encode())

    return cache, export, calls


def test_a_cached_graph_is_exported_once(graph_cache, tmp_path):
    cache, export, calls = graph_cache
    cache.export_cached(tmp_path / "a.onnx", "k.onnx", export)     # a miss: exported and kept
    cache.export_cached(tmp_path / "b.onnx", "k.onnx", export)     # a hit: copied
    assert calls == ["a.onnx"] and (tmp_path / "b.onnx").read_bytes() == b"graph 1"


def test_a_damaged_graph_cache_entry_is_exported_again(graph_cache, tmp_path):
    cache, export, calls = graph_cache
    cache.export_cached(tmp_path / "a.onnx", "k.onnx", export)
    entry = tmp_path / "cache" / cache.GRAPHS_DIR / "k.onnx"
    entry.write_bytes(b"graph X")                                  # damaged: exported afresh, the entry mended
    cache.export_cached(tmp_path / "c.onnx", "k.onnx", export)
    assert calls == ["a.onnx", "c.onnx"] and entry.read_bytes() == b"graph 2"


def test_a_graph_too_large_to_cache_is_still_exported(graph_cache, tmp_path, monkeypatch):
    cache, export, _ = graph_cache
    monkeypatch.setattr(cache, "MAX_CACHED_BYTES", 3)              # too large to keep
    cache.export_cached(tmp_path / "d.onnx", "big.onnx", export)
    assert not (tmp_path / "cache" / cache.GRAPHS_DIR / "big.onnx").exists()
    assert (tmp_path / "d.onnx").read_bytes() == b"graph 1"


def test_a_graph_cache_that_cannot_be_created_never_fails_a_build(graph_cache, tmp_path, monkeypatch):
    cache, export, _ = graph_cache
    (tmp_path / "file").write_text("")                             # a cache that cannot be created
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path / "file"))
    cache.export_cached(tmp_path / "e.onnx", "k.onnx", export)
    assert (tmp_path / "e.onnx").read_bytes() == b"graph 1"


def test_two_builds_of_one_graph_at_once_export_it_once(graph_cache, tmp_path):
    """The second waits for the first and copies its graph."""
    cache, export, calls = graph_cache
    exporting = threading.Event()

    def slow_export(path):
        exporting.set()
        time.sleep(0.3)
        export(path)

    first = threading.Thread(target=cache.export_cached, args=(tmp_path / "f.onnx", "same.onnx", slow_export))
    first.start()
    exporting.wait(10)
    cache.export_cached(tmp_path / "g.onnx", "same.onnx", export)
    first.join()
    assert calls[-1] == "f.onnx" and (tmp_path / "g.onnx").read_bytes() == (tmp_path / "f.onnx").read_bytes()


def _edit_manifest(engine, edit) -> None:
    data = json.loads((engine / MANIFEST_FILE).read_text())
    edit(data)
    (engine / MANIFEST_FILE).write_text(json.dumps(data))


def test_a_corrupted_graph_dropped_from_the_manifest_is_refused(ort_engine, tmp_path):
    """Before, only listed files were hashed: this engine ran, exit 0, with a garbage drafter."""
    engine = tmp_path / "engine"
    shutil.copytree(ort_engine, engine)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def add(a, b):\n")
    _edit_manifest(engine, lambda data: data["artifacts"].pop("draft.onnx"))
    graph = bytearray((engine / "draft.onnx").read_bytes())
    graph[len(graph) // 2] ^= 0xFF
    (engine / "draft.onnx").write_bytes(bytes(graph))
    assert_one_line_error(trtspec_in_process("run", prompt, "--engine", engine, "--max-new-tokens", 8),
                          "draft.onnx", "not listed in artifacts")


def test_a_file_the_manifest_does_not_list_is_refused(ort_engine, tmp_path):
    engine = tmp_path / "engine"
    shutil.copytree(ort_engine, engine)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def add(a, b):\n")
    (engine / "tokenizer" / "added_tokens.json").write_text("{}")  # the tokenizer loader would read it
    assert_one_line_error(trtspec_in_process("run", prompt, "--engine", engine, "--max-new-tokens", 8),
                          "tokenizer/added_tokens.json", "does not list")


@pytest.mark.parametrize("field, value, message", [
    ("backend", 3, "field backend must be one of"),
    ("dtype", "float8", "field dtype must be one of"),
    ("max_context", "512", "field max_context must be an integer"),
    ("block_sizes", [8, 4], "field block_sizes must be a sorted list"),
    ("block_sizes", [4, 8, 16], "field profiles.target must list"),
    ("artifacts", {"../target.onnx": {"bytes": 1, "sha256": "0" * 64}}, "not a path inside"),
    ("graphs", {"target": {"file": "/etc/passwd"}, "draft": {"file": "draft.onnx"}}, "graphs.target.file"),
    ("target_config", {"vocab_size": "many"}, "field target_config is not a valid model config"),
    ("policy", {"dir": "../elsewhere", "block_sizes": [4]}, "field policy"),
    ("sources", [], "field sources must be a JSON object"),
])
def test_a_bad_manifest_field_is_one_line_naming_it(ort_engine, tmp_path, field, value, message):
    engine = tmp_path / "engine"
    shutil.copytree(ort_engine, engine)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def add(a, b):\n")
    _edit_manifest(engine, lambda data: data.__setitem__(field, value))
    assert_one_line_error(trtspec_in_process("run", prompt, "--engine", engine), MANIFEST_FILE, message)


def _set_path(dotted: str, value):
    def edit(data):
        *parents, last = dotted.split(".")
        for key in parents:
            data = data[key]
        data[last] = value(data[last]) if callable(value) else value
    return edit


@pytest.mark.parametrize("field, value", [
    ("max_context", lambda n: n * 2),
    ("drafter_config.dflash_config.mask_token_id", lambda n: n + 1),
    ("drafter_config.dflash_config.target_layer_ids", lambda ids: ids[::-1]),
    ("target_config.rope_theta", lambda theta: theta * 10),
    ("profiles.draft", lambda keys: keys[::-1]),
    ("dtype", "bfloat16"),
    ("target_config.vocab_size", lambda n: n + 64),
    ("manifest_sha256", "0" * 64),
])
def test_an_edited_manifest_is_refused_in_one_line(ort_engine, tmp_path, field, value):
    """Before: the manifest's own content was not hashed, so these edits ran silently (or, dtype and
    vocabulary size, ended in a traceback). Now any edit of a well-formed manifest is one line."""
    engine = tmp_path / "engine"
    shutil.copytree(ort_engine, engine)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def add(a, b):\n")
    _edit_manifest(engine, _set_path(field, value))
    assert_one_line_error(trtspec_in_process("run", prompt, "--engine", engine, "--max-new-tokens", 4),
                          f"{engine / MANIFEST_FILE} was edited or damaged", "rebuild the engine")


def test_a_reformatted_manifest_still_loads(ort_engine, tmp_path):
    """The digest is of the content, not the bytes: re-indenting the JSON keeps the engine loadable."""
    engine = tmp_path / "engine"
    shutil.copytree(ort_engine, engine)
    (engine / MANIFEST_FILE).write_text(json.dumps(json.loads((engine / MANIFEST_FILE).read_text())))
    assert read_manifest(engine).max_context == read_manifest(ort_engine).max_context


def test_a_manifest_without_its_digest_is_refused(ort_engine, tmp_path):
    engine = tmp_path / "engine"
    shutil.copytree(ort_engine, engine)
    _edit_manifest(engine, lambda data: data.pop("manifest_sha256"))
    with pytest.raises(TrtspecError, match="has no manifest_sha256 .*; rebuild the engine"):
        read_manifest(engine)


def test_tensorrt_profile_table(pair):
    specs = graph_specs(*(m.config for m in pair))
    table = trt_engine.profile_table(specs, [12, 16], max_context=512, max_batch=8)
    assert [p["key"] for p in table[TARGET]] == ["prefill", 1, 12, 16]
    assert [p["key"] for p in table[DRAFT]] == [12, 16]
    layers, heads, dim = pair[0].config.num_hidden_layers, pair[0].config.num_key_value_heads, pair[0].config.head_dim
    prefill, ar, b12, _ = table[TARGET]
    # Prefill (chunks of prompts, maybe after earlier chunks) into a cache of 8 slots.
    assert prefill["shapes"]["tokens"] == {"min": [1, 1], "opt": [1, 256], "max": [8, 512]}
    assert prefill["shapes"]["past_k"]["max"] == [512 + 64, 8, layers, heads, dim]
    assert prefill["shapes"]["slots"] == {"min": [1], "opt": [1], "max": [8]}  # the batch axis
    assert ar["shapes"]["tokens"] == {"min": [1, 1], "opt": [4, 1], "max": [8, 1]}
    assert b12["shapes"]["tokens"] == {"min": [1, 12], "opt": [4, 12], "max": [8, 12]}  # pinned B, batch 1..8
    assert b12["shapes"]["starts"]["max"] == [8]
    assert b12["shapes"]["past_v"]["min"] == [1, 1, layers, heads, dim]
    assert b12["shapes"]["past_v"]["opt"][1] == 8 and b12["shapes"]["past_v"]["max"][1] == 8  # every slot
    assert b12["shapes"]["past_v"]["max"][0] >= 512 + 12  # verify near the end of the context still fits
    d16 = table[DRAFT][1]["shapes"]
    assert d16["block"] == {"min": [1, 16], "opt": [4, 16], "max": [8, 16]}
    assert d16["context"]["min"][1] == 1 and d16["context"]["max"][1] == 512  # first draft: the whole prompt
    assert set(d16) == {"context", "counts", "block", "starts", "slots", "past_k", "past_v"}  # every dynamic input
    for graph, profiles in table.items():
        for profile in profiles:
            for shape in profile["shapes"].values():
                assert all(lo <= opt <= hi for lo, opt, hi in zip(shape["min"], shape["opt"], shape["max"]))


@pytest.mark.skipif(not trt_engine.available(), reason="TensorRT and a CUDA GPU are not available here")
def test_tensorrt_engine_equals_eager(target_dir, drafter_dir, pair, tmp_path):
    output = tmp_path / "trt"
    build_engine(target_dir, drafter_dir, output, BuildConfig(block_sizes=(4,), backend="tensorrt",
                                                               dtype="float32"), progress=False)
    prompts = [[5, 9, 33, 2, 7], [100]]
    cuda_pair = single(*(m.to("cuda") for m in pair))
    assert _greedy(opened(output, torch.device("cuda")), prompts, 4) == _greedy(cuda_pair, prompts, 4)

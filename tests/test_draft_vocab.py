"""The draft vocabulary (FR-Spec): the drafter proposes among the K most frequent token ids.

Verification keeps the full vocabulary, so greedy output equals autoregressive output and T = 1
samples follow the target's distribution whatever K is; the eager drafter and an ONNX Runtime
draft graph built with K propose the same ids, all inside the K; bad values are one line.
"""

import json

import numpy as np
import pytest
import torch

from helpers import (ALPHA, assert_one_line_error, exact_three_token_distribution, exported_graphs, predictable_pair,
                     pvalues, sample_three_tokens, trtspec_in_process)
from trtspec.api import Pipeline
from trtspec.models.draft_vocab import TokenCounts, ids_sha256, load_counts
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.schedule import BlockChoice

K = 24
CORPUS = "".join(f"def f{i}(a, b):\n    return a * {i} + b  # {'x' * (i % 7)}\n" for i in range(200))


@pytest.fixture(scope="module")
def counts_dir(target_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("draft-vocab")
    (work / "corpus.txt").write_text(CORPUS)
    result = trtspec_in_process("draft-vocab", "--target", target_dir, "--corpus", work / "corpus.txt",
                                "-o", work / "counts")
    assert result.returncode == 0, result.stderr.decode()
    assert "share covered by the K most frequent" in result.stderr.decode()
    return work / "counts"


def test_top_ids_are_the_most_frequent_with_ties_to_the_lower_id():
    counts = TokenCounts(torch.tensor([0, 5, 2, 5, 9, 0], dtype=torch.int64))
    assert counts.top_ids(4).tolist() == [4, 1, 3, 2]
    assert counts.top_ids(6).tolist() == [4, 1, 3, 2, 0, 5]  # never-seen ids still fill a large K
    assert counts.coverage(2) == pytest.approx(14 / 21)


def test_counts_of_continuations_count_the_responses_only(target_dir, tmp_path):
    from trtspec.tokenizer import TextCodec
    from trtspec.training.draft_vocab import count_tokens

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": "p", "response": "r", "prompt_ids": [3, 3, 3],
                                        "response_ids": ids}) + "\n" for ids in ([5, 6, 5], [5, 9])))
    counts = count_tokens(TextCodec(target_dir), 320, data=[data], target_dir=target_dir, progress=False)
    assert counts.counts[3] == 0 and counts.counts[5] == 3 and counts.counts[6] == 1 and counts.counts[9] == 1
    assert counts.top_ids(3).tolist() == [5, 6, 9]
    assert counts.info["sources"][0]["kind"] == "continuations" and len(counts.info["target_sha256"]) == 64


def test_the_draft_head_is_the_full_head_restricted_to_the_k_ids():
    target, drafter = predictable_pair(vocab_size=64)
    hidden = torch.randn(3, 5, target.config.hidden_size)
    full = drafter.lm_head(hidden)
    assert torch.equal(drafter.use_draft_vocab(torch.arange(64)).propose(hidden), full.argmax(-1))
    ids = torch.tensor([40, 3, 17, 9, 63])
    assert torch.equal(drafter.use_draft_vocab(ids).propose(hidden), ids[full[..., ids].argmax(-1)])
    assert drafter.draft_vocab_size == 5 and "draft_ids" not in drafter.state_dict()  # never saved as weights
    assert drafter.use_draft_vocab(None).draft_vocab_size is None


def _tokens(pipeline, prompt, block_size):
    config = GenerationConfig(block=BlockChoice(block_size), max_new_tokens=40)
    return pipeline.generate(prompt, config).tokens


@pytest.mark.parametrize("prompt", ["def add(a, b):\n", "return a * 3 + b"])
def test_greedy_with_a_draft_vocabulary_equals_autoregressive(target_dir, drafter_dir, counts_dir, prompt):
    pipeline = Pipeline(target_dir, drafter_dir, draft_vocab=K, draft_counts=counts_dir)
    ids = load_counts(counts_dir, 320).top_ids(K)
    assert torch.equal(pipeline.drafter.draft_ids, ids)
    ar = _tokens(pipeline.autoregressive(), prompt, 1)
    for block_size in (4, 8):
        assert _tokens(pipeline, prompt, block_size) == ar
    runner = pipeline.runner  # every proposal lies in the K ids
    _, features = runner.prefill([0], [[5, 9, 33, 2, 7]], [0])
    drafts, logits = runner.draft([0], [features[0]], torch.tensor([[7] + [1] * 7]), [5])
    assert torch.isin(drafts, ids).all() and logits.shape == (1, 7, K)
    assert torch.equal(ids[logits.argmax(dim=-1)], drafts)  # the proposals are the logits' argmax, as ids


def test_an_onnxruntime_engine_built_with_a_draft_vocabulary(target_dir, drafter_dir, counts_dir, ort_engine_dir,
                                                           tmp_path, monkeypatch):
    """Also: the pair's target graph is taken from the graph cache (ort_engine_dir's build left it
    there; its key is the target's and the feature layers', not the drafter's or its vocabulary's),
    so only the draft graph is exported (a wrong reuse would fail the build's self-check)."""
    pytest.importorskip("onnxruntime", reason="the onnxruntime backend needs the [onnx] extra")
    from trtspec.build import BuildConfig, build_engine

    exported = exported_graphs(monkeypatch)
    engine = tmp_path / "engine"
    manifest = build_engine(target_dir, drafter_dir, engine, BuildConfig(block_sizes=(4,), backend="onnxruntime",
                            draft_vocab=K, draft_counts=counts_dir), progress=False)
    assert exported == ["draft.onnx"]
    ids = load_counts(counts_dir, 320).top_ids(K)
    assert manifest.draft_vocab == {"dir": "draft_vocab", "size": K, "ids_sha256": ids_sha256(ids)}
    assert {"draft_vocab/counts.safetensors", "draft_vocab/draft_vocab.json"} <= set(manifest.artifacts)
    eager = Pipeline(target_dir, drafter_dir, draft_vocab=K, draft_counts=counts_dir)
    built = Pipeline(engine=engine)
    assert built.draft_vocab_size == K and torch.equal(built.draft_ids, ids)
    prompt, block = [5, 9, 33, 2, 7, 100, 41], torch.tensor([[7, 1, 1, 1]])
    drafts = [r.draft([0], [r.prefill([0], [prompt], [0])[1][0]], block, [len(prompt)])[0]
              for r in (built.runner, eager.runner)]
    assert torch.equal(drafts[0], drafts[1]) and torch.isin(drafts[0], ids).all()
    for text in ("def add(a, b):\n", "return a * 3 + b"):
        assert _tokens(built, text, 4) == _tokens(eager, text, 4) == _tokens(eager.autoregressive(), text, 1)
    # a run asking for another K (or new counts) than the engine was built with is one line
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("def add(a, b):\n")
    assert_one_line_error(trtspec_in_process("run", prompt_file, "--engine", engine, "--draft-vocab", 16),
                          "built with --draft-vocab 24")


def test_sampling_at_t1_with_a_draft_vocabulary_follows_the_target():
    """T = 1: the drafter proposes among 3 ids (token 7, which the target often samples, among
    them); the first three tokens still follow the target's own distribution."""
    pair = predictable_pair(vocab_size=8, beta=0.5, hidden=16, layers=1, heads=2, kv_heads=1)
    pair[1].use_draft_vocab(torch.tensor([7, 2, 5]))
    joint = exact_three_token_distribution(pair[0])
    samples = sample_three_tokens(pair, 8_000)
    assert 0.1 < np.mean(samples[:, 1] == 7) < 0.5
    results = pvalues(samples, joint)
    assert min(results.values()) > ALPHA, results


@pytest.mark.parametrize("args, fragments", [
    (("--draft-vocab", 1), ("--draft-vocab must be an integer in [2,", "got 1")),
    (("--draft-vocab", 321), ("at most the vocabulary size 320", "got 321")),
    (("--draft-vocab", 24), ("needs token counts", "has no draft_vocab/ directory", "trtspec draft-vocab")),
    (("--draft-counts", "."), ("give --draft-vocab too",)),
    (("--draft-vocab", 24, "--ar"), ("drop --draft-vocab",)),
])
def test_bad_draft_vocabularies_are_one_line(target_dir, drafter_dir, tmp_path, args, fragments):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def add(a, b):\n")
    result = trtspec_in_process("run", prompt, "--target", target_dir, "--drafter", drafter_dir,
                                "--max-new-tokens", 4, *args)
    assert_one_line_error(result, *fragments)


def test_bad_draft_vocabulary_inputs_are_one_line(target_dir, drafter_dir, counts_dir, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def add(a, b):\n")
    assert_one_line_error(trtspec_in_process("run", prompt, "--target", target_dir, "--drafter", drafter_dir,
                                             "--draft-vocab", 8, "--draft-counts", tmp_path), "holds no token counts")
    other = tmp_path / "other"
    other.mkdir()
    from safetensors.torch import save_file
    save_file({"counts": torch.ones(100, dtype=torch.int64)}, str(other / "counts.safetensors"))
    assert_one_line_error(trtspec_in_process("run", prompt, "--target", target_dir, "--drafter", drafter_dir,
                                             "--draft-vocab", 8, "--draft-counts", other),
                          "counts cover 100 token ids", "has 320")
    assert_one_line_error(trtspec_in_process("draft-vocab", "--target", target_dir, "-o", tmp_path / "out"),
                          "give --data FILE")
    assert_one_line_error(trtspec_in_process("draft-vocab", "--target", target_dir, "--corpus", prompt,
                                             "-o", drafter_dir), "not a draft vocabulary")

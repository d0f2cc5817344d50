"""The target step written for ONNX Runtime (export/ort_target.py) against the eager target.

The graph is a second implementation of `TargetStep` (fused operators, caches per layer updated in
place by GroupQueryAttention), so every call the runner makes of it is compared with the eager
modules' on the same requests: prompts of several rows, verify blocks of one row and of several
(of different lengths, in one call), AR steps of rows whose slots are in any order or not adjacent
(the slots between them skipped), and the steps after them (which read what the earlier calls wrote
into the caches, and would read a skipped slot's cache overwritten).
"""

import numpy as np
import pytest
import torch
from helpers import random_drafter, save_hf_target

from trtspec.export.bindings import IN_PLACE, TARGET, target_graph_in_place
from trtspec.models import load_target
from trtspec.runtime.runner import BatchRunner

pytest.importorskip("onnxruntime", reason="the in-place target graph runs on ONNX Runtime")

MAX_CONTEXT = 64
SLOTS = 4


def test_onnxruntime_engines_of_dense_float32_targets_on_the_cpu_take_the_in_place_graph(tmp_path):
    from trtspec.build import in_place_target

    target = load_target(save_hf_target(tmp_path / "t", layers=2, with_tokenizer=False))
    cpu = torch.device("cpu")
    assert in_place_target("onnxruntime", target, cpu)  # float32 or 4-bit weights alike
    assert not in_place_target("tensorrt", target, cpu)
    assert not in_place_target("onnxruntime", target, torch.device("cuda"))
    assert not in_place_target("onnxruntime", target.to(torch.float16), cpu)
    moe = load_target(save_hf_target(tmp_path / "moe", family="qwen3_moe", layers=2, with_tokenizer=False))
    assert not in_place_target("onnxruntime", moe, cpu)  # routed experts: the exported graph


def test_an_onnxruntime_older_than_1_32_keeps_the_exported_target_graph(tmp_path, monkeypatch):
    """Its GroupQueryAttention has no query_seqlens (rows of several lengths in one call)."""
    import onnxruntime

    from trtspec.build import in_place_target

    target = load_target(save_hf_target(tmp_path / "t", layers=2, with_tokenizer=False))
    monkeypatch.setattr(onnxruntime, "__version__", "1.31.0")
    assert not in_place_target("onnxruntime", target, torch.device("cpu"))
    monkeypatch.setattr(onnxruntime, "__version__", "1.32.0")
    assert in_place_target("onnxruntime", target, torch.device("cpu"))


def _runners(family: str, tmp_path, **options):
    from trtspec.engines.onnxruntime import OnnxRuntimeExecutor
    from trtspec.export.ort_target import write_target_graph

    target = load_target(save_hf_target(tmp_path / family, family=family, layers=3, with_tokenizer=False, **options))
    drafter = random_drafter(target, layer_ids=(0, 2))
    layers = tuple(drafter.config.target_layer_ids)
    spec = target_graph_in_place(target.config, len(layers))
    assert spec.cache == IN_PLACE
    write_target_graph(target, layers, MAX_CONTEXT + 16, spec, tmp_path / "target.onnx")
    executor = OnnxRuntimeExecutor({TARGET: tmp_path / "target.onnx"}, torch.device("cpu"), threads=1)
    graph = BatchRunner(executor, {TARGET: spec}, torch.float32, SLOTS, MAX_CONTEXT, None, None)
    eager = BatchRunner.eager(target, drafter, SLOTS, max_context=MAX_CONTEXT)  # its target taps the same layers
    return target, graph, eager


@pytest.mark.parametrize("family,options", [("qwen3", {}), ("llama", {"tie": True})])
def test_the_in_place_graph_computes_what_the_eager_target_does(family, options, tmp_path):
    target, graph, eager = _runners(family, tmp_path, **options)
    rng = np.random.default_rng(0)
    vocab = target.config.vocab_size
    worst = 0.0

    def same(got, want):
        nonlocal worst
        for g, w in zip(got, want):
            assert g.shape == w.shape
            worst = max(worst, (g - w).abs().max().item())

    with torch.inference_mode():
        prompts = [rng.integers(0, vocab, 10).tolist() for _ in range(SLOTS)]
        # four prompts at once, the last three logits of each
        same(*(runner.prefill([0, 1, 2, 3], prompts, [0] * SLOTS, tail=3) for runner in (graph, eager)))
        starts = [10] * SLOTS
        for slots in ([2, 0, 3, 1], [0, 2], [3], [1, 2, 3]):  # AR rows: shuffled, apart, alone, adjacent
            blocks = [rng.integers(0, vocab, 1) for _ in slots]
            at = [starts[s] for s in slots]
            same(graph.verify(slots, blocks, at), eager.verify(slots, blocks, at))
            for s in slots:
                starts[s] += 1
        # verify blocks: one row, then two rows of different lengths at different positions (padded)
        block = rng.integers(0, vocab, 5)
        same(graph.verify([1], [block], [starts[1]]), eager.verify([1], [block], [starts[1]]))
        blocks, slots = [rng.integers(0, vocab, 4), rng.integers(0, vocab, 2)], [3, 0]
        at = [starts[s] for s in slots]
        same(graph.verify(slots, blocks, at), eager.verify(slots, blocks, at))
        starts[3] += 2  # row 3 keeps two of its four (the rest is overwritten), row 0 both of its two
        starts[0] += 2
        # AR rows beside a block (a mixed batch: each row's real positions alone)
        blocks, slots = [rng.integers(0, vocab, 1), rng.integers(0, vocab, 3), rng.integers(0, vocab, 1)], [0, 1, 2]
        at = [starts[s] for s in slots]
        same(graph.verify(slots, blocks, at), eager.verify(slots, blocks, at))
        for s, n in zip(slots, (1, 3, 1)):
            starts[s] += n
        # every row once more: what each reads was written by the calls above
        blocks = [rng.integers(0, vocab, 1) for _ in range(SLOTS)]
        same(graph.verify([0, 1, 2, 3], blocks, starts), eager.verify([0, 1, 2, 3], blocks, starts))
    assert worst < 1e-4

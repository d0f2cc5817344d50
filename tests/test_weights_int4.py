"""`trtspec build --weights int4`: the target's matmuls as MatMulNBits 4-bit blocks, the drafter's in 8 bits.

The tiny target with its trained drafter (drafts are accepted on code prompts) is built once with
4-bit target weights. 4-bit weights change the target's numbers, so its greedy output differs from
the float32 engine's by the rounding; what is checked is that speculation through the int4 graphs
reproduces their own AR output (greedy speculative == greedy AR through the same engine) on the
tiny pair. That equality is exact only as far as verify(B) and B AR steps compute the same logits:
MatMulNBits' int8 activation rounding can magnify their float differences (~1e-5) into a flipped
near-tie, and on the default pair it does for some prompts (docs/engines.md, "4-bit weights").
"""

from collections import Counter

import pytest
from helpers import assert_one_line_error, code_prompts, trtspec_in_process

from trtspec.api import Pipeline
from trtspec.build import BuildConfig, build_engine
from trtspec.engines.manifest import read_manifest
from trtspec.errors import TrtspecError
from trtspec.export.bindings import DRAFT, TARGET
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.sampling import SamplingConfig
from trtspec.runtime.schedule import AR, BlockChoice

BLOCK_SIZES = (4, 8)
HELD_OUT = 96  # code_prompts(96) trained the tiny drafter (helpers.TRAINED_PROMPTS); later ones are new to it


@pytest.fixture(scope="module")
def int4_engine(target_dir, trained_drafter_dir, tmp_path_factory):
    pytest.importorskip("onnxruntime", reason="--weights int4 needs the [onnx] extra")
    output = tmp_path_factory.mktemp("engines") / "int4"
    build_engine(target_dir, trained_drafter_dir, output,
                 BuildConfig(block_sizes=BLOCK_SIZES, backend="onnxruntime", weights="int4"), progress=False)
    return output


def _ops(path) -> Counter:
    import onnx

    return Counter(node.op_type for node in onnx.load(str(path)).graph.node)


def _nodes(path, op_type: str) -> list:
    import onnx

    return [node for node in onnx.load(str(path)).graph.node if node.op_type == op_type]


def _bits(node) -> int:
    return next(attribute.i for attribute in node.attribute if attribute.name == "bits")


def test_an_int4_engine_holds_matmulnbits_target_weights_and_says_so(int4_engine):
    manifest = read_manifest(int4_engine)
    assert manifest.weights["format"] == "int4" and manifest.weights["graphs"] == [TARGET, DRAFT]
    assert manifest.weights["graph_bits"] == {TARGET: 4, DRAFT: 8}
    assert (manifest.weights["block_size"], manifest.weights["symmetric"], manifest.weights["accuracy_level"]) == (
        32, False, 4)
    assert manifest.label == "onnxruntime int4 (target), int8 (draft)" and manifest.dtype == "float32"
    target_ops, draft_ops = (_ops(int4_engine / manifest.graphs[g]["file"]) for g in (TARGET, DRAFT))
    # every weight matmul of the tiny target: q/k/v (one), o, gate/up (one), down per layer (2 layers) and
    # the head, in the target graph written for ONNX Runtime (export/ort_target.py: caches updated in place)
    assert target_ops["MatMulNBits"] == 9 and manifest.graphs[TARGET]["file"] == "target.int4.onnx"
    assert target_ops["GroupQueryAttention"] == 2 and manifest.graphs[TARGET]["cache"] == "in_place"
    assert manifest.specs()[TARGET].cache == "in_place" and "cache" not in manifest.graphs[DRAFT]
    # the drafter's matmuls in 8 bits (engines/int4.py: in 4 it was accepted less)
    assert draft_ops["MatMulNBits"] > 0 and manifest.graphs[DRAFT]["file"] == "draft.int8.onnx"
    assert {_bits(node) for node in _nodes(int4_engine / "draft.int8.onnx", "MatMulNBits")} == {8}
    assert manifest.check["max_abs_logit_diff"] > 0  # recorded, not held to float32's tolerance


def test_greedy_speculation_through_int4_weights_equals_their_own_ar(int4_engine):
    pipeline = Pipeline(engine=int4_engine)
    assert pipeline.backend == "onnxruntime int4 (target), int8 (draft)"
    prompts = [pipeline.codec.encode(p) for p in code_prompts(HELD_OUT + 4, words=20)[HELD_OUT:]]
    ar = pipeline.autoregressive().local_engine
    reference = [r.tokens for r in ar.generate(prompts, [GenerationConfig(block=AR, max_new_tokens=40)] * 4)]
    assert all(len(tokens) == 40 for tokens in reference)
    accepted = 0
    for block_size in BLOCK_SIZES:
        config = GenerationConfig(block=BlockChoice(block_size), max_new_tokens=40)
        results = pipeline.local_engine.generate(prompts, [config] * len(prompts))
        assert [r.tokens for r in results] == reference, f"B={block_size}"
        accepted += sum(a * cycles for r in results for a, cycles in enumerate(r.stats.histogram))
    assert accepted > 0  # drafts were accepted: the acceptance path ran, not only bonus tokens
    # one batch of every kind (the in-place graph runs its sampled AR rows in one call, each block in its
    # own): the greedy requests still write their AR text
    sampled = GenerationConfig(block=AR, max_new_tokens=40, ignore_eos=True,
                               sampling=SamplingConfig(temperature=1.0, seed=3))
    configs = [GenerationConfig(block=BlockChoice(4), max_new_tokens=40), sampled,
               GenerationConfig(block=BlockChoice(8), max_new_tokens=40), sampled]
    mixed = pipeline.local_engine.generate(prompts, configs)
    assert [mixed[0].tokens, mixed[2].tokens] == [reference[0], reference[2]]
    assert all(len(r.tokens) == 40 for r in mixed)


def test_int4_with_another_backend_is_refused_in_one_line(target_dir, trained_drafter_dir, tmp_path):
    with pytest.raises(TrtspecError, match="--weights int4 is ONNX Runtime's MatMulNBits format"):
        BuildConfig(backend="torch", weights="int4")
    result = trtspec_in_process("build", "--target", target_dir, "--drafter", trained_drafter_dir, "--backend",
                                "onnxruntime", "--weights", "int4", "--dtype", "float16", "-o", tmp_path / "engine")
    assert_one_line_error(result, "--weights int4 builds an ONNX Runtime engine for the CPU in float32")
    assert not (tmp_path / "engine").exists()


def test_a_head_tied_to_the_embedding_table_is_quantized_too(tmp_path):
    """A tied head is exported as MatMul(x, Transpose(table)) beside Gather(table, ids); the head gets
    a 4-bit copy and the Gather keeps the float table."""
    pytest.importorskip("onnxruntime", reason="--weights int4 needs the [onnx] extra")
    import numpy as np
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    from trtspec.engines.int4 import quantize_weights

    table = np.random.default_rng(0).standard_normal((96, 64)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["rows"]),
         helper.make_node("Transpose", ["table"], ["head"], perm=[1, 0]),
         helper.make_node("MatMul", ["rows", "head"], ["logits"])], "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 96])],
        [numpy_helper.from_array(table, "table")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), tmp_path / "float.onnx")
    quantize_weights(tmp_path / "float.onnx", tmp_path / "int4.onnx")
    assert _ops(tmp_path / "int4.onnx") == Counter({"Gather": 1, "MatMulNBits": 1})
    ids = np.array([3, 50])
    logits = onnxruntime.InferenceSession(tmp_path / "int4.onnx").run(None, {"ids": ids})[0]
    exact = table[ids] @ table.T
    assert np.abs(logits - exact).max() < 0.1 * np.abs(exact).max()  # rounded to 4 bits, not another matrix
    assert (logits.argmax(-1) == ids).all()


def _gguf_weight(shape: tuple[int, int], kind: str, seed: int):
    """A float weight [K, N] as a GGUF file of that block type holds it: quantized, then dequantized by
    the gguf package (what `trtspec.models.gguf` converts)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType[kind]
    values = 0.05 * np.random.default_rng(seed).standard_normal(shape[::-1]).astype(np.float32)  # GGUF rows: [N, K]
    return np.ascontiguousarray(quants.dequantize(quants.quantize(values, kind), kind).astype(np.float32).T)


def _dequantized(graph, node):
    """A MatMulNBits node's weight [K, N] rebuilt from its blocks in numpy: scale * (q - zero point)."""
    import numpy as np
    from onnx import numpy_helper

    tensors = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    bits = next(a.i for a in node.attribute if a.name == "bits")
    n, k = (next(a.i for a in node.attribute if a.name == name) for name in ("N", "K"))
    packed, scales, zero = (tensors[name] for name in node.input[1:4])
    q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, k // 32, 32) if bits == 4 else packed
    zero = (np.stack([zero & 15, zero >> 4], axis=-1).reshape(n, -1)[:, :k // 32] if bits == 4
            else zero.reshape(n, -1))
    return (scales.reshape(n, -1, 1) * (q.astype(np.float32) - zero[..., None])).reshape(n, k).T


def test_gguf_blocks_are_kept_exactly_and_other_weights_rounded(tmp_path):
    """Weights dequantized from Q4_1 (q, k: one input, so one block sum) and a head tied to a Q8_0
    table become MatMulNBits over the file's own blocks: 4-bit q with zero point 0 plus m x the
    block sums (the offsets' MatMul stays float), and 8-bit q + 128; a plain float weight (down) is
    rounded to 4 bits by onnxruntime's quantizer. The rebuilt weights are the float ones, and the
    graph computes what the float graph does but for the int8 rounding of activations."""
    pytest.importorskip("onnxruntime", reason="--weights int4 needs the [onnx] extra")
    import numpy as np
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    from trtspec.engines.int4 import quantize_weights

    hidden, width, vocab = 64, 96, 160
    weights = {"wq": _gguf_weight((hidden, hidden), "Q4_1", 0), "wk": _gguf_weight((hidden, width), "Q4_1", 1),
               "wdown": 0.05 * np.random.default_rng(2).standard_normal((width, hidden)).astype(np.float32)}
    table = _gguf_weight((hidden, vocab), "Q8_0", 3).T.copy()  # the embedding table [vocab, hidden]
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["x"]),
         helper.make_node("MatMul", ["x", "wq"], ["q"]), helper.make_node("MatMul", ["x", "wk"], ["k"]),
         helper.make_node("MatMul", ["k", "wdown"], ["down"]), helper.make_node("Add", ["q", "down"], ["h"]),
         helper.make_node("Transpose", ["table"], ["head"], perm=[1, 0]),
         helper.make_node("MatMul", ["h", "head"], ["logits"])], "layer",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "tokens"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "tokens", vocab])],
        [numpy_helper.from_array(table, "table"), *(numpy_helper.from_array(w, name) for name, w in weights.items())])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), tmp_path / "float.onnx")
    quantize_weights(tmp_path / "float.onnx", tmp_path / "int4.onnx")

    quantized = onnx.load(str(tmp_path / "int4.onnx")).graph
    assert _ops(tmp_path / "int4.onnx") == Counter({"MatMulNBits": 4, "ReduceSum": 1, "Reshape": 1, "MatMul": 2,
                                                    "Add": 3, "Gather": 1})
    blocks = {node.input[1]: node for node in quantized.node if node.op_type == "MatMulNBits"}
    for name in ("wq", "wk"):
        assert np.array_equal(_dequantized(quantized, blocks[f"{name}.q4"]) +
                              np.repeat(numpy_helper.to_array(next(t for t in quantized.initializer
                                                                   if t.name == f"{name}.q4.offsets")), 32, axis=0),
                              weights[name])
    assert np.array_equal(_dequantized(quantized, blocks["table.transposed.q8"]), table.T)
    rounded = _dequantized(quantized, next(node for key, node in blocks.items() if key.startswith("wdown")))
    assert 0 < np.abs(rounded - weights["wdown"]).max() < 0.1 * np.abs(weights["wdown"]).max()
    ids = np.array([[3, 50, 77, 120]])
    float_logits, int4_logits = (onnxruntime.InferenceSession(tmp_path / name).run(None, {"ids": ids})[0]
                                 for name in ("float.onnx", "int4.onnx"))
    assert np.abs(int4_logits - float_logits).max() < 0.05 * np.abs(float_logits).max()


def test_a_graph_whose_only_gguf_weight_is_q8_0_keeps_it(tmp_path):
    """One 8-bit rewrite and no offsets: the graph is still rewritten (the node count does not change)."""
    pytest.importorskip("onnxruntime", reason="--weights int4 needs the [onnx] extra")
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from trtspec.engines.int4 import quantize_weights

    weight = _gguf_weight((64, 96), "Q8_0", 4)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "one",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "tokens", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "tokens", 96])],
                              [numpy_helper.from_array(weight, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), tmp_path / "float.onnx")
    quantize_weights(tmp_path / "float.onnx", tmp_path / "int4.onnx")
    quantized = onnx.load(str(tmp_path / "int4.onnx")).graph
    assert [(node.op_type, node.input[1]) for node in quantized.node] == [("MatMulNBits", "w.q8")]
    assert np.array_equal(_dequantized(quantized, quantized.node[0]), weight)

"""export/fusion.py: MatMuls by constant weights that read the same input become one MatMul and a
Split, giving ONNX Runtime the same outputs; a weight another node also reads, or a lone MatMul, is
left alone."""

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from trtspec.export.fusion import fuse_file, fuse_shared_matmuls


def _graph() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal((8, n)).astype(np.float32)
               for name, n in (("wq", 8), ("wk", 4), ("wv", 4), ("wo", 8), ("shared", 8))}
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"]), helper.make_node("Relu", ["x"], ["h"]),
             helper.make_node("MatMul", ["x", "wk"], ["k"]), helper.make_node("MatMul", ["x", "wv"], ["v"]),
             helper.make_node("MatMul", ["h", "wo"], ["o"]),  # a lone product of its input
             helper.make_node("MatMul", ["h", "shared"], ["s1"]),  # a weight read twice: kept as it is
             helper.make_node("Add", ["shared", "shared"], ["s2"])]
    shapes = {"q": [2, 3, 8], "k": [2, 3, 4], "v": [2, 3, 4], "o": [2, 3, 8], "s1": [2, 3, 8], "s2": [8, 8]}
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in shapes.items()]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])],
                              outputs, [numpy_helper.from_array(w, name) for name, w in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def test_projections_of_one_input_become_one_matmul_with_the_same_outputs():
    model = _graph()
    x = np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32)
    before = _run(model, x)
    assert fuse_shared_matmuls(model) == 2  # q, k, v: two MatMuls merged away
    onnx.checker.check_model(model, full_check=True)
    ops = [node.op_type for node in model.graph.node]
    assert ops.count("MatMul") == 3 and ops.count("Split") == 1
    assert {w.name for w in model.graph.initializer} >= {"wo", "shared"} and "wq" not in {
        w.name for w in model.graph.initializer}
    for expected, got in zip(before, _run(model, x), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert fuse_shared_matmuls(model) == 0  # nothing left to merge


def test_a_graph_file_is_rewritten_in_place_unless_its_weights_lie_outside_it(tmp_path):
    inline, external = tmp_path / "inline.onnx", tmp_path / "external.onnx"
    onnx.save_model(_graph(), str(inline))
    onnx.save_model(_graph(), str(external), save_as_external_data=True, location="external.data",
                    size_threshold=0)
    assert fuse_file(inline) == 2 and [n.op_type for n in onnx.load(str(inline)).graph.node].count("Split") == 1
    before = external.read_bytes()
    assert fuse_file(external) == 0 and external.read_bytes() == before

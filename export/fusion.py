"""One matrix product for the projections that read the same input.

A decoder layer multiplies its normed input by q, k and v, and its second normed input by gate and
up: five products over two inputs. In an exported graph each is a MatMul by a constant weight, and
at decode shapes (a few rows) each is a short kernel that a CPU runtime starts, splits over its
threads and joins again. Concatenating the weights that share an input along their output axis and
splitting the result gives the same columns from one kernel: fewer, larger products, which split
over threads better (measured on a 2-core host: docs/engines.md, "Fused projections"). Each output
column is the same dot product over the same inputs as before.

The pass works on the ONNX graph, so every backend that reads ONNX (ONNX Runtime, its 4-bit
quantizer, TensorRT's parser) gets it, and the models keep their checkpoints' layout.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np


def fuse_file(path: Path) -> int:
    """`fuse_shared_matmuls` on the graph at `path`, rewritten in place when anything merged. A graph
    whose weights lie outside its file (ONNX's external data: models over 2 GB) is left as it is:
    rewriting it would mean loading every weight, and at that size the products are long anyway."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(path), load_external_data=False)
    if any(uses_external_data(weight) for weight in model.graph.initializer):
        return 0
    merged = fuse_shared_matmuls(model)
    if merged:
        onnx.save_model(model, str(path))
    return merged


def fuse_shared_matmuls(model) -> int:
    """Rewrite `model` (an onnx ModelProto) in place: MatMuls that multiply the same input by
    constant 2-D weights (each weight read by no other node) become one MatMul and a Split. Returns
    how many MatMuls were merged away."""
    from onnx import helper, numpy_helper

    graph = model.graph
    weights = {w.name: w for w in graph.initializer}
    readers: dict[str, int] = defaultdict(int)
    for node in graph.node:
        for name in node.input:
            readers[name] += 1
    groups: dict[str, list] = defaultdict(list)
    for node in graph.node:
        weight = weights.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if weight is not None and len(weight.dims) == 2 and readers[weight.name] == 1:
            groups[node.input[0]].append(node)
    merged, replaced, dropped = 0, {}, set()
    for source, nodes in groups.items():
        arrays = [numpy_helper.to_array(weights[n.input[1]]) for n in nodes]
        if len(nodes) < 2 or len({(a.shape[0], a.dtype) for a in arrays}) > 1:
            continue
        first = nodes[0].name or nodes[0].output[0]  # names the new tensors (an output's name is unique)
        fused = numpy_helper.from_array(np.concatenate(arrays, axis=1), f"{first}.fused.weight")
        sizes = numpy_helper.from_array(np.array([a.shape[1] for a in arrays], dtype=np.int64), f"{first}.fused.sizes")
        graph.initializer.extend([fused, sizes])
        replaced[id(nodes[0])] = [
            helper.make_node("MatMul", [source, fused.name], [f"{first}.fused"], name=f"{first}.fused"),
            helper.make_node("Split", [f"{first}.fused", sizes.name], [n.output[0] for n in nodes], axis=-1,
                             name=f"{first}.fused.split")]
        for node in nodes[1:]:
            replaced[id(node)] = []
        dropped.update(n.input[1] for n in nodes)
        merged += len(nodes) - 1
    if replaced:  # the merged product sits where the group's first MatMul was: before every reader of any of them
        kept = [new for node in graph.node for new in replaced.get(id(node), [node])]
        del graph.node[:]
        graph.node.extend(kept)
        remaining = [w for w in graph.initializer if w.name not in dropped]
        del graph.initializer[:]
        graph.initializer.extend(remaining)
    return merged

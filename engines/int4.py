"""4-bit target weights for the ONNX Runtime engine (`trtspec build --weights int4`).

A float graph's constant MatMul weights become `MatMulNBits` nodes: blocks of 32 input rows, a
scale each, multiplied by ONNX Runtime's int8 kernels (accuracy level 4: activations rounded to
int8 per block). Where a weight was dequantized from one of GGUF's block formats that MatMulNBits
can hold as it is (the blocks of 32 run along the input in both), the file's own blocks are
recovered from the float values and kept exactly, so the engine multiplies by the model's own
weights (what llama.cpp runs), not by a second rounding of them:

* Q4_1 (`d * q + m`, q in 0..15): 4-bit blocks with scale d and the integer zero point z nearest
  -m / d, plus what that leaves, `sum over each block of x` times `m + z * d` (at most d / 2: a
  small MatMul over the block sums, shared by the MatMuls that read the same input). A zero point
  of 0 would be exact too, but the int8 kernels round the activations, and their error grows with
  the weights the kernel sees: off-centre blocks (all of d * q) gave 2.8x the difference between a
  verify's and an AR step's logits;
* Q8_0 (`d * q`, q in -127..127; SmolLM2's embedding table, so its tied head): 8-bit blocks with
  zero point 128.

A weight on neither grid (a float checkpoint's) is rounded to 4 bits by onnxruntime's own quantizer
(`MatMulNBitsQuantizer`: asymmetric, round to nearest per block).

The draft graph of an ONNX Runtime CPU engine is rounded to 8 bits the same way (`DRAFT_BITS`;
`trtspec build --draft-weights`, int8 by default there, a float32 or a 4-bit target alike): its
float32 weights were a sixth of a 4-bit cycle's time and most of a float32 draft call's fixed cost,
8 bits drafted as well (tau 2.21 against 2.22), and 4 bits did not (1.18; docs/engines.md, "4-bit
weights"). A drafter's rounding never touches the output, only how often its drafts are accepted.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np

BLOCK = 32  # GGUF's Q4_1 / Q8_0 block, and MatMulNBits' block size here
# What `--weights int4` means, recorded in the manifest and in the quantized graph's cache key.
INT4 = {"format": "int4", "bits": 4, "block_size": BLOCK, "symmetric": False, "accuracy_level": 4,
        "gguf_blocks_kept": ["Q4_1", "Q8_0"]}
DRAFT_BITS = 8  # the draft graph's MatMulNBits (module docstring)
MS_DOMAIN = "com.microsoft"


def quantize_weights(source: Path, destination: Path, bits: int = INT4["bits"]) -> None:
    """Write `source` (a float32 graph) to `destination` with every constant MatMul weight as
    MatMulNBits blocks of `bits` (module docstring); the embedding table (a Gather) and everything
    else stay float32."""
    import onnx

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization import matmul_nbits_quantizer
    root.handlers[:], root.level = handlers, level  # its import configures the root logger (INFO, stderr): undone

    model = onnx.load(str(source))
    _untie_transposed_weights(model.graph)
    added = keep_gguf_blocks(model)
    quantizer = matmul_nbits_quantizer.MatMulNBitsQuantizer(
        model, bits=bits, block_size=BLOCK, is_symmetric=INT4["symmetric"],
        accuracy_level=INT4["accuracy_level"], op_types_to_quantize=("MatMul",), nodes_to_exclude=added)
    previous = matmul_nbits_quantizer.logger.level
    matmul_nbits_quantizer.logger.setLevel(logging.WARNING)  # a line per node otherwise
    try:
        quantizer.process()
    finally:
        matmul_nbits_quantizer.logger.setLevel(previous)
    onnx.save_model(quantizer.model.model, str(destination))


def manifest_weights(graph_bits: dict[str, int], onnxruntime_version: str) -> dict:
    """The manifest's record of an engine's quantized graphs ({graph: bits}): the format is named by
    its fewest bits ("int4": a 4-bit target; "int8": an 8-bit drafter beside float weights)."""
    return {**INT4, "format": f"int{min(graph_bits.values())}", "bits": min(graph_bits.values()),
            "graphs": list(graph_bits), "graph_bits": dict(graph_bits), "onnxruntime": onnxruntime_version}


def quantizer_identity(bits: int = INT4["bits"]) -> dict:
    """What a quantized graph depends on besides its float graph: the format and bits, ONNX Runtime's
    quantizer (its version) and this module's code (a cache key's part)."""
    from trtspec.engines.onnxruntime import version

    return {**INT4, "bits": bits, "onnxruntime": version(),
            "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}


# ---- recovering a GGUF block grid from float values ----------------------------------------------

def q4_1_blocks(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A MatMul weight [K, N] that is GGUF Q4_1 dequantized (gguf's `d * q + m` in float32, fp16 d
    and m, blocks of 32 along K) -> (q [N, K/32, 32] uint8, d [N, K/32], m [N, K/32]) that give it
    back bit for bit, or None. llama.cpp's Q4_1 stores each block's minimum as m (q = 0 there) and
    d = (max - min) / 15 in fp16, so m is the block's minimum and d is found among the fp16 values
    next to (max - m) / 15."""
    blocks = _blocks(weight)
    if blocks is None:
        return None
    low = blocks.min(axis=-1)
    if not np.array_equal(low, low.astype(np.float16).astype(np.float32)):
        return None
    found = _fp16_scale(blocks, (blocks.max(axis=-1) - low) / 15, low, 0, 15)
    return None if found is None else (found[0].astype(np.uint8), found[1], low)


def q8_0_blocks(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """A MatMul weight [K, N] that is GGUF Q8_0 dequantized (gguf's `q * d`, fp16 d) -> (q [N, K/32,
    32] int8, d [N, K/32]) that give it back bit for bit, or None (d = max |x| / 127 in fp16)."""
    blocks = _blocks(weight)
    if blocks is None:
        return None
    found = _fp16_scale(blocks, np.abs(blocks).max(axis=-1) / 127, None, -128, 127)
    return None if found is None else (found[0].astype(np.int8), found[1])


def _blocks(weight: np.ndarray) -> np.ndarray | None:
    """[K, N] float32 -> [N, K/32, 32]: each output column's blocks of 32 inputs."""
    if weight.ndim != 2 or weight.dtype != np.float32 or weight.shape[0] % BLOCK or not np.isfinite(weight).all():
        return None
    return np.ascontiguousarray(weight.T).reshape(weight.shape[1], -1, BLOCK)


def _fp16_scale(blocks: np.ndarray, estimate: np.ndarray, offset: np.ndarray | None, low: int, high: int,
                ) -> tuple[np.ndarray, np.ndarray] | None:
    """The fp16 scale d of each block, among `estimate` in fp16 and its two fp16 neighbours, and the
    integers q in [low, high] with float32 `d * q (+ offset)` == the block's values, or None where a
    block has none. The neighbours cover float32's rounding of the estimate's inputs."""
    shifted = blocks if offset is None else blocks - offset[..., None]
    base = np.abs(estimate).astype(np.float16).view(np.uint16).astype(np.int32)
    q = np.zeros(blocks.shape, np.float32)
    scale = np.zeros(estimate.shape, np.float32)
    done = np.zeros(estimate.shape, bool)
    for step in (0, -1, 1):
        d = np.clip(base + step, 0, 0x7BFF).astype(np.uint16).view(np.float16).astype(np.float32)  # finite fp16
        with np.errstate(divide="ignore", invalid="ignore"):
            guess = np.clip(np.rint(np.where(d[..., None] > 0, shifted / d[..., None], 0)), low, high).astype(np.float32)
        back = guess * d[..., None] if offset is None else d[..., None] * guess + offset[..., None]
        fits = (back == blocks).all(axis=-1) & ~done
        q[fits], scale[fits] = guess[fits], d[fits]
        done |= fits
        if done.all():
            return q, scale
    return None


# ---- rewriting the graph ------------------------------------------------------------------------

def keep_gguf_blocks(model) -> list[str]:
    """Rewrite every MatMul of `model` whose constant weight lies on a Q4_1 or Q8_0 grid (and whose
    input's rank is known) as MatMulNBits over those very blocks; returns the names of the nodes
    added that the quantizer must leave alone (the offset terms' MatMuls)."""
    import onnx
    from onnx import helper, numpy_helper

    graph = model.graph
    ranks = _ranks(model)
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    nodes, added, block_sums = [], [], {}

    def constant(array: np.ndarray, name: str) -> str:
        graph.initializer.append(numpy_helper.from_array(array, name))
        return name

    for node in graph.node:
        weight_name = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else None
        tensor = initializers.get(weight_name)
        x = node.input[0] if tensor is not None else None
        rank = ranks.get(x) if x is not None else None
        weight = numpy_helper.to_array(tensor) if rank is not None and rank >= 2 else None
        grid = weight is not None and (q4_1_blocks(weight) or q8_0_blocks(weight))
        if not grid:
            nodes.append(node)
            continue
        (k, n), name = weight.shape, node.name or node.output[0]
        bits = 4 if len(grid) == 3 else 8
        packed, scales, zero_points, offsets = _q4_1_arrays(*grid) if bits == 4 else (*_q8_0_arrays(*grid), None)
        prefix = f"{weight_name}.q{bits}"
        product = f"{name}.blocks" if offsets is not None else node.output[0]
        nodes.append(helper.make_node(
            "MatMulNBits", [x, constant(packed, prefix), constant(scales, f"{prefix}.scales"),
                            constant(zero_points, f"{prefix}.zero_points")],
            [product], name=f"{name}.q{bits}", domain=MS_DOMAIN, K=k, N=n, bits=bits, block_size=BLOCK,
            accuracy_level=INT4["accuracy_level"]))
        if offsets is None:
            continue
        if x not in block_sums:  # one block sum of an input for every MatMul that reads it
            sums = block_sums[x] = f"{x}.block_sums"
            shape = constant(np.array([0] * (rank - 1) + [k // BLOCK, BLOCK]), f"{sums}.shape")
            nodes += [helper.make_node("Reshape", [x, shape], [f"{sums}.blocks"], name=f"{sums}.reshape"),
                      helper.make_node("ReduceSum", [f"{sums}.blocks", constant(np.array([-1]), f"{sums}.axis")],
                                       [sums], name=sums, keepdims=0)]
        nodes += [helper.make_node("MatMul", [block_sums[x], constant(offsets, f"{prefix}.offsets")],
                                   [f"{name}.offset"], name=f"{name}.offset"),
                  helper.make_node("Add", [product, f"{name}.offset"], [node.output[0]], name=f"{name}.add")]
        added.append(f"{name}.offset")
    if list(graph.node) != nodes:
        read = {name for node in nodes for name in node.input}
        kept = [t for t in graph.initializer if t.name in read]  # less the float weights replaced
        del graph.initializer[:]
        graph.initializer.extend(kept)
        del graph.node[:]
        graph.node.extend(nodes)
        if not any(o.domain == MS_DOMAIN for o in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
    return added


def _q4_1_arrays(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, ...]:
    """MatMulNBits' 4-bit inputs for Q4_1 blocks (q [N, K/32, 32], d and m [N, K/32]): q packed two
    to a byte (low nibble first), the scales d, the zero points z nearest -m / d packed likewise,
    and what z leaves of m, `m + z d` [K/32, N], for the block sums' MatMul."""
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = np.clip(np.rint(np.where(d > 0, -m / d, 0)), 0, 15).astype(np.uint8)
    offsets = m + zero.astype(np.float32) * d  # exact: fp16 values times small integers
    zero = np.pad(zero, ((0, 0), (0, zero.shape[1] % 2)))
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8), d.reshape(-1), \
        (zero[:, 0::2] | (zero[:, 1::2] << 4)).reshape(-1), np.ascontiguousarray(offsets.T)


def _q8_0_arrays(q: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, ...]:
    """MatMulNBits' 8-bit inputs for Q8_0 blocks: q + 128 with zero point 128, the scales d."""
    return (q.astype(np.int16) + 128).astype(np.uint8), d.reshape(-1), np.full(d.size, 128, np.uint8)


def _ranks(model) -> dict[str, int]:
    """The rank of every value whose shape ONNX's inference knows."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    values = [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
    return {v.name: len(v.type.tensor_type.shape.dim) for v in values if v.type.tensor_type.HasField("shape")}


def _untie_transposed_weights(graph) -> None:
    """Give a MatMul that multiplies by Transpose(initializer) a transposed copy of its own: a head
    tied to the embedding table is exported that way (the table is also a Gather's input), and only a
    MatMul's constant weights are quantized. The table itself stays float32 for the Gather."""
    from onnx import numpy_helper

    initializers = {tensor.name: tensor for tensor in graph.initializer}
    producers = {output: node for node in graph.node for output in node.output}
    for node in graph.node:
        transpose = producers.get(node.input[1]) if node.op_type == "MatMul" else None
        if transpose is None or transpose.op_type != "Transpose" or transpose.input[0] not in initializers:
            continue
        weight = numpy_helper.to_array(initializers[transpose.input[0]])
        perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), None)
        if weight.ndim != 2 or perm not in (None, [1, 0]):
            continue
        name = f"{transpose.input[0]}.transposed"
        if name not in initializers:
            initializers[name] = numpy_helper.from_array(weight.T.copy(), name)
            graph.initializer.append(initializers[name])
        node.input[1] = name
    read = {name for node in graph.node for name in node.input} | {output.name for output in graph.output}
    for node in [n for n in graph.node if n.op_type == "Transpose" and not set(n.output) & read]:
        graph.node.remove(node)  # the transposes the copies replace

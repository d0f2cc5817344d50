"""The target's step graph written operator by operator for ONNX Runtime on the CPU.

torch.export's ONNX graph of `TargetStep` holds about 100 nodes per decoder layer (RoPE as slices
and concats, attention as a dozen matmuls, reshapes and masks, the cached keys gathered out of the
shared cache on every call). On a small model each node costs a dispatch and each gather a copy of
the cache: a quarter to a third of a 4-bit decode step on SmolLM2-135M (docs/engines.md, "The
in-place target graph"). This graph computes the same function with ONNX Runtime's fused CPU
operators, 11 nodes per layer (and 3 that move rows between the packed and padded layouts, below):

* `SkipSimplifiedLayerNormalization`: the residual add and the RMSNorm in one;
* `GroupQueryAttention`: RoPE, grouped-query attention over the cached positions and the new ones
  (causal), and the new keys/values written into the cache in place. Its cache is one buffer per
  layer, [batch, kv_heads, capacity, head_dim], bound to the runner's own memory as both the past
  input and the present output, so nothing is gathered or copied per call;
* the projections as plain MatMuls with constant weights (q/k/v as one, gate/up as one), which
  `trtspec.engines.int4` turns into `MatMulNBits` over the GGUF file's own blocks.

Rows are packed: embeddings, norms, projections and feed-forwards run on the real positions
alone (`computed`, flat row * tokens + t), and each layer's attention reads them back in the padded
[batch, tokens] layout, where each row's real count (`lengths`, 0 for a slot the call skips) tells
`GroupQueryAttention` which queries are real (its `query_seqlens`, ONNX Runtime 1.32): one call runs
rows of any lengths, an AR step beside a block costs its one position, and only the real keys and
values are written to the cache.

Inputs: tokens [batch, tokens], starts [batch] (each row's cached length), lengths [batch],
computed [positions], scored [scored] (indices into `computed` whose logits are returned), past_k.i
/ past_v.i per layer. Outputs: logits [scored, vocab], features [batch, tokens, F] (the drafter's
taps, as `decode` defines them; zeros at the padding), present_k.i / present_v.i (the same buffers).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from onnx import TensorProto, helper, numpy_helper

from trtspec.export.bindings import GraphSpec
from trtspec.models import Qwen3Target

OPSET, MS_DOMAIN = 21, "com.microsoft"
MIN_ONNXRUNTIME = (1, 32)  # GroupQueryAttention's query_seqlens: rows of several lengths in one call


def supports(target: Qwen3Target, device: torch.device) -> bool:
    """Whether this graph can stand in for the exported one: a dense decoder in float32 on the CPU
    (the routed experts of Qwen3-MoE are not written here; other dtypes and devices keep torch.export)."""
    config = target.config
    dense = not any(config.is_sparse(i) for i in range(config.num_hidden_layers))
    return dense and target.dtype == torch.float32 and device.type == "cpu"


class _Graph:
    """Nodes, initializers and the ranks of the values the quantizer needs to know."""

    def __init__(self):
        self.nodes, self.initializers, self.value_info = [], [], []
        self._count = 0
        self._constants: set[str] = set()

    def constant(self, name: str, array: np.ndarray | torch.Tensor) -> str:
        """An initializer (a name asked for again is the same one: small shapes recur)."""
        if name in self._constants:
            return name
        self._constants.add(name)
        if isinstance(array, torch.Tensor):
            array = array.detach().float().cpu().numpy()
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(self, op: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "",
             **attributes) -> list[str]:
        self._count += 1
        if isinstance(outputs, int):
            outputs = [f"{op.lower()}_{self._count}_{k}" for k in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=f"{op}_{self._count}", domain=domain,
                                           **attributes))
        return outputs

    def one(self, op: str, inputs: list[str], domain: str = "", **attributes) -> str:
        return self.node(op, inputs, 1, domain, **attributes)[0]

    def rows(self, name: str, width: int) -> str:
        """Declare `name` as float [positions, width] (a MatMul input's rank, for the quantizer)."""
        self.value_info.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["positions", width]))
        return name

    def skip_norm(self, residual: str, x: str, weight: str, eps: float) -> tuple[str, str]:
        """(RMSNorm(residual + x), residual + x) in one node."""
        normed, total = f"normed_{len(self.nodes)}", f"residual_{len(self.nodes)}"
        # outputs 1 and 2 (the mean and the inverse deviation) left out: not computed
        self.node("SkipSimplifiedLayerNormalization", [residual, x, weight], [normed, "", "", total], MS_DOMAIN,
                  epsilon=eps)
        return normed, total

    def matmul(self, x: str, weight: torch.Tensor, name: str, bias: torch.Tensor | None = None) -> str:
        """x @ weight.T (an nn.Linear's [out, in] weight, stored [in, out] as MatMul reads it)."""
        y = self.one("MatMul", [x, self.constant(f"{name}.weight", weight.t())])
        return y if bias is None else self.one("Add", [y, self.constant(f"{name}.bias", bias)])


def write_target_graph(target: Qwen3Target, feature_layers: tuple[int, ...], capacity: int, spec: GraphSpec,
                       path: Path) -> None:
    """Write the in-place target step of `target` (float32) for caches of `capacity` positions."""
    import onnx

    config = target.config
    heads, kv_heads, head_dim, hidden = (config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                                         config.hidden_size)
    eps = float(config.rms_norm_eps)
    layers = target.model.layers
    g = _Graph()
    with torch.no_grad():
        cos, sin = target.rotary(torch.arange(capacity), torch.float32)  # [capacity, head_dim], halves repeated
    cos_cache = g.constant("rope.cos", cos[:, :head_dim // 2])
    sin_cache = g.constant("rope.sin", sin[:, :head_dim // 2])

    # GroupQueryAttention's view of each row: its total length less one (at least 0, as a skipped row's
    # must be), its real queries, and a bound on every total (at least the call's width).
    count = g.one("Shape", ["tokens"], start=1, end=2)
    ends = g.one("Add", ["starts", "lengths"])
    seqlens = g.one("Cast", [g.one("Max", [g.one("Sub", [ends, g.constant("one", np.array([1], np.int64))]),
                                            g.constant("zero", np.array([0], np.int64))])], to=TensorProto.INT32)
    total = g.one("Cast", [g.one("ReduceMax", [g.one("Concat", [ends, count], axis=0)], keepdims=0)],
                  to=TensorProto.INT32)
    queries = g.one("Cast", ["lengths"], to=TensorProto.INT32)
    # The packed rows as the padded layout's [batch, tokens] index them: for attention's inputs any row
    # at the padding (GroupQueryAttention reads none of it), for the features N, one past the last (a
    # row of zeros).
    padded_shape = g.one("Shape", ["tokens"])
    packed = g.one("Shape", ["computed"])
    order = g.one("Range", [g.constant("first", np.array(0, np.int64)), g.one("Squeeze", [packed]),
                            g.constant("step", np.array(1, np.int64))])
    flat_count = g.one("ReduceProd", [padded_shape], keepdims=1)

    def scattered(fill: str) -> str:
        everywhere = g.one("Expand", [fill, flat_count])
        return g.one("Reshape", [g.one("ScatterElements", [everywhere, "computed", order], axis=0), padded_shape])

    where = scattered(g.constant("zero", np.array([0], np.int64)))
    where_or_zeros = scattered(packed)

    def padded(x: str) -> str:
        """Packed [N, width] -> [batch, tokens, width] (the padding's rows: any)."""
        return g.one("Gather", [x, where], axis=0)

    def packed_rows(x: str, width: int) -> str:
        """[batch, tokens, width] -> packed [N, width]: the real positions'."""
        rows = g.one("Reshape", [x, g.constant(f"rows.{width}", np.array([-1, width], np.int64))])
        return g.one("Gather", [rows, "computed"], axis=0)

    real = g.one("Gather", [g.one("Reshape", ["tokens", g.constant("flat", np.array([-1], np.int64))]), "computed"])
    h = g.one("Gather", [g.constant("embed_tokens.weight", target.model.embed_tokens.weight), real])  # [N, hidden]
    pending = None  # the last layer's feed-forward output, not yet added to the residual stream
    taps: dict[int, str] = {}
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        norm = g.constant(f"layers.{i}.input_layernorm.weight", layer.input_layernorm.weight)
        if pending is None:
            x = g.one("SimplifiedLayerNormalization", [h, norm], axis=-1, epsilon=eps)
        else:
            x, h = g.skip_norm(h, pending, norm, eps)
            if i - 1 in feature_layers:
                taps[i - 1] = h
        qkv_weight = torch.cat((attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))
        qkv_bias = (torch.cat((attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias))
                    if attn.q_proj.bias is not None else None)
        qkv = g.matmul(g.rows(x, hidden), qkv_weight, f"layers.{i}.qkv", qkv_bias)
        if config.qk_norm:  # Qwen3: RMSNorm over each head's queries and keys before RoPE
            q, k, v = g.node("Split", [qkv, g.constant(f"layers.{i}.qkv.sizes", np.array(
                [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], np.int64))], 3, axis=-1)
            q = _head_norm(g, q, heads, attn.q_norm, f"layers.{i}.q_norm", head_dim, eps)
            k = _head_norm(g, k, kv_heads, attn.k_norm, f"layers.{i}.k_norm", head_dim, eps)
            qkv = g.one("Concat", [q, k, v], axis=-1)
        skipped = [""] * 7  # position_ids, attention_bias, head_sink, k/v scales, q/k norm weights
        out = g.node("GroupQueryAttention",  # packed q/k/v in the padded layout
                     [padded(qkv), "", "", f"past_k.{i}", f"past_v.{i}", seqlens,
                      total, cos_cache, sin_cache, *skipped, queries],
                     [f"attention.{i}", f"present_k.{i}", f"present_v.{i}"],
                     MS_DOMAIN, num_heads=heads, kv_num_heads=kv_heads, do_rotary=1, rotary_interleaved=0)[0]
        out = packed_rows(out, heads * head_dim)
        projected = g.matmul(g.rows(out, heads * head_dim), attn.o_proj.weight, f"layers.{i}.o_proj", attn.o_proj.bias)
        post = g.constant(f"layers.{i}.post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
        y, h = g.skip_norm(h, projected, post, eps)
        mlp = layer.mlp
        gate_up = g.matmul(g.rows(y, hidden), torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)),
                           f"layers.{i}.gate_up")
        gate, up = g.node("Split", [gate_up, g.constant(f"layers.{i}.gate_up.sizes", np.array(
            [config.intermediate_size] * 2, np.int64))], 2, axis=-1)
        activated = g.one("Mul", [g.one("Mul", [gate, g.one("Sigmoid", [gate])]), up])
        pending = g.matmul(g.rows(activated, config.intermediate_size), mlp.down_proj.weight, f"layers.{i}.down_proj")
    final = g.constant("norm.weight", target.model.norm.weight)
    normed = g.one("SkipSimplifiedLayerNormalization", [h, pending, final], MS_DOMAIN, epsilon=eps)
    last = len(layers) - 1
    if last in feature_layers:  # HF's hidden_states[-1] is the final norm's output (models/target.py)
        taps[last] = normed
    if feature_layers:
        taps = g.one("Concat", [taps[i] for i in feature_layers], axis=-1)
        zeros = g.constant("zero_row", np.zeros((1, len(feature_layers) * hidden), np.float32))
        g.node("Gather", [g.one("Concat", [taps, zeros], axis=0), where_or_zeros], ["features"], axis=0)
    else:  # a target without a drafter: an empty feature axis keeps the outputs fixed
        g.node("Expand", [g.constant("no_features", np.zeros((1, 1, 0), np.float32)),
                          g.one("Concat", [padded_shape, g.constant("empty", np.array([0], np.int64))], axis=0)],
               ["features"])
    picked = g.one("Gather", [normed, "scored"], axis=0)
    g.value_info.append(helper.make_tensor_value_info(picked, TensorProto.FLOAT, ["scored", hidden]))
    g.node("MatMul", [picked, g.constant("lm_head.weight", target.lm_head.weight.t())], ["logits"])

    graph = helper.make_graph(g.nodes, "target", [_value(t) for t in spec.inputs], [_value(t) for t in spec.outputs],
                              g.initializers, value_info=g.value_info)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)])
    onnx.save_model(model, str(path))


def _head_norm(g: _Graph, x: str, count: int, norm, name: str, head_dim: int, eps: float) -> str:
    """RMSNorm over each head of x [positions, count * head_dim]."""
    split = g.one("Reshape", [x, g.constant(f"{name}.heads", np.array([0, count, head_dim], np.int64))])
    weight = g.constant(f"{name}.weight", norm.weight)
    normed = g.one("SimplifiedLayerNormalization", [split, weight], axis=-1, epsilon=eps)
    return g.one("Reshape", [normed, g.constant(f"{name}.joined", np.array([0, count * head_dim], np.int64))])


def _value(tensor):
    element = {"int64": TensorProto.INT64}.get(tensor.dtype, TensorProto.FLOAT)
    return helper.make_tensor_value_info(tensor.name, element, list(tensor.dims))

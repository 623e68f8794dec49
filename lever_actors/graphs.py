"""ONNX graphs of one decoder layer and of the LM head, built with the onnx helpers.

Weights are *external initializers*: the graph only names them and the session
binds them with ``SessionOptions.add_external_initializers`` from numpy views
into a layer buffer (no copy before ORT prepacks them).

Batch invariance is a design rule here: a token's output must not depend on how
many other tokens share its pass, or greedy speculative output would drift from
greedy autoregressive output. So

* norms, activation quantization (MatMulNBits accuracy 4 quantizes each row of
  A by blocks) and the MLP are row-wise;
* attention always reduces over the whole fixed-size KV cache (``C`` slots): the
  new K/V rows are scattered into a copy of the cache inside the graph and the
  mask hides what a token may not see, so the softmax and ``P @ V`` reductions
  have the same length whatever ``N`` is.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from lever_actors.shapes import NEG, Dims, MatSpec

OPSET = 17
MS = "com.microsoft"


def array_shapes(spec: MatSpec) -> dict[str, tuple[tuple[int, ...], int]]:
    """name -> (shape, ONNX element type) of one matrix's initializers, in flash layout order."""
    if spec.kind == "f32":
        return {"dense": ((spec.k, spec.n), TensorProto.FLOAT)}
    bits = 4 if spec.kind == "q4" else 8
    nb = spec.k // spec.block
    out = {
        "packed": ((spec.n, nb, spec.block * bits // 8), TensorProto.UINT8),
        "scales": ((spec.n, nb), TensorProto.FLOAT),
    }
    if spec.has_corr:
        out["corr"] = ((spec.k // 32, spec.n), TensorProto.FLOAT)
    return out


class _G:
    """Tiny graph-building helper: unique names, node and initializer lists."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.n = 0

    def op(self, op_type: str, *inputs: str, domain: str = "", **attrs) -> str:
        self.n += 1
        out = f"{op_type.lower()}_{self.n}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], domain=domain or None, **attrs))
        return out

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(onnx.numpy_helper.from_array(np.asarray(value), name))
        return name

    def external(self, name: str, shape: tuple[int, ...], dtype: int) -> str:
        t = TensorProto()
        t.name, t.data_type = name, dtype
        t.dims.extend(shape)
        t.data_location = TensorProto.EXTERNAL
        for key, val in (("location", "lever-bound"), ("offset", "0"), ("length", "0")):
            e = t.external_data.add()
            e.key, e.value = key, val
        self.inits.append(t)
        return name

    def matmul(self, a: str, prefix: str, spec: MatSpec, accuracy: int) -> str:
        names = {k: self.external(f"{prefix}.{k}", s, d) for k, (s, d) in array_shapes(spec).items()}
        if spec.kind == "f32":
            return self.op("MatMul", a, names["dense"])
        bits = 4 if spec.kind == "q4" else 8
        y = self.op(
            "MatMulNBits", a, names["packed"], names["scales"], domain=MS,
            K=spec.k, N=spec.n, bits=bits, block_size=spec.block, accuracy_level=accuracy,
        )
        if spec.has_corr:
            # exact offset term of Q4_K/Q4_1: per-32-block sums of A times the per-block offsets
            blocks = self.op("Reshape", a, self.const(f"{prefix}.bshape", np.array([0, spec.k // 32, 32], np.int64)))
            sums = self.op("ReduceSum", blocks, self.const(f"{prefix}.baxis", np.array([2], np.int64)), keepdims=0)
            y = self.op("Add", y, self.op("MatMul", sums, names["corr"]))
        return y

    def rmsnorm(self, x: str, weight: str, eps: float) -> str:
        ms = self.op("ReduceMean", self.op("Mul", x, x), axes=[-1], keepdims=1)
        inv = self.op("Reciprocal", self.op("Sqrt", self.op("Add", ms, self.const(f"eps_{self.n}", np.array(eps, np.float32)))))
        return self.op("Mul", self.op("Mul", x, inv), weight)


LAYER_MATS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
LAYER_VECS = ("attn_norm", "ffn_norm", "attn_q.bias", "attn_k.bias", "attn_v.bias")


def _rope(g: _G, x: str, cos: str, sin: str, n_heads: int, d: int, style: str, tag: str) -> str:
    """Rotary embedding of ``x`` [N, heads*D]; cos/sin are [N, D/2] per token."""
    x3 = g.op("Reshape", x, g.const(f"{tag}.s3", np.array([0, n_heads, d], np.int64)))
    c = g.op("Unsqueeze", cos, g.const(f"{tag}.ax1", np.array([1], np.int64)))
    s = g.op("Unsqueeze", sin, g.const(f"{tag}.ax1b", np.array([1], np.int64)))
    if style == "neox":
        half = g.const(f"{tag}.half", np.array([d // 2, d // 2], np.int64))
        g.nodes.append(helper.make_node("Split", [x3, half], [f"{tag}.x1", f"{tag}.x2"], axis=2))
        x1, x2 = f"{tag}.x1", f"{tag}.x2"
        r1 = g.op("Sub", g.op("Mul", x1, c), g.op("Mul", x2, s))
        r2 = g.op("Add", g.op("Mul", x2, c), g.op("Mul", x1, s))
        out = g.op("Concat", r1, r2, axis=2)
    else:  # adjacent pairs (2i, 2i+1)
        x4 = g.op("Reshape", x3, g.const(f"{tag}.s4", np.array([0, n_heads, d // 2, 2], np.int64)))
        g.nodes.append(helper.make_node("Split", [x4, g.const(f"{tag}.one", np.array([1, 1], np.int64))], [f"{tag}.e", f"{tag}.o"], axis=3))
        c4 = g.op("Unsqueeze", c, g.const(f"{tag}.ax3", np.array([3], np.int64)))
        s4 = g.op("Unsqueeze", s, g.const(f"{tag}.ax3b", np.array([3], np.int64)))
        e, o = f"{tag}.e", f"{tag}.o"
        r1 = g.op("Sub", g.op("Mul", e, c4), g.op("Mul", o, s4))
        r2 = g.op("Add", g.op("Mul", o, c4), g.op("Mul", e, s4))
        out = g.op("Concat", r1, r2, axis=3)
    return g.op("Reshape", out, g.const(f"{tag}.s2", np.array([0, n_heads * d], np.int64)))


_ATTENTION_INPUTS = ("past_k", "past_v", "kv_index", "cos", "sin", "mask", "perm")


def _attention_inputs(dims: Dims) -> list:
    f, D, kvh = TensorProto.FLOAT, dims.head_dim, dims.n_kv_head
    return [
        helper.make_tensor_value_info("past_k", f, [kvh, dims.context, D]),
        helper.make_tensor_value_info("past_v", f, [kvh, dims.context, D]),
        helper.make_tensor_value_info("kv_index", TensorProto.INT64, [kvh, "N", 2]),
        helper.make_tensor_value_info("cos", f, ["N", D // 2]),
        helper.make_tensor_value_info("sin", f, ["N", D // 2]),
        helper.make_tensor_value_info("mask", f, ["N", dims.context]),
        helper.make_tensor_value_info("perm", TensorProto.INT64, ["N", dims.context]),
    ]


def _attention(g: _G, q: str, k: str, v: str, dims: Dims) -> tuple[str, str, str]:
    """RoPE, new K/V scattered into the cache, masked GQA: -> (attn [N, nh*D], k_new, v_new)."""
    H, D, nh, kvh = dims.hidden, dims.head_dim, dims.n_head, dims.n_kv_head
    grp = nh // kvh
    q = _rope(g, q, "cos", "sin", nh, D, dims.rope_style, "rq")
    k = _rope(g, k, "cos", "sin", kvh, D, dims.rope_style, "rk")
    kv_shape = g.const("kv_shape", np.array([0, kvh, D], np.int64))
    k_new = g.op("Transpose", g.op("Reshape", k, kv_shape), perm=[1, 0, 2])
    v_new = g.op("Transpose", g.op("Reshape", v, kv_shape), perm=[1, 0, 2])
    k_all = g.op("ScatterND", "past_k", "kv_index", k_new)
    v_all = g.op("ScatterND", "past_v", "kv_index", v_new)
    # q [N, nh*D] -> [KVH, G*N, D] so GQA needs no repeated K/V
    q4 = g.op("Transpose", g.op("Reshape", q, g.const("q4s", np.array([0, kvh, grp, D], np.int64))), perm=[1, 2, 0, 3])
    q3 = g.op("Reshape", q4, g.const("q3s", np.array([kvh, -1, D], np.int64)))
    scores = g.op("FusedMatMul", q3, k_all, domain=MS, transB=1, alpha=float(1.0 / np.sqrt(D)))
    s4 = g.op("Reshape", scores, g.const("s4s", np.array([kvh, grp, -1, dims.context], np.int64)))
    # Each row sees its visible keys first, in position order, then the masked rest:
    # the layout of a plain autoregressive step. The softmax *and* P@V run in that
    # order (V is gathered per row), so a tree node's attention is bit-identical to
    # the one it would get decoded alone: GEMMs sum K in blocks, so zeros in other
    # places would regroup the sum and change the last bit.
    full = g.const("pshape", np.array([kvh, grp, 1, 1], np.int64))
    perm = g.op("Tile", g.op("Unsqueeze", g.op("Unsqueeze", "perm", g.const("ax0", np.array([0], np.int64))),
                             g.const("ax0b", np.array([0], np.int64))), full)
    sp = g.op("Add", g.op("GatherElements", s4, perm, axis=3), "mask")
    probs = g.op("Transpose", g.op("Softmax", sp, axis=-1), perm=[0, 2, 1, 3])  # [KVH, N, G, C]
    v_rows = g.op("Gather", v_all, "perm", axis=1)  # [KVH, N, C, D], each row's keys in its order
    ctx = g.op("MatMul", probs, v_rows)  # [KVH, N, G, D]
    attn = g.op("Reshape", g.op("Transpose", ctx, perm=[1, 0, 2, 3]), g.const("as", np.array([-1, H], np.int64)))
    return attn, k_new, v_new


def _kv_outputs(g: _G, k_new: str, v_new: str, dims: Dims) -> list:
    g.nodes.append(helper.make_node("Identity", [k_new], ["k_new"]))
    g.nodes.append(helper.make_node("Identity", [v_new], ["v_new"]))
    kvh, D = dims.n_kv_head, dims.head_dim
    return [helper.make_tensor_value_info("k_new", TensorProto.FLOAT, [kvh, "N", D]),
            helper.make_tensor_value_info("v_new", TensorProto.FLOAT, [kvh, "N", D])]


def build_layer(dims: Dims, mats: dict[str, MatSpec], accuracy: int) -> bytes:
    """Serialized ONNX model of one decoder layer with MatMulNBits weights (resident models).

    Inputs: ``x`` [N, H]; ``past_k``/``past_v`` [KVH, C, D] (the layer's whole
    cache); ``kv_index`` int64 [KVH, N, 2] (head, slot) where the new rows go;
    ``cos``/``sin`` [N, D/2] at each token's position; ``perm`` [N, C] each row's
    slots, visible ones first in position order;
    ``mask`` [N, C] additive, in ``perm`` order (0 for the first visible columns).
    Outputs: ``y`` [N, H], ``k_new``/``v_new`` [KVH, N, D].
    """
    g = _G()
    H, D, kvh = dims.hidden, dims.head_dim, dims.n_kv_head
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("x", f, ["N", H])] + _attention_inputs(dims)
    vec = {name: g.external(name, ((H if "norm" in name or name == "attn_q.bias" else kvh * D),), f) for name in LAYER_VECS}
    xn = g.rmsnorm("x", vec["attn_norm"], dims.rms_eps)
    q = g.op("Add", g.matmul(xn, "attn_q", mats["attn_q"], accuracy), vec["attn_q.bias"])
    k = g.op("Add", g.matmul(xn, "attn_k", mats["attn_k"], accuracy), vec["attn_k.bias"])
    v = g.op("Add", g.matmul(xn, "attn_v", mats["attn_v"], accuracy), vec["attn_v.bias"])
    attn, k_new, v_new = _attention(g, q, k, v, dims)
    h = g.op("Add", "x", g.matmul(attn, "attn_output", mats["attn_output"], accuracy))
    hn = g.rmsnorm(h, vec["ffn_norm"], dims.rms_eps)
    gate = g.matmul(hn, "ffn_gate", mats["ffn_gate"], accuracy)
    up = g.matmul(hn, "ffn_up", mats["ffn_up"], accuracy)
    act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)
    y = g.op("Add", h, g.matmul(act, "ffn_down", mats["ffn_down"], accuracy))
    g.nodes.append(helper.make_node("Identity", [y], ["y"]))
    outputs = [helper.make_tensor_value_info("y", f, ["N", H])] + _kv_outputs(g, k_new, v_new, dims)
    return _model(g, "decoder_layer", inputs, outputs)


def build_head(hidden: int, head: MatSpec, rms_eps: float, accuracy: int) -> bytes:
    """Final norm + LM head over the rows it is given: ``h`` [M, H] -> ``logits`` [M, V]."""
    g = _G()
    w = g.external("output_norm", (hidden,), TensorProto.FLOAT)
    hn = g.rmsnorm("h", w, rms_eps)
    logits = g.matmul(hn, "output", head, accuracy)
    g.nodes.append(helper.make_node("Identity", [logits], ["logits"]))
    inputs = [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["M", hidden])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["M", head.n])]
    return _model(g, "lm_head", inputs, outputs)


def _model(g: _G, name: str, inputs, outputs) -> bytes:
    graph = helper.make_graph(g.nodes, name, inputs, outputs, initializer=g.inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)], producer_name="lever-actors"
    )
    model.ir_version = 9
    return model.SerializeToString()

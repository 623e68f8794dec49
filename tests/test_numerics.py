"""Golden numerics: the ORT graphs against a float64 numpy reference of the same GGUF."""
import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize

from lever_actors.bundle import load_bundle
from lever_actors.model import Transformer, causal_layout
from lever_actors.ortrt import LaneConfig
from lever_actors.quant import map_weight
from tests.reference import ReferenceModel

TOKENS = [5, 17, 99, 3, 250, 42, 42, 7, 301, 12, 64, 200]


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def causal_logits(model: Transformer, tokens) -> np.ndarray:
    n = len(tokens)
    slots = np.arange(n)
    return model.logits(model.forward_resident(tokens, slots, slots, causal_layout(model.context, 0, n)))


@pytest.mark.parametrize("which", [0, 1])
def test_mapping_reproduces_gguf_dequantization_exactly(tiny_gguf, which):
    seen = set()
    for t in GGUFReader(str(tiny_gguf[which])).tensors:
        if len(t.shape) < 2:
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        raw = np.asarray(t.data).view(np.uint8).reshape(n, -1)
        ref = dequantize(raw, t.tensor_type).reshape(n, k).astype(np.float64)
        got = map_weight(raw, t.tensor_type, k, n).dequantize()
        assert rel_err(got, ref) < 1e-6, t.name
        seen.add(t.tensor_type.name)
    assert seen  # each file covers several GGUF types (see tools/make_tiny_models.py)


def test_tiny_pair_covers_every_supported_type(tiny_gguf):
    types = {t.tensor_type.name for g in tiny_gguf for t in GGUFReader(str(g)).tensors}
    assert {"Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K", "F16", "F32"} <= types


@pytest.mark.parametrize("which", [0, 1])
def test_fp32_forward_matches_float64_reference(tiny_gguf, tiny_bundles, which):
    ref = ReferenceModel(str(tiny_gguf[which])).logits(TOKENS)
    model = Transformer(load_bundle(tiny_bundles[which]), 64, LaneConfig(precision="fp32"))
    assert rel_err(causal_logits(model, TOKENS), ref) <= 1e-3


@pytest.mark.parametrize("precision,bound", [("fp32", 1e-3), ("int8", 5e-2)])
def test_native_layout_of_every_type_matches_reference(tiny_gguf, tmp_path, precision, bound):
    """The draft's Q8_0 blocks stay native, its Q4_0/Q4_1/Q5_0/F16 widen to exact fp32."""
    from lever_actors.convert import convert

    bundle = load_bundle(convert(tiny_gguf[1], tmp_path / "draft-native", progress=lambda m: None, layout="native"))
    assert bundle.layout == "native"
    qtypes = {spec["qtype"] for r in bundle.layers for spec in r.mats.values()}
    assert qtypes == {"Q8_0", "F32"}
    ref = ReferenceModel(str(tiny_gguf[1])).logits(TOKENS)
    model = Transformer(bundle, 64, LaneConfig(precision=precision))
    assert rel_err(causal_logits(model, TOKENS), ref) <= bound


def test_int8_forward_stays_close_to_reference(tiny_gguf, tiny_bundles):
    ref = ReferenceModel(str(tiny_gguf[0])).logits(TOKENS)
    model = Transformer(load_bundle(tiny_bundles[0]), 64, LaneConfig(precision="int8"))
    got = causal_logits(model, TOKENS)
    assert rel_err(got, ref) <= 5e-2
    assert np.mean(np.argmax(got, -1) == np.argmax(ref, -1)) >= 0.9


@pytest.mark.parametrize("threads", [1, 2])
def test_logits_do_not_depend_on_batch(tiny_bundles, threads):
    """A token's logits are bit-identical alone and inside any batch (needed for lossless speculation).

    Only the int8 path (the runtime's default) promises this: MatMulNBits' fp32 path
    dequantizes and calls a GEMM whose rounding depends on M, so ``--precision fp32``
    is a reference/debug setting.
    """
    precision = "int8"
    bundle = load_bundle(tiny_bundles[0])
    prompt = TOKENS[:6]
    tail = [9, 33, 120, 77, 5, 61, 200, 1, 14, 150, 300, 2, 8, 91, 44, 18]

    def run(batch):
        m = Transformer(bundle, 64, LaneConfig(threads=threads, precision=precision))
        m.prefill(prompt)
        outs = []
        for s in range(0, len(tail), batch):
            part = tail[s:s + batch]
            p0 = m.kv.length
            slots = np.arange(p0, p0 + len(part))
            outs.append(m.logits(m.forward_resident(part, slots, slots, causal_layout(m.context, p0, len(part)))))
            m.kv.commit(slots)
        return np.concatenate(outs)

    alone = run(1)
    for batch in (2, 4, 16):
        assert np.array_equal(alone, run(batch)), f"batch {batch} changed logits"


@pytest.mark.parametrize("context,n_prompt", [(64, 5), (1024, 252), (1024, 509)])
def test_tree_nodes_get_the_logits_of_their_own_path(tiny_bundles, context, n_prompt):
    """A tree pass with interleaved branches gives each node the logits plain decoding of its path gives.

    The long cases put the tree across a 256-slot boundary, where GEMMs split their sums.
    """
    from lever_actors.model import attention_layout

    bundle = load_bundle(tiny_bundles[0])
    prompt = (TOKENS * 60)[:n_prompt]
    #        node: 0=root  1     2     3     4     5
    tokens = [prompt[-1], 30, 31, 32, 33, 34]
    parents = [-1, 0, 0, 1, 2, 3]

    def path(i):
        out = []
        while i >= 0:
            out.append(i)
            i = parents[i]
        return out[::-1]

    def ar_logits(node_path):
        m = Transformer(bundle, context, LaneConfig())
        m.prefill(prompt[:-1])
        rows = []
        for n in node_path:
            p = m.kv.length
            rows.append(m.logits(m.forward_resident([tokens[n]], [p], [p], causal_layout(context, p, 1)))[0])
            m.kv.commit([p])
        return rows

    m = Transformer(bundle, context, LaneConfig())
    m.prefill(prompt[:-1])
    past = m.kv.length
    slots = np.arange(past, past + len(tokens))
    positions = [past + len(path(i)) - 1 for i in range(len(tokens))]
    layout = attention_layout(context, past, [[past + a for a in path(i)] for i in range(len(tokens))])
    tree = m.logits(m.forward_resident(tokens, positions, slots, layout))
    for leaf in (3, 4, 5):
        for node, row in zip(path(leaf), ar_logits(path(leaf))):
            assert np.array_equal(tree[node], row), f"node {node} on the path to {leaf}"


def test_native_layout_refuses_rows_it_cannot_hold():
    from gguf import GGMLQuantizationType as QT

    from lever_actors.errors import UnsupportedModel
    from lever_actors.quant import native_weight

    # 32-block types take any multiple of 32 (the draft's 896-wide rows); K-quants need whole 256-blocks
    assert native_weight(np.zeros((4, 96 // 32 * 34), np.uint8), QT.Q8_0, 96, 4)[0] == "Q8_0"
    assert native_weight(np.zeros((4, 96 // 32 * 22), np.uint8), QT.Q5_0, 96, 4)[0] == "Q5_0"
    with pytest.raises(UnsupportedModel, match="Q8_0 row length 48 is not a multiple of 32.*--layout ort"):
        native_weight(np.zeros((4, 48 * 34 // 32), np.uint8), QT.Q8_0, 48, 4)
    with pytest.raises(UnsupportedModel, match="Q4_K row length 896 is not a multiple of 256.*--layout ort"):
        native_weight(np.zeros((4, 896 * 144 // 256), np.uint8), QT.Q4_K, 896, 4)

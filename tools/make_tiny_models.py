"""Write a tiny random-weight GGUF pair (target + perturbed draft) for fast tests.

The pair goes through exactly the converter path the real models use. The
target's matrices are stored as Q4_K and Q6_K (the real target's types, with a
small test quantizer written here), its draft is the target plus noise stored as
Q5_0/Q8_0 (the real draft's types), so acceptance is realistic but imperfect.

    python tools/make_tiny_models.py OUT_DIR [--seed 0] [--arch qwen2|llama]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

try:
    from tools.tiny_vocab import build_tiny_vocab, write_tokenizer_fields
except ImportError:  # run as a script from tools/
    from tiny_vocab import build_tiny_vocab, write_tokenizer_fields

TINY = {"n_layer": 3, "hidden": 256, "ffn": 512, "n_head": 4, "n_kv_head": 2}


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """A plain (not error-optimal) Q4_K quantizer: rows of K -> bytes [N, K/256*144]."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(axis=3), 0.0)
    hi = x.max(axis=3)
    sub_scale = np.maximum(hi - lo, 1e-8) / 15.0
    sub_min = -lo
    d = (sub_scale.max(axis=2) / 63.0).astype(np.float16).astype(np.float32)
    dmin = (np.maximum(sub_min.max(axis=2), 1e-8) / 63.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(sub_scale / d[..., None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(sub_min / dmin[..., None]), 0, 63).astype(np.uint8)
    step = (d[..., None] * sc)[..., None]
    off = (dmin[..., None] * mn)[..., None]
    q = np.clip(np.round((x + off) / step), 0, 15).astype(np.uint8)  # [n, sb, 8, 32]
    scales = np.zeros((n, k // 256, 12), np.uint8)
    scales[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    scales[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((mn[..., 4:8] & 0x0F) << 4)
    qs = q.reshape(n, k // 256, 4, 2, 32)
    packed = (qs[:, :, :, 0, :] | (qs[:, :, :, 1, :] << 4)).reshape(n, k // 256, 128)
    head = np.concatenate([d[..., None].astype(np.float16).view(np.uint8).reshape(n, -1, 2),
                           dmin[..., None].astype(np.float16).view(np.uint8).reshape(n, -1, 2)], axis=2)
    return np.concatenate([head, scales, packed], axis=2).reshape(n, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """A plain Q6_K quantizer: rows of K -> bytes [N, K/256*210]."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 16, 16).astype(np.float32)
    sub = np.maximum(np.abs(x).max(axis=3), 1e-8) / 31.0
    d = (sub.max(axis=2) / 127.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(sub / d[..., None]), 1, 127).astype(np.int8)
    q = np.clip(np.round(x / (d[..., None, None] * sc[..., None])) + 32, 0, 63).astype(np.uint8)
    # element e of a 128-half: quarter = e // 32, l = e % 32 (the dequantizer's order)
    q = q.reshape(n, k // 256, 2, 4, 32)
    ql = np.zeros((n, k // 256, 2, 64), np.uint8)
    ql[..., 0:32] = (q[:, :, :, 0] & 0x0F) | ((q[:, :, :, 2] & 0x0F) << 4)
    ql[..., 32:64] = (q[:, :, :, 1] & 0x0F) | ((q[:, :, :, 3] & 0x0F) << 4)
    qh = ((q[:, :, :, 0] >> 4) | ((q[:, :, :, 1] >> 4) << 2) | ((q[:, :, :, 2] >> 4) << 4) | ((q[:, :, :, 3] >> 4) << 6))
    parts = [ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.view(np.uint8).reshape(n, -1, 16),
             d[..., None].astype(np.float16).view(np.uint8).reshape(n, -1, 2)]
    return np.concatenate(parts, axis=2).reshape(n, -1)


def _store(qtype: QT, w: np.ndarray) -> np.ndarray:
    if qtype == QT.Q4_K:
        return quantize_q4_k(w)
    if qtype == QT.Q6_K:
        return quantize_q6_k(w)
    if qtype in (QT.F16, QT.F32):
        return w.astype(np.float16 if qtype == QT.F16 else np.float32)
    return quantize(w.astype(np.float32), qtype)


def _weights(rng: np.random.Generator, dims: dict) -> dict[str, np.ndarray]:
    """Float weights as [N, K] rows (GGUF order) plus vectors."""
    h, f, kv = dims["hidden"], dims["ffn"], dims["n_kv_head"] * (dims["hidden"] // dims["n_head"])
    vocab = dims["vocab"]
    w = {"token_embd.weight": rng.normal(0, 1.0, (vocab, h)), "output.weight": rng.normal(0, 0.08, (vocab, h)),
         "output_norm.weight": rng.uniform(0.8, 1.2, h)}
    for i in range(dims["n_layer"]):
        p = f"blk.{i}."
        s = 0.6 / np.sqrt(h)
        w.update({
            p + "attn_norm.weight": rng.uniform(0.8, 1.2, h), p + "ffn_norm.weight": rng.uniform(0.8, 1.2, h),
            p + "attn_q.weight": rng.normal(0, s * 3, (h, h)), p + "attn_k.weight": rng.normal(0, s * 3, (kv, h)),
            p + "attn_v.weight": rng.normal(0, s, (kv, h)), p + "attn_output.weight": rng.normal(0, s, (h, h)),
            p + "ffn_gate.weight": rng.normal(0, s, (f, h)), p + "ffn_up.weight": rng.normal(0, s, (f, h)),
            p + "ffn_down.weight": rng.normal(0, 0.6 / np.sqrt(f), (h, f)),
        })
        if dims["arch"] == "qwen2":
            w.update({p + "attn_q.bias": rng.normal(0, 0.1, h), p + "attn_k.bias": rng.normal(0, 0.1, kv),
                      p + "attn_v.bias": rng.normal(0, 0.1, kv)})
    return w


TARGET_TYPES = {"token_embd.weight": QT.Q4_K, "output.weight": QT.Q6_K, "attn_v.weight": QT.Q6_K,
                "ffn_down.weight": QT.Q6_K}
DRAFT_TYPES = {"token_embd.weight": QT.Q5_0, "output.weight": QT.Q8_0, "attn_v.weight": QT.Q8_0,
               "ffn_down.weight": QT.Q4_0, "ffn_up.weight": QT.Q4_1, "attn_k.weight": QT.F16,
               "attn_q.weight": QT.F32}


def _qtype(name: str, table: dict, default: QT) -> QT:
    for suffix, t in table.items():
        if name.endswith(suffix):
            return t
    return default


def write_gguf(path: Path, dims: dict, weights: dict, vocab_spec: dict, types: dict, default: QT, name: str) -> Path:
    arch = dims["arch"]
    wr = GGUFWriter(str(path), arch)
    wr.add_name(name)
    wr.add_block_count(dims["n_layer"])
    wr.add_context_length(4096)
    wr.add_embedding_length(dims["hidden"])
    wr.add_feed_forward_length(dims["ffn"])
    wr.add_head_count(dims["n_head"])
    wr.add_head_count_kv(dims["n_kv_head"])
    wr.add_rope_freq_base(10000.0)
    wr.add_layer_norm_rms_eps(1e-6)
    write_tokenizer_fields(wr, vocab_spec)
    for tname, arr in weights.items():
        if arr.ndim == 1:
            # the draft keeps its FFN norms in F16 so the converter's F16 path is exercised
            half = name == "tiny draft" and "ffn_norm" in tname
            wr.add_tensor(tname, arr.astype(np.float16 if half else np.float32))
            continue
        qt = _qtype(tname, types, default)
        data = _store(qt, arr)
        if qt in (QT.F16, QT.F32):
            wr.add_tensor(tname, data)
        else:
            wr.add_tensor(tname, data, raw_shape=data.shape, raw_dtype=qt)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def make_tiny_pair(out_dir: str | Path, seed: int = 0, arch: str = "qwen2", draft_noise: float = 0.35) -> tuple[Path, Path]:
    """Write ``tiny-target.gguf`` and ``tiny-draft.gguf`` into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_spec = build_tiny_vocab()
    dims = dict(TINY, arch=arch, vocab=len(vocab_spec["tokens"]))
    rng = np.random.default_rng(seed)
    tw = _weights(rng, dims)
    target = write_gguf(out / "tiny-target.gguf", dims, tw, vocab_spec, TARGET_TYPES, QT.Q4_K, "tiny target")
    # the draft sees the target's quantized weights plus noise, as a distilled draft would
    dw = {}
    for n, w in tw.items():
        if w.ndim == 2:
            qt = _qtype(n, TARGET_TYPES, QT.Q4_K)
            base = dequantize(_store(qt, w), qt).reshape(w.shape)
            dw[n] = base + rng.normal(0, draft_noise * np.std(base), w.shape)
        else:
            dw[n] = w
    draft = write_gguf(out / "tiny-draft.gguf", dims, dw, vocab_spec, DRAFT_TYPES, QT.Q8_0, "tiny draft")
    return target, draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2")
    a = ap.parse_args()
    for p in make_tiny_pair(a.out_dir, a.seed, a.arch):
        print(p)


if __name__ == "__main__":
    main()

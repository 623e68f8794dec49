"""Float64 numpy forward pass straight from a GGUF file (independent of the bundle path).

Weights come from gguf's own dequantizer, not from lever_actors.quant, so a
mapping mistake in the converter shows up as a mismatch here.
"""
from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from lever_actors.convert import read_dims


class ReferenceModel:
    def __init__(self, path: str, layers: int | None = None) -> None:
        r = GGUFReader(path)
        self.dims = read_dims(r)
        self.t = {t.name: t for t in r.tensors}
        self.n_layer = self.dims["n_layer"] if layers is None else layers

    def w(self, name: str) -> np.ndarray:
        t = self.t[name]
        return dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64).reshape(
            [int(s) for s in reversed(t.shape)])

    def has(self, name: str) -> bool:
        return name in self.t

    def embed(self, tokens) -> np.ndarray:
        return self.w("token_embd.weight")[np.asarray(tokens)]

    def rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.dims["rms_eps"]) * w

    def rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:  # x [N, heads, D]
        d = x.shape[-1]
        inv = self.dims["rope_base"] ** (-np.arange(0, d, 2) / d)
        ang = pos[:, None] * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        if self.dims["rope_style"] == "neox":
            a, b = x[..., : d // 2], x[..., d // 2:]
            return np.concatenate([a * c - b * s, b * c + a * s], -1)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, b * c + a * s
        return out

    def layer(self, i: int, x: np.ndarray) -> np.ndarray:
        """One decoder layer over a causal sequence starting at position 0."""
        d = self.dims
        p = f"blk.{i}."
        n, hd, nh, kvh = len(x), d["head_dim"], d["n_head"], d["n_kv_head"]

        def lin(name, v):
            y = v @ self.w(p + name + ".weight").T
            return y + self.w(p + name + ".bias") if self.has(p + name + ".bias") else y

        xn = self.rms(x, self.w(p + "attn_norm.weight"))
        pos = np.arange(n, dtype=np.float64)
        q = self.rope(lin("attn_q", xn).reshape(n, nh, hd), pos)
        k = self.rope(lin("attn_k", xn).reshape(n, kvh, hd), pos)
        v = lin("attn_v", xn).reshape(n, kvh, hd)
        rep = nh // kvh
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        s = s + np.triu(np.full((n, n), -np.inf), 1)[None]
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = np.einsum("hqk,khd->qhd", s, v).reshape(n, nh * hd)
        h = x + a @ self.w(p + "attn_output.weight").T
        hn = self.rms(h, self.w(p + "ffn_norm.weight"))
        g, u = hn @ self.w(p + "ffn_gate.weight").T, hn @ self.w(p + "ffn_up.weight").T
        return h + (g / (1 + np.exp(-g)) * u) @ self.w(p + "ffn_down.weight").T

    def hidden(self, tokens) -> np.ndarray:
        x = self.embed(tokens)
        for i in range(self.n_layer):
            x = self.layer(i, x)
        return x

    def logits(self, tokens) -> np.ndarray:
        head = "output.weight" if self.has("output.weight") else "token_embd.weight"
        return self.rms(self.hidden(tokens), self.w("output_norm.weight")) @ self.w(head).T

"""Exact mapping of GGUF block quantization onto ONNX Runtime's MatMulNBits.

MatMulNBits computes ``y = A @ W^T`` with ``W[n, k] = scale[n, b] * (q[n, k] - zp)``
for blocks ``b`` of ``block`` consecutive k, default zero point 8 (4-bit) or 128
(8-bit). Every GGUF type the two Qwen files use fits that form without
requantizing:

* Q4_K, Q4_1: 4-bit codes, block 32, plus an offset per block
  (``W = s*q - m = s*(q-8) + (8*s - m)``). The offset is applied outside the
  kernel as ``blocksum(A) @ corr`` (``corr`` is ``[K/32, N]``), which is exact
  up to fp32 rounding.
* Q4_0: 4-bit, block 32, zero point 8, no offset.
* Q6_K: 8-bit, block 16 (``q - 32 + 128``), scale ``d * sc``.
* Q5_0, Q8_0: 8-bit, block 32.
* F16, F32: plain fp32 weights for MatMul.

Everything here is plain numpy over whole tensors; GGUF stores a ``[K, N]``
matrix (ne0 = K) as N rows of K contiguous elements.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT

from lever_actors.errors import UnsupportedModel

# bytes per block and elements per block of the GGUF types we read
BLOCK_LAYOUT = {
    QT.Q4_0: (18, 32),
    QT.Q4_1: (20, 32),
    QT.Q5_0: (22, 32),
    QT.Q8_0: (34, 32),
    QT.Q4_K: (144, 256),
    QT.Q6_K: (210, 256),
    QT.F16: (2, 1),
    QT.F32: (4, 1),
}
SUPPORTED_TYPES = tuple(t.name for t in BLOCK_LAYOUT)


@dataclass(frozen=True)
class MappedWeight:
    """One matrix in the form the layer graph consumes.

    kind ``q4``/``q8``: ``packed`` uint8 ``[N, K/block, block*bits/8]``, ``scales``
    fp32 ``[N, K/block]``, ``corr`` fp32 ``[K/32, N]`` or None.
    kind ``f32``: ``dense`` fp32 ``[K, N]``.
    """

    kind: str
    k: int
    n: int
    block: int = 0
    packed: np.ndarray | None = None
    scales: np.ndarray | None = None
    corr: np.ndarray | None = None
    dense: np.ndarray | None = None

    @property
    def bits(self) -> int:
        return {"q4": 4, "q8": 8}.get(self.kind, 32)

    def arrays(self) -> dict[str, np.ndarray]:
        """Named arrays, in the order they are laid out on flash."""
        if self.kind == "f32":
            return {"dense": self.dense}
        out = {"packed": self.packed, "scales": self.scales}
        if self.corr is not None:
            out["corr"] = self.corr
        return out

    def dequantize(self) -> np.ndarray:
        """Float64 ``[N, K]`` weights (for references and tests)."""
        if self.kind == "f32":
            return self.dense.astype(np.float64).T
        zp = 8 if self.kind == "q4" else 128
        q = unpack_codes(self.packed, self.bits).astype(np.float64)  # [N, nb, block]
        w = (q - zp) * self.scales.astype(np.float64)[:, :, None]
        w = w.reshape(self.n, self.k)
        if self.corr is not None:
            w += np.repeat(self.corr.astype(np.float64).T, 32, axis=1)
        return w


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes ``[N, nb, block]`` from MatMulNBits packing (low nibble first)."""
    if bits == 8:
        return packed
    lo = packed & 0x0F
    hi = packed >> 4
    return np.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_codes4(codes: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes ``[..., block]`` (values 0..15) two per byte, low nibble first."""
    c = codes.astype(np.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def tensor_nbytes(qtype: QT, n_elements: int) -> int:
    if qtype not in BLOCK_LAYOUT:
        raise UnsupportedModel(f"unsupported GGUF tensor type {qtype.name}; supported: {', '.join(SUPPORTED_TYPES)}")
    nb, ne = BLOCK_LAYOUT[qtype]
    return n_elements // ne * nb


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def _blocks(raw: np.ndarray, n: int, k: int, qtype: QT) -> np.ndarray:
    nbytes, nelem = BLOCK_LAYOUT[qtype]
    if k % nelem:
        raise UnsupportedModel(f"row length {k} is not a multiple of the {qtype.name} block {nelem}")
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // nelem, nbytes)


def map_weight(raw: np.ndarray, qtype: QT, k: int, n: int) -> MappedWeight:
    """Map GGUF tensor bytes of a ``[K, N]`` matrix to a :class:`MappedWeight`."""
    if qtype not in BLOCK_LAYOUT:
        raise UnsupportedModel(f"unsupported GGUF tensor type {qtype.name}; supported: {', '.join(SUPPORTED_TYPES)}")
    if qtype == QT.F32:
        w = np.frombuffer(np.ascontiguousarray(raw).tobytes(), dtype=np.float32).reshape(n, k)
        return MappedWeight("f32", k, n, dense=np.ascontiguousarray(w.T))
    if qtype == QT.F16:
        w = np.frombuffer(np.ascontiguousarray(raw).tobytes(), dtype=np.float16).reshape(n, k)
        return MappedWeight("f32", k, n, dense=np.ascontiguousarray(w.T.astype(np.float32)))
    b = _blocks(raw, n, k, qtype)
    return _MAPPERS[qtype](b, k, n)


def _map_q4_0(b: np.ndarray, k: int, n: int) -> MappedWeight:
    d = _f16(b[..., 0:2])[..., 0]
    qs = b[..., 2:18]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # element j<16 low, j>=16 high
    return MappedWeight("q4", k, n, 32, pack_codes4(codes), np.ascontiguousarray(d, np.float32))


def _map_q4_1(b: np.ndarray, k: int, n: int) -> MappedWeight:
    d = _f16(b[..., 0:2])[..., 0]
    m = _f16(b[..., 2:4])[..., 0]
    qs = b[..., 4:20]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    corr = (np.float32(8) * d + m).astype(np.float32)
    return MappedWeight("q4", k, n, 32, pack_codes4(codes), np.ascontiguousarray(d), np.ascontiguousarray(corr.T))


def _map_q5_0(b: np.ndarray, k: int, n: int) -> MappedWeight:
    d = _f16(b[..., 0:2])[..., 0]
    qh = b[..., 2:6].copy().view("<u4")  # [n, nb, 1]
    qs = b[..., 6:22]
    bit = np.arange(32, dtype=np.uint32)
    high = ((qh >> bit) & 1).astype(np.uint8)  # [n, nb, 32]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    codes = (low | (high << 4)).astype(np.int16) - 16 + 128
    return MappedWeight("q8", k, n, 32, codes.astype(np.uint8), np.ascontiguousarray(d))


def _map_q8_0(b: np.ndarray, k: int, n: int) -> MappedWeight:
    d = _f16(b[..., 0:2])[..., 0]
    q = b[..., 2:34].view(np.int8).astype(np.int16) + 128
    return MappedWeight("q8", k, n, 32, q.astype(np.uint8), np.ascontiguousarray(d))


def _k_scale_min(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """6-bit scales and mins of the 8 sub-blocks of a Q4_K super-block ([..., 12] bytes)."""
    s = sc.astype(np.uint8)
    scale = np.empty(s.shape[:-1] + (8,), np.uint8)
    mins = np.empty_like(scale)
    scale[..., :4] = s[..., 0:4] & 63
    mins[..., :4] = s[..., 4:8] & 63
    scale[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mins[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return scale, mins


def _map_q4_k(b: np.ndarray, k: int, n: int) -> MappedWeight:
    nsb = b.shape[1]
    d = _f16(b[..., 0:2])  # [n, nsb, 1]
    dmin = _f16(b[..., 2:4])
    sc, mn = _k_scale_min(b[..., 4:16])  # [n, nsb, 8]
    qs = b[..., 16:144].reshape(n, nsb, 4, 32)
    # each 64-element chunk: 32 low nibbles then 32 high nibbles of the same 32 bytes
    codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, nsb * 8, 32)
    scale = (d * sc.astype(np.float32)).reshape(n, nsb * 8)
    minv = (dmin * mn.astype(np.float32)).reshape(n, nsb * 8)
    corr = (np.float32(8) * scale - minv).astype(np.float32)
    return MappedWeight("q4", k, n, 32, pack_codes4(codes), np.ascontiguousarray(scale), np.ascontiguousarray(corr.T))


def _map_q6_k(b: np.ndarray, k: int, n: int) -> MappedWeight:
    nsb = b.shape[1]
    ql = b[..., 0:128].reshape(n, nsb, 2, 64)
    qh = b[..., 128:192].reshape(n, nsb, 2, 32)
    sc = b[..., 192:208].view(np.int8).astype(np.float32)  # [n, nsb, 16]
    d = _f16(b[..., 208:210])  # [n, nsb, 1]
    q1 = (ql[..., 0:32] & 0x0F) | (((qh >> 0) & 3) << 4)
    q2 = (ql[..., 32:64] & 0x0F) | (((qh >> 2) & 3) << 4)
    q3 = (ql[..., 0:32] >> 4) | (((qh >> 4) & 3) << 4)
    q4 = (ql[..., 32:64] >> 4) | (((qh >> 6) & 3) << 4)
    codes = np.stack([q1, q2, q3, q4], axis=3).reshape(n, nsb * 16, 16)  # order: half, quarter, l
    codes = (codes.astype(np.int16) - 32 + 128).astype(np.uint8)
    scale = (d * sc).reshape(n, nsb * 16).astype(np.float32)
    return MappedWeight("q8", k, n, 16, codes, np.ascontiguousarray(scale))


_MAPPERS = {
    QT.Q4_0: _map_q4_0,
    QT.Q4_1: _map_q4_1,
    QT.Q5_0: _map_q5_0,
    QT.Q8_0: _map_q8_0,
    QT.Q4_K: _map_q4_k,
    QT.Q6_K: _map_q6_k,
}


def dequantize_rows(raw_rows: np.ndarray, qtype: QT, k: int) -> np.ndarray:
    """Float32 ``[n, K]`` rows from GGUF-native row bytes (embedding lookup)."""
    from gguf.quants import dequantize

    return dequantize(np.ascontiguousarray(raw_rows, np.uint8), qtype).reshape(-1, k).astype(np.float32)


# GGUF types the native kernels (lever_actors.kernels) consume as they are stored.
NATIVE_TYPES = (QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.Q5_0)
KQUANT_TYPES = (QT.Q4_K, QT.Q6_K)  # 256-element super-blocks


def native_row_multiple(qtype: QT) -> int:
    """Row lengths the native layout takes for ``qtype``: K-quants need whole 256-blocks (the
    activation scale groups); everything else (kept or widened to fp32) needs 32."""
    return 256 if qtype in KQUANT_TYPES else 32


def native_weight(raw: np.ndarray, qtype: QT, k: int, n: int) -> tuple[str, np.ndarray]:
    """A ``[K, N]`` matrix in the native layout: ``(type name, data)``.

    Q4_K, Q6_K, Q8_0 and Q5_0 keep their GGUF block bytes (``uint8 [n, row_bytes]``).
    Any other supported type is widened to exact fp32 rows (``float32 [n, k]``):
    no rounding, but 4-8x the bytes, so a model made of such types streams slowly.
    """
    if qtype not in BLOCK_LAYOUT:
        raise UnsupportedModel(f"unsupported GGUF tensor type {qtype.name}; supported: {', '.join(SUPPORTED_TYPES)}")
    if k % native_row_multiple(qtype):
        raise UnsupportedModel(f"{qtype.name} row length {k} is not a multiple of {native_row_multiple(qtype)}: the "
                               "native layout cannot hold it (convert with --layout ort)")
    if qtype in NATIVE_TYPES:
        return qtype.name, _blocks(raw, n, k, qtype).reshape(n, -1)
    from gguf.quants import dequantize

    return "F32", np.ascontiguousarray(dequantize(np.ascontiguousarray(raw, np.uint8), qtype).reshape(n, k), np.float32)

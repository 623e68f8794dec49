"""Native matmuls straight from GGUF block bytes (the streamed target's weight path).

A thin checked wrapper over ``lever_actors._kernels`` (csrc/kernels.c). Weights
are consumed in the bytes the GGUF file stores, so a streamed layer is usable
the moment its read completes: no session build, no prepack, no copy.

Activations are quantized per row to int8 with one scale per group of 256
elements (:func:`quantize_rows`; the last group of a row that is a multiple of 32
but not of 256, like the 0.5B draft's 896, is partial), so a token's result never depends on the other rows of
its pass; :func:`matmul` splits the *output* columns across threads, never a
reduction, so results are also independent of the thread count.

Where llama.cpp's CPU backend computes the same thing, the arithmetic is its arithmetic, bit for bit
(q8_K quantization, the K-quant dot products' lanes and sums, SwiGLU's exp, rotary tables and
rotation, RMS norm, Q4_K dequantization; tests/golden/llamacpp_kernels.npz holds its own results):
greedy decoding then follows llama.cpp's choice on near-ties wherever attention allows.
The one exception is lever's draft in AMX tile strips (Q4_0T, :func:`tiled_q4_0`), whose arithmetic
is its own (the same bits on AMX and in the portable loop); the draft only proposes tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

try:
    from lever_actors import _kernels
except ImportError as e:  # pragma: no cover - a broken install, not a runtime condition
    raise ImportError(
        "lever_actors._kernels is not built; reinstall with `pip install -e .` (needs a C compiler)"
    ) from e

QK = 256
# Q5_0R: Q5_0 with its block pairs rearranged in place for the SIMD kernels (resident weights only,
# see repacked_for_cpu); the same numbers, the same results, the same size
# Q4_0: the draft's matrices requantized at load (requantized_q4_0), never the target's; Q4_0T: those in
# strips of 16 rows for AMX tiles (tiled_q4_0)
TYPES = {"Q4_K": 0, "Q6_K": 1, "Q8_0": 2, "F32": 3, "Q5_0": 4, "Q5_0R": 5, "Q4_0": 6, "Q4_0R": 7, "Q4_0T": 8}
BLOCK = {"Q4_K": (144, 256), "Q6_K": (210, 256), "Q8_0": (34, 32), "F32": (4, 1), "Q5_0": (22, 32), "Q5_0R": (22, 32),
         "Q4_0": (18, 32), "Q4_0R": (18, 32), "Q4_0T": (18, 32)}
TILE_ROWS = 16  # a Q4_0T matrix's rows come in strips of this many
KQUANTS = ("Q4_K", "Q6_K")  # super-blocks of 256: their rows must be whole activation groups


def row_multiple(qtype: str) -> int:
    """What a row length must be a multiple of for ``qtype`` (256 for K-quants, else 32)."""
    return QK if qtype in KQUANTS else 32


def groups(k: int) -> int:
    """Activation scale groups of a row of ``k`` (the last one may be partial)."""
    return -(-k // QK)


def simd() -> str:
    """Which code path was compiled in: ``avx512-vnni``, ``avx2`` or ``portable`` (AMX: :func:`amx_state`)."""
    return _kernels.simd()


class QuantizedRows(NamedTuple):
    q: np.ndarray  # int8 [N, K]
    d: np.ndarray  # float32 [N, groups(K)]
    bsums: np.ndarray  # int32 [N, 16 * groups(K)]


def row_bytes(qtype: str, k: int) -> int:
    nb, ne = BLOCK[qtype]
    return k // ne * nb


@dataclass(frozen=True)
class NativeMatrix:
    """A ``[K, N]`` matrix as GGUF stores it: ``n`` rows of ``k`` elements in block bytes."""

    qtype: str
    k: int
    n: int
    data: np.ndarray  # uint8 [n, row_bytes] (float32 [n, k] for F32)

    def __post_init__(self) -> None:
        if self.qtype not in TYPES:
            raise ValueError(f"unsupported native weight type {self.qtype!r}; supported: {', '.join(TYPES)}")
        if self.k % row_multiple(self.qtype):
            raise ValueError(f"row length {self.k} is not a multiple of {row_multiple(self.qtype)}")
        dtype, shape = (np.float32, (self.n, self.k)) if self.qtype == "F32" else (np.uint8, (self.n, row_bytes(self.qtype, self.k)))
        if self.data.dtype != dtype or self.data.shape != shape:
            raise ValueError(f"{self.qtype} [{self.k}, {self.n}] needs {np.dtype(dtype).name} data of shape {shape}, "
                             f"got {self.data.dtype} {self.data.shape}")
        if not self.data.flags.c_contiguous:
            raise ValueError("weight data must be C-contiguous")
        if self.qtype == "Q4_0T" and self.n % TILE_ROWS:
            raise ValueError(f"Q4_0T has rows in strips of {TILE_ROWS}, got {self.n}")


def _rows(x: np.ndarray, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2 or x.dtype != np.float32:
        raise ValueError(f"{what} must be a float32 [N, K] array, got {x.dtype} {x.shape}")
    return np.ascontiguousarray(x)


def quantize_rows(x: np.ndarray) -> QuantizedRows:
    x = _rows(x, "activations")
    n, k = x.shape
    if k % 32:
        raise ValueError(f"row length {k} is not a multiple of 32")
    g = groups(k)
    out = QuantizedRows(np.empty((n, k), np.int8), np.empty((n, g), np.float32), np.empty((n, 16 * g), np.int32))
    _kernels.quantize_rows(x, out.q, out.d, out.bsums, n, k)
    return out


_EMPTY = np.zeros(1, np.uint8)


def matmul(w: NativeMatrix, a: QuantizedRows | np.ndarray, threads: int = 1, out: np.ndarray | None = None) -> np.ndarray:
    """``a @ W^T`` -> float32 ``[N, w.n]``; ``a`` quantized rows (int8 path) or float32 rows (fp32 path)."""
    if isinstance(a, QuantizedRows):
        n, k = a.q.shape
        g = groups(k)
        for arr, dtype, shape in ((a.q, np.int8, (n, k)), (a.d, np.float32, (n, g)), (a.bsums, np.int32, (n, 16 * g))):
            if arr.dtype != dtype or arr.shape != shape:
                raise ValueError(f"quantized rows: expected {np.dtype(dtype).name} {shape}, got {arr.dtype} {arr.shape}")
        args = (a.q, a.d, a.bsums, None)
        if w.qtype == "F32":  # fp32 weights take the int8 rows' values (q * d) on the fp32 path
            x = (a.q * np.repeat(a.d, QK, axis=1)[:, :k]).astype(np.float32)
            args = (_EMPTY, _EMPTY, _EMPTY, x)
    else:
        x = _rows(a, "activations")
        n, k = x.shape
        args = (_EMPTY, _EMPTY, _EMPTY, x)
    if k != w.k:
        raise ValueError(f"activations have {k} columns, the matrix expects {w.k}")
    if out is None:
        out = np.empty((n, w.n), np.float32)
    elif out.shape != (n, w.n) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float32 [{n}, {w.n}] array")
    if n:
        _kernels.matmul(TYPES[w.qtype], w.data, w.n, w.k, *args, n, out, w.n, int(threads))
    return out


def repacked_for_cpu(w: NativeMatrix) -> NativeMatrix:
    """``w`` in the layout this build's kernels compute fastest from, rearranged in place (its buffer
    must be writable and no longer read as GGUF blocks): Q5_0 becomes Q5_0R on AVX2 and AVX-512 builds,
    where unpacking the GGUF layout was half of the 0.5B draft's time (AVX2: a one-row 896 x 4864
    product took 0.24 ms instead of 0.57, the same bits), and Q4_0 (the requantized draft) Q4_0R on
    AVX-512 builds. Other builds and types: ``w`` itself.
    For resident weights only: a streamed layer's buffer is reused for other layers' bytes."""
    if w.qtype == "Q5_0" and simd() != "portable" or w.qtype == "Q4_0" and simd() == "avx512-vnni":
        _kernels.repack_pairs(TYPES[w.qtype], w.data, w.n, w.k, True)
        return NativeMatrix(w.qtype + "R", w.k, w.n, w.data)
    return w


def amx(on: bool | None = None) -> bool:
    """Whether Q4_0T matmuls run on AMX tiles (built for, and granted by the kernel: asked once per
    process, on first use); ``on`` turns it on (where it can be) or off, as tests do to check AMX
    against the portable arithmetic."""
    return _kernels.amx(-1 if on is None else int(on))[0]


def amx_state() -> tuple[bool, bool, int]:
    """(AMX on, the build has AMX kernels, the kernel's refusal errno or 0) for Q4_0T matmuls."""
    return _kernels.amx(-1)


def tiles_take(precision: str) -> bool:
    """Whether a lane of this activation ``precision`` can use Q4_0T: the tiles multiply int8 activations."""
    return precision == "int8"


def tiled_q4_0(w: NativeMatrix, in_place: bool = False) -> NativeMatrix:
    """Q4_0 ``w`` in strips of 16 rows for AMX tiles (layout and arithmetic in csrc/kernels.c,
    Q4_0T); a new array, or ``w``'s own rearranged (``in_place``: then it is no longer Q4_0). Its
    bits differ from Q4_0's (one chain of fused adds per output, not eight lanes), so for the draft
    only, like Q4_0 itself."""
    if w.qtype != "Q4_0":
        raise ValueError(f"only Q4_0 rows are tiled, not {w.qtype}")
    out = w.data if in_place else np.empty_like(w.data)
    _kernels.tile_q4_0(w.data, w.n, w.k, out, True)
    return NativeMatrix("Q4_0T", w.k, w.n, out)


def for_draft_cpu(w: NativeMatrix, tiles: bool) -> NativeMatrix:
    """A resident draft matrix in the layout its kernels compute fastest from, rearranged in place
    (as :func:`repacked_for_cpu`): Q4_0 in AMX tile strips where ``tiles`` (and its rows are whole
    strips), else :func:`repacked_for_cpu`'s."""
    if tiles and w.qtype == "Q4_0" and w.n % TILE_ROWS == 0:
        return tiled_q4_0(w, in_place=True)
    return repacked_for_cpu(w)


def untiled_q4_0(w: NativeMatrix) -> NativeMatrix:
    """The Q4_0 rows a Q4_0T matrix was made from (a new array)."""
    if w.qtype != "Q4_0T":
        raise ValueError(f"only Q4_0T rows are untiled, not {w.qtype}")
    out = np.empty_like(w.data)
    _kernels.tile_q4_0(w.data, w.n, w.k, out, False)
    return NativeMatrix("Q4_0", w.k, w.n, out)


REQUANTIZABLE = ("Q5_0", "Q6_K", "Q8_0")  # the types requantized_q4_0 makes smaller (Q4_K is already 4.5 bits)


def requantized_q4_0(w: NativeMatrix) -> NativeMatrix:
    """``w`` requantized to Q4_0 (a new array; gguf's reference quantizer of the weights as GGUF
    dequantizes them): 18 bytes per 32 weights against Q5_0's 22, Q6_K's 26 and Q8_0's 34. Lossless
    for the draft only, whose proposals the target verifies: a Q4_0 draft proposed what the Q5_0 one
    did (6.69 against 6.70 tokens accepted per chain-8 pass on HumanEval 10:40), for less memory and
    fewer bytes read per draft token. Never for the target."""
    if w.qtype not in REQUANTIZABLE:
        raise ValueError(f"requantizing {w.qtype} to Q4_0 saves nothing; requantizable: {', '.join(REQUANTIZABLE)}")
    out = np.empty((w.n, row_bytes("Q4_0", w.k)), np.uint8)
    if w.n:
        _kernels.requantize_q4_0(TYPES[w.qtype], w.data, w.n, w.k, out)
    return NativeMatrix("Q4_0", w.k, w.n, out)


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x = _rows(x, "x")
    weight = np.ascontiguousarray(weight, np.float32)
    if weight.shape != (x.shape[1],):
        raise ValueError(f"norm weight has shape {weight.shape}, expected ({x.shape[1]},)")
    out = np.empty_like(x)
    _kernels.rmsnorm(x, weight, out, x.shape[0], x.shape[1], float(eps))
    return out


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    gate, up = np.ascontiguousarray(gate), np.ascontiguousarray(up)
    if gate.dtype != np.float32 or up.dtype != np.float32 or gate.shape != up.shape:
        raise ValueError(f"gate and up must be float32 arrays of one shape, got {gate.dtype} {gate.shape}, {up.dtype} {up.shape}")
    out = np.empty_like(gate)
    _kernels.swiglu(gate, up, out, gate.size)
    return out


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, perm: np.ndarray, lengths: np.ndarray,
              n_head: int, scale: float, threads: int = 1) -> np.ndarray:
    """Grouped-query attention of ``q`` [N, n_head*D] over the cache [KVH, C, D] (fp32 or fp16).

    Row ``r`` attends to keys ``perm[r, :lengths[r]]`` in that order (its prefix,
    then its ancestors and itself), so a tree node reduces exactly like the
    autoregressive step it stands for; masked keys are never touched.
    """
    q = _rows(q, "q")
    kv_type = np.float16 if k_cache.dtype == np.float16 else np.float32  # half rows are read as they are
    k_cache, v_cache = np.ascontiguousarray(k_cache, kv_type), np.ascontiguousarray(v_cache, kv_type)
    kvh, c, d = k_cache.shape
    n = q.shape[0]
    if q.shape[1] != n_head * d or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {q.shape} and caches {k_cache.shape}/{v_cache.shape} do not fit {n_head} heads")
    lengths = np.ascontiguousarray(lengths, np.int64)
    if np.shape(perm) != (n, c) or lengths.shape != (n,):
        raise ValueError(f"perm must be [{n}, {c}] and lengths [{n}], got {np.shape(perm)} and {lengths.shape}")
    shared = n > 0 and perm.strides[0] == 0  # one key order broadcast to every row (causal_layout)
    perm = np.ascontiguousarray(perm[0] if shared else perm, np.int64)
    out = np.empty_like(q)
    _kernels.attention(q, k_cache, v_cache, perm, lengths, out, n, n_head, kvh, d, c, float(scale), int(threads),
                       kv_type == np.float16, shared)
    return out


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_heads: int, style: str) -> np.ndarray:
    """Rotary embedding of ``x`` [N, heads*D] with ``cos``/``sin`` [N, D/2] (elementwise, so row-independent).

    ``neox`` rotates the pairs (i, i + D/2); otherwise adjacent pairs (2i, 2i+1), as GGUF stores llama's q/k.
    """
    x = _rows(x, "x")
    n = x.shape[0]
    d = x.shape[1] // n_heads
    cos, sin = np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32)
    if x.shape[1] != n_heads * d or cos.shape != (n, d // 2) or sin.shape != cos.shape:
        raise ValueError(f"x {x.shape} does not split into {n_heads} heads with tables {cos.shape}/{sin.shape}")
    out = np.empty_like(x)
    _kernels.rope(x, cos, sin, n, n_heads, d, style == "neox", out)
    return out


def rope_tables(positions, half: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin ``[N, half]``: theta starts at the position and shrinks by ``base^(-1/half)`` per pair, in float."""
    positions = np.ascontiguousarray(positions, np.int64).reshape(-1)
    if half < 1:
        raise ValueError(f"a rotary table needs at least one pair, got {half}")
    cos, sin = np.empty((positions.size, half), np.float32), np.empty((positions.size, half), np.float32)
    _kernels.rope_tables(positions, positions.size, half, float(base), cos, sin)
    return cos, sin


def dequantize(qtype: str, rows: np.ndarray, k: int) -> np.ndarray:
    """Float32 ``[n, k]`` from GGUF row bytes ``uint8 [n, row_bytes]``."""
    if qtype not in TYPES:
        raise ValueError(f"unsupported native weight type {qtype!r}; supported: {', '.join(TYPES)}")
    rows = np.ascontiguousarray(rows, np.uint8)
    if rows.ndim != 2 or rows.shape[1] != row_bytes(qtype, k):
        raise ValueError(f"{qtype} rows of {k} elements are uint8 [n, {row_bytes(qtype, k)}], got {rows.shape}")
    if qtype == "Q4_0T":
        return dequantize("Q4_0", untiled_q4_0(NativeMatrix(qtype, k, rows.shape[0], rows)).data, k)
    out = np.empty((rows.shape[0], k), np.float32)
    if rows.shape[0]:
        _kernels.dequantize(TYPES[qtype], rows, rows.shape[0], k, out)
    return out

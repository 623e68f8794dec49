"""The native kernels (`lever_actors.kernels`) against numpy / gguf references.

What is checked, and why:
- `quantize_rows` is bit-exact with a numpy emulation of its float32 definition
  (all-zero blocks, negative maxima and exact .5 ties, which must round half to even),
  because every int8 matmul result depends on these exact q, d and bsums.
- `matmul` on Q4_K / Q6_K / Q8_0 (and F32) weights, on both the int8 path (QuantizedRows)
  and the float path, equals a float64 product with weights dequantized by gguf's own
  `dequantize`, so the kernel's block decoding is checked against an independent decoder.
  Output-row counts that are not multiples of 8/16 exercise the kernel's tail handling.
- Batch and thread invariance are BITWISE: a row's result must not depend on which other
  rows share the call, how many there are, or how many threads run it. Speculative
  decoding verifies trees in batches and must reproduce single-token decoding exactly.
- `rmsnorm` / `swiglu` accuracy (1e-6 relative of float64) and position/batch invariance.
- Bad shapes, dtypes and sizes raise ValueError with a message, instead of reading out of
  bounds or silently reinterpreting bytes (a matching byte count alone is not enough).
- q8_K quantization, the K-quant dot products, SwiGLU and Q4_K dequantization are bit-identical
  to llama.cpp's CPU functions on stored inputs (tests/golden/llamacpp_kernels.npz).
"""
import functools
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from lever_actors import kernels as K

BLOCK = {"Q4_K": (256, 144), "Q6_K": (256, 210), "Q8_0": (32, 34), "Q5_0": (32, 22), "Q4_0": (32, 18)}  # elements, bytes per block
QTYPES = list(BLOCK)
F16_FIELDS = {"Q4_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,), "Q5_0": (0,), "Q4_0": (0,)}  # byte offsets of f16 scales
BLOCK32 = ["Q8_0", "Q5_0", "Q4_0"]  # rows need only be a multiple of 32: the last activation group is partial


def bits(a) -> np.ndarray:
    a = np.ascontiguousarray(a)
    assert a.dtype == np.float32
    return a.view(np.uint32)


def assert_bitwise(a, b):
    np.testing.assert_array_equal(bits(a), bits(b))


def max_rel_err(y, ref) -> float:
    return float(np.abs(np.asarray(y, np.float64) - ref).max() / np.abs(ref).max())


@functools.lru_cache(maxsize=None)
def weight(qtype: str, k: int, n: int, seed: int = 0):
    """(NativeMatrix, gguf-dequantized float32 [n, k]) of random valid GGUF blocks."""
    rng = np.random.default_rng([seed, k, n, len(qtype), ord(qtype[1])])
    if qtype == "F32":
        w = rng.standard_normal((n, k)).astype(np.float32) * np.float32(0.05)
        return K.NativeMatrix("F32", k, n, w), w
    elems, nbytes = BLOCK[qtype]
    blocks = rng.integers(0, 256, (n, k // elems, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = rng.uniform(1e-3, 2e-2, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, off:off + 2] = scale[..., None].view(np.uint8)
    data = blocks.reshape(n, -1)
    w = dequantize(data, getattr(QT, qtype))
    assert w.shape == (n, k) and np.isfinite(w).all()
    return K.NativeMatrix(qtype, k, n, data), w


def activations(rows: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, rows, k])
    x = rng.standard_normal((rows, k)).astype(np.float32)
    return x * rng.uniform(0.1, 10, (rows, 1)).astype(np.float32)  # per-row magnitudes differ


def quantize_reference(x: np.ndarray):
    """The spec's definition of quantize_rows, in float32 numpy (a partial last group is
    quantized over its own columns: zero padding changes neither its amax nor its sums)."""
    n, k = x.shape
    g = -(-k // 256)
    xb = np.zeros((n, g * 256), np.float32)
    xb[:, :k] = x
    xb = xb.reshape(n, g, 256)
    amax = np.abs(xb).max(-1)
    with np.errstate(divide="ignore"):
        iscale = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * iscale[..., None]), -127, 127).astype(np.int8).reshape(n, g * 256)
    with np.errstate(divide="ignore"):  # llama.cpp's q8_K keeps the reciprocal of the scale it applied
        d = np.where(amax > 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    bsums = q.reshape(n, g * 16, 16).sum(-1, dtype=np.int32)
    return q[:, :k], d, bsums


# ---- quantize_rows -------------------------------------------------------------------

def test_quantize_rows_matches_definition_exactly():
    x = activations(5, 1536, seed=1)
    x[1, 256:512] = 0.0                                   # all-zero block
    x[2, :256] = -np.abs(x[2, :256])                      # amax from a negative element
    ties = np.arange(-127, 127, dtype=np.float32) + np.float32(0.5)  # k + 0.5 exactly
    x[3, :254] = ties                                     # amax 127 -> iscale exactly 1
    x[3, 254:256] = (127.0, -127.0)
    x[3, 256:512] = np.resize(np.arange(-253, 254, 2, dtype=np.float32), 256)  # odd ints
    x[3, 511] = 254.0                                     # amax 254 -> iscale 0.5: .5 ties
    x[4, 768:1024] *= np.float32(1e-30)                   # tiny but nonzero scale
    got = K.quantize_rows(x)
    q, d, bsums = quantize_reference(x)
    assert got.q.dtype == np.int8 and got.d.dtype == np.float32 and got.bsums.dtype == np.int32
    np.testing.assert_array_equal(got.q, q)
    assert_bitwise(got.d, d)
    np.testing.assert_array_equal(got.bsums, bsums)
    assert (got.q[1, 256:512] == 0).all() and got.d[1, 1] == 0
    assert list(got.q[3, :6]) == [-126, -126, -124, -124, -122, -122]  # half to even


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 9), blocks=st.integers(1, 48), seed=st.integers(0, 2**32 - 1))
def test_quantize_rows_random(rows, blocks, seed):
    x = activations(rows, 32 * blocks, seed)  # any multiple of 32: whole and partial groups
    got, ref = K.quantize_rows(x), quantize_reference(x)
    np.testing.assert_array_equal(got.q, ref[0])
    assert_bitwise(got.d, ref[1])
    np.testing.assert_array_equal(got.bsums, ref[2])


# ---- matmul accuracy -----------------------------------------------------------------

SHAPES = [(1, 37), (3, 40), (17, 16), (64, 37)]  # (activation rows N, output rows n)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("k", [256, 512, 1536])
@pytest.mark.parametrize("rows,n", SHAPES)
def test_matmul_int8_path(qtype, k, rows, n):
    w, wdq = weight(qtype, k, n)
    qa = K.quantize_rows(activations(rows, k, seed=k + n))
    a = qa.q.astype(np.float64) * np.repeat(qa.d.astype(np.float64), 256, axis=1)[:, :k]
    y = K.matmul(w, qa)
    assert y.dtype == np.float32 and y.shape == (rows, n)
    assert max_rel_err(y, a @ wdq.astype(np.float64).T) < 1e-5


@pytest.mark.parametrize("qtype", QTYPES + ["F32"])
@pytest.mark.parametrize("k", [256, 512, 1536])
@pytest.mark.parametrize("rows,n", SHAPES)
def test_matmul_float_path(qtype, k, rows, n):
    w, wdq = weight(qtype, k, n)
    a = activations(rows, k, seed=k * n)
    y = K.matmul(w, a)
    assert y.dtype == np.float32 and y.shape == (rows, n)
    assert max_rel_err(y, a.astype(np.float64) @ wdq.astype(np.float64).T) < 1e-5


@pytest.mark.parametrize("qtype", BLOCK32 + ["F32"])
@pytest.mark.parametrize("k", [32, 96, 896, 4864 + 32])
@pytest.mark.parametrize("rows,n", [(1, 37), (2, 38), (3, 39), (4, 41), (5, 40), (8, 70), (11, 130)])
def test_matmul_rows_of_any_multiple_of_32(qtype, k, rows, n):
    """The draft's 896-wide rows: the last activation group is partial, on both paths. One to four
    rows take the few-row kernel (weight rows two or four at a time, a tail of odd ones); more rows
    take it four at a time over slices of 64 weight rows (AVX-512), or the grouped one: every row's
    bits must match its own 1-row product."""
    w, wdq = weight(qtype, k, n)
    ref = wdq.astype(np.float64).T
    x = activations(rows, k, seed=k + rows)
    assert max_rel_err(K.matmul(w, x), x.astype(np.float64) @ ref) < 1e-5
    qa = K.quantize_rows(x)
    a = qa.q.astype(np.float64) * np.repeat(qa.d.astype(np.float64), 256, axis=1)[:, :k]
    assert max_rel_err(K.matmul(w, qa), a @ ref) < 1e-5
    for i in range(rows):  # batch- and thread-invariant like every other width
        assert_bitwise(K.matmul(w, K.quantize_rows(x[i:i + 1]), threads=3)[0], K.matmul(w, qa)[i])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_kquant_every_row_count_matches_each_row_alone(qtype):
    """The AVX2 K-quant kernel takes up to 12 activation rows at once, each count compiled for its own,
    and more twelve at a time over slices of 32 weight rows: every count from 1 to 27, on 1 and 2
    threads, must give each row the bits of its own 1-row product and the float64 result. 4864 and 8960
    are the draft's and the target's ffn_down rows (19 and 35 blocks)."""
    for k in (4864, 8960):
        w, wdq = weight(qtype, k, 67)
        x = activations(27, k, seed=k)
        qa = K.quantize_rows(x)
        alone = np.stack([K.matmul(w, K.quantize_rows(x[i:i + 1]))[0] for i in range(27)])
        a = qa.q.astype(np.float64) * np.repeat(qa.d.astype(np.float64), 256, axis=1)
        assert max_rel_err(alone, a @ wdq.astype(np.float64).T) < 1e-5
        for rows in range(1, 28):
            for threads in (1, 2):
                assert_bitwise(K.matmul(w, K.quantize_rows(x[:rows]), threads=threads), alone[:rows])


def _build_portable(tmp_path):
    """csrc/kernels.c compiled with no -march (the portable paths), loaded beside the installed build."""
    import importlib.util
    import shutil
    import subprocess
    import sysconfig
    from pathlib import Path

    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not shutil.which(cc):
        pytest.skip(f"no C compiler ({cc})")
    src = Path(__file__).resolve().parent.parent / "csrc" / "kernels.c"
    so = tmp_path / f"_kernels{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run([cc, "-shared", "-fPIC", "-std=c11", "-O2", "-fno-wrapv", "-ffp-contract=off", "-fno-fast-math",
                    "-Werror=implicit-function-declaration", f"-I{sysconfig.get_paths()['include']}", str(src),
                    "-o", str(so), "-lpthread", "-lm"], check=True, capture_output=True)
    spec = importlib.util.spec_from_file_location("portable_build._kernels", so)  # PyInit__kernels
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_portable_build_gives_the_same_bits(tmp_path, monkeypatch):
    """The build without SIMD (what a machine without AVX2 compiles) gives the installed build's bits for
    every weight type in the GGUF layout, 1 to 13 activation rows, for the draft's AMX tile strips
    (Q4_0T, 1 to 17 rows), and for SwiGLU. It also catches a
    helper that only the SIMD branches define (a K-quant sum once was, and the portable build then
    called it undeclared)."""
    portable = _build_portable(tmp_path)
    cases = [(qtype, k, rows) for qtype, k in (("Q4_K", 768), ("Q6_K", 768), ("Q8_0", 896), ("Q5_0", 896), ("Q4_0", 896))
             for rows in (1, 3, 5, 9, 13)]
    g = np.random.default_rng(3).uniform(-30, 30, 1000).astype(np.float32)
    u = np.random.default_rng(4).standard_normal(1000).astype(np.float32)

    tiled = K.tiled_q4_0(weight("Q4_0", 896, 48)[0])  # AMX where the installed build has it

    def results():
        out = [K.matmul(weight(qtype, k, 41)[0], K.quantize_rows(activations(rows, k, seed=rows)), threads=2)
               for qtype, k, rows in cases]
        out += [K.matmul(tiled, K.quantize_rows(activations(rows, 896, seed=rows)), threads=2) for rows in (1, 3, 17)]
        return out + [K.swiglu(g, u)]

    def requantized():  # the portable f32-to-f16 rounding too (the draft's Q4_0 scales)
        return [K.requantized_q4_0(weight(qtype, k, 41)[0]).data for qtype, k in (("Q5_0", 896), ("Q6_K", 768))]

    installed, installed_q4 = results(), requantized()
    monkeypatch.setattr(K, "_kernels", portable)  # the same wrapper over the other build
    assert K.simd() == "portable"
    for got, want in zip(results(), installed):
        assert_bitwise(got, want)
    for got, want in zip(requantized(), installed_q4):
        np.testing.assert_array_equal(got, want)


SIMD = K.simd() != "portable"


@pytest.mark.skipif(not SIMD, reason="Q5_0R is the SIMD kernels' layout; the portable build keeps Q5_0")
@pytest.mark.parametrize("qtype", ["Q5_0", "Q4_0"])
@pytest.mark.parametrize("k", [32, 96, 224, 896, 4864 + 32])  # a lone block, odd last blocks, the draft's rows
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_repacked_pairs_give_the_same_bits(qtype, k, rows):
    """Resident Q5_0 weights (and the requantized draft's Q4_0 ones, on AVX-512) rearranged into block
    pairs (Q5_0R, Q4_0R) hold the same numbers: every product equals the GGUF layout's bit for bit for one
    to four rows and for more (four at a time), dequantizing gives the same floats, and undoing the
    repack restores the bytes."""
    if qtype == "Q4_0" and K.simd() != "avx512-vnni":
        pytest.skip("Q4_0R is the AVX-512 kernels' layout; other builds keep Q4_0")
    w, wdq = weight(qtype, k, 37)
    r = K.repacked_for_cpu(K.NativeMatrix(qtype, k, w.n, w.data.copy()))
    assert r.qtype == qtype + "R"
    assert not np.array_equal(r.data, w.data) or k == 32  # a lone block has no pair to rearrange
    qa = K.quantize_rows(activations(rows, k, seed=k * rows))
    assert_bitwise(K.matmul(r, qa), K.matmul(w, qa))
    assert_bitwise(K.matmul(r, qa, threads=3), K.matmul(w, qa))
    assert_bitwise(K.dequantize(qtype + "R", r.data, k), wdq)
    back = r.data.copy()
    K._kernels.repack_pairs(K.TYPES[qtype], back, w.n, k, False)
    assert np.array_equal(back, w.data)


@pytest.mark.parametrize("qtype,k", [("Q5_0", 896), ("Q5_0", 4864 + 32), ("Q6_K", 768), ("Q8_0", 96)])
def test_requantized_q4_0_is_ggufs_quantizer(qtype, k):
    """The draft's load-time requantization gives the bytes of gguf's own Q4_0 quantizer run on gguf's
    dequantization (ties of magnitude, all-zero blocks and codes that clip at 15 included), and the
    Q4_0 kernels compute them like every other type (checked above through BLOCK32)."""
    w, wdq = weight(qtype, k, 23)
    data = w.data.copy()
    data[0, :] = 0  # an all-zero row: d = 0, every code 8
    if qtype != "Q6_K":
        data[1, 2:4] = data[1, 4:6]  # two equal weights in a block (the first of the largest decides)
    w = K.NativeMatrix(qtype, k, 23, data)
    wdq = dequantize(data, getattr(QT, qtype))
    got = K.requantized_q4_0(w)
    assert got.qtype == "Q4_0" and got.data.shape == (23, k // 32 * 18)
    np.testing.assert_array_equal(got.data, quantize(wdq, QT.Q4_0).reshape(23, -1))
    with pytest.raises(ValueError, match="saves nothing"):
        K.requantized_q4_0(weight("Q4_K", 256, 3)[0])


# ---- Q4_0T: the draft's Q4_0 in AMX tile strips --------------------------------------------

@pytest.mark.parametrize("k", [32, 96, 896, 4864 + 32])  # a lone block, a partial group, the draft's rows
def test_tiled_q4_0_holds_the_same_numbers_and_untiles_to_the_same_bytes(k):
    w, wdq = weight("Q4_0", k, 48)
    t = K.tiled_q4_0(w)
    assert t.qtype == "Q4_0T" and t.data.shape == w.data.shape and not np.array_equal(t.data, w.data)
    np.testing.assert_array_equal(K.untiled_q4_0(t).data, w.data)
    np.testing.assert_array_equal(K.dequantize("Q4_0T", t.data, k), wdq)
    mine = K.NativeMatrix("Q4_0", k, 48, w.data.copy())  # a resident draft's: rearranged where it lies
    assert K.for_draft_cpu(mine, True).data is mine.data
    np.testing.assert_array_equal(mine.data, t.data)


@pytest.mark.parametrize("k", [96, 896, 4864 + 32])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, 33])  # more than a tile's 16 go 16 at a time
@pytest.mark.parametrize("n", [16, 48, 64, 208])  # one strip, three at once (AMX), three then one, thirteen
# (two threads take 6 + 7 strips, three 4 + 4 + 5: each a whole strip, the last groups one and two strips)
def test_tiled_q4_0_matmul_is_accurate_and_amx_gives_the_portable_bits(k, rows, n):
    """Q4_0T sums each block's products as one integer and fuses one add per block and output: accurate
    against float64, invariant to the batch and the thread split (strips stay whole), and AMX gives the
    portable loop's bits (where the CPU has AMX; the portable build is checked against the installed
    one above)."""
    w, wdq = weight("Q4_0", k, n)
    t = K.tiled_q4_0(w)
    qa = K.quantize_rows(activations(rows, k, seed=k + rows))
    a = qa.q.astype(np.float64) * np.repeat(qa.d.astype(np.float64), 256, axis=1)[:, :k]
    y = K.matmul(t, qa)
    assert max_rel_err(y, a @ wdq.astype(np.float64).T) < 1e-5
    for threads in (2, 3):
        assert_bitwise(K.matmul(t, qa, threads=threads), y)
    assert_bitwise(K.matmul(t, K.quantize_rows(activations(rows, k, seed=k + rows)[-1:])), y[-1:])
    if K.amx():
        try:
            assert not K.amx(False)
            assert_bitwise(K.matmul(t, qa), y)
        finally:
            assert K.amx(True)


def test_tiled_q4_0_refuses_what_it_cannot_compute():
    w, _ = weight("Q4_0", 96, 40)
    with pytest.raises(ValueError, match="strips of 16"):
        K.NativeMatrix("Q4_0T", 96, 40, w.data)
    with pytest.raises(ValueError, match="only Q4_0 rows"):
        K.tiled_q4_0(weight("Q5_0", 96, 16)[0])
    assert K.for_draft_cpu(K.NativeMatrix("Q4_0", 96, 40, w.data.copy()), True).qtype != "Q4_0T"  # not whole strips
    t = K.tiled_q4_0(weight("Q4_0", 96, 16)[0])
    with pytest.raises(ValueError, match="int8 activations"):
        K.matmul(t, activations(2, 96, 0))
    with pytest.raises(ValueError, match="16s"):
        K._kernels.tile_q4_0(w.data, 40, 96, np.empty_like(w.data), True)
    with pytest.raises(ValueError, match="requantized already"):
        K._kernels.requantize_q4_0(K.TYPES["Q4_0T"], t.data, 16, 96, np.empty_like(t.data))


def test_amx_is_on_where_the_cpu_and_the_build_have_it():
    """A build with AMX kernels on a CPU that has AMX gets the kernel's leave (else the draft would
    quietly take the portable loop: the runtime's note then gives the refusal's errno)."""
    on, built, err = K.amx_state()
    cpu = "amx_int8" in open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else False
    if not (built and cpu):
        pytest.skip(f"no AMX here (the build's AMX kernels: {built}, the CPU's: {cpu})")
    assert on and err == 0


def test_repack_leaves_other_types_and_keeps_the_fp32_path():
    for qtype in ("Q8_0", "Q4_K", "Q6_K"):
        w, _ = weight(qtype, 256, 8)
        assert K.repacked_for_cpu(w) is w
    if SIMD:  # --precision fp32 feeds float rows to the same resident (repacked) weights
        w, _ = weight("Q5_0", 896, 8)
        r = K.repacked_for_cpu(K.NativeMatrix("Q5_0", 896, 8, w.data.copy()))
        x = activations(3, 896, 0)
        assert_bitwise(K.matmul(r, x), K.matmul(w, x))


# ---- batch and thread invariance (bitwise) -------------------------------------------

@pytest.mark.parametrize("qtype", QTYPES + ["F32"])
@settings(max_examples=6, deadline=None)
@given(rows=st.integers(1, 33), seed=st.integers(0, 2**32 - 1), threads=st.sampled_from([2, 3, 4]),
       cut=st.integers(0, 32))
def test_matmul_batch_and_thread_invariant(qtype, rows, seed, threads, cut):
    w, _ = weight(qtype, 768, 301)  # enough output rows to split over 4 threads
    x = activations(rows, 768, seed)
    lo = min(cut, rows - 1)
    paths = [lambda v: v] if qtype == "F32" else [lambda v: v, K.quantize_rows]
    for prep in paths:
        full = K.matmul(w, prep(x), threads=1)
        assert_bitwise(K.matmul(w, prep(x), threads=threads), full)
        assert_bitwise(K.matmul(w, prep(x[lo:]), threads=threads), full[lo:])
        for i in range(rows):
            assert_bitwise(K.matmul(w, prep(x[i:i + 1]))[0], full[i])


def test_matmul_threads_from_two_lanes_at_once():
    """The drafting and verification lanes may both split a matmul over threads at the same time:
    one borrows the persistent worker pool, the other starts threads of its own. Neither may wait
    for the other forever, and every product keeps its one-thread bits."""
    import threading

    w, _ = weight("Q8_0", 896, 4864)
    xs = [K.quantize_rows(activations(rows, 896, seed=rows)) for rows in (1, 3)]
    want = [K.matmul(w, x, threads=1) for x in xs]
    bad = []

    def lane(i: int) -> None:
        for _ in range(200):
            for threads in (2, 3):
                if not np.array_equal(K.matmul(w, xs[i], threads=threads).view(np.uint32), want[i].view(np.uint32)):
                    bad.append((i, threads))

    lanes = [threading.Thread(target=lane, args=(i,)) for i in (0, 1)]
    for t in lanes:
        t.start()
    for t in lanes:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in lanes), "a lane never came back from a threaded matmul"
    assert not bad


# ---- rmsnorm and swiglu --------------------------------------------------------------

def rmsnorm_reference(x, w, eps):
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps) * w.astype(np.float64)


@pytest.mark.parametrize("rows,k,eps", [(1, 64, 1e-6), (5, 896, 1e-5), (3, 2048, 1e-6)])
def test_rmsnorm_accurate_and_batch_invariant(rows, k, eps):
    x = activations(rows, k, seed=k)
    x[-1] = 0.0                                           # zero row -> zeros, not NaN
    w = np.random.default_rng(k).uniform(-2, 2, k).astype(np.float32)
    y = K.rmsnorm(x, w, eps)
    assert y.dtype == np.float32 and y.shape == x.shape
    ref = rmsnorm_reference(x, w, eps)
    assert (np.abs(y - ref) <= 1e-6 * np.abs(ref)).all()
    for i in range(rows):
        assert_bitwise(K.rmsnorm(x[i:i + 1], w, eps)[0], y[i])


def swiglu_reference(g, u):
    g64 = g.astype(np.float64)
    return g64 / (1 + np.exp(-g64)) * u.astype(np.float64)


def test_swiglu_accurate():
    rng = np.random.default_rng(7)
    g = rng.uniform(-20, 20, (7, 300)).astype(np.float32)
    u = rng.standard_normal((7, 300)).astype(np.float32)
    y = K.swiglu(g, u)
    assert y.dtype == np.float32 and y.shape == g.shape
    ref = swiglu_reference(g, u)
    assert (np.abs(y - ref) <= 1e-6 * np.abs(ref)).all()
    extreme = np.array([-100, -90, -50, 0, 50, 90, 100], np.float32)
    y = K.swiglu(extreme, np.ones_like(extreme))
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, swiglu_reference(extreme, np.ones_like(extreme)),
                               rtol=1e-6, atol=1e-30)


def test_swiglu_position_invariant():
    rng = np.random.default_rng(8)
    g = rng.uniform(-8, 8, (7, 300)).astype(np.float32)
    u = rng.standard_normal((7, 300)).astype(np.float32)
    full = K.swiglu(g, u).ravel()
    gf, uf = g.ravel(), u.ravel()
    assert_bitwise(K.swiglu(gf, uf), full)
    assert_bitwise(K.swiglu(g.reshape(300, 7), u.reshape(300, 7)).ravel(), full)
    for start in range(9):
        for length in (1, 3, 7, 8, 15, 16, 17, 33):
            s = slice(start, start + length)
            assert_bitwise(K.swiglu(gf[s], uf[s]), full[s])


def test_swiglu_lanes_equal_the_scalar_exp_over_every_float_class():
    """The vector exp (16 lanes on AVX-512, 8 on AVX2) and the one-at-a-time tail give the same bits,
    at the edges too: exponents past +-192, results that overflow or underflow to subnormals, inf, nan."""
    rng = np.random.default_rng(9)
    patterns = np.arange(0, 2**32, 65521, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, 88.7, -88.7, 87.3, -87.4, 103.9, -103.9,
                      133.0, -133.0, 192.5, -192.5, 1e-40, -1e-40], np.float32)
    g = np.concatenate([patterns, edges, rng.uniform(-120, 120, 4000).astype(np.float32)])
    g = g[np.isfinite(g) | np.isinf(g)]  # NaN payloads aside (a NaN stays a NaN either way)
    g = g[: len(g) // 16 * 16]
    u = rng.standard_normal(g.size).astype(np.float32)
    lanes = K.swiglu(g, u)  # a multiple of 16: every element goes through the lanes (either build)
    one_at_a_time = np.concatenate([K.swiglu(g[i:i + 1], u[i:i + 1]) for i in range(g.size)])
    assert_bitwise(lanes, one_at_a_time)


# ---- rotary embedding ----------------------------------------------------------------

def test_rope_tables_follow_ggmls_float_recurrence():
    """theta starts at the position and is multiplied by base^(-1/half) per pair in float (as ggml
    does, which drifts from the exact angle at long positions); the tables are its cos and sin."""
    pos = np.array([0, 1, 7, 300, 4095])
    cos, sin = K.rope_tables(pos, 64, 1e6)
    scale = np.float32(np.float32(1e6) ** np.float32(-2.0 / 128))
    theta = pos.astype(np.float32)
    for j in range(64):
        np.testing.assert_allclose(cos[:, j], np.cos(theta.astype(np.float64)), atol=2e-7)
        np.testing.assert_allclose(sin[:, j], np.sin(theta.astype(np.float64)), atol=2e-7)
        theta = (theta * scale).astype(np.float32)


@pytest.mark.parametrize("style", ["neox", "adjacent"])
def test_rope_rotates_each_pair_and_is_row_invariant(style):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 2 * 32)).astype(np.float32)
    ang = rng.uniform(-3, 3, (5, 16))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    y = K.rope(x, cos, sin, 2, style)
    x3, y3 = x.reshape(5, 2, 32).astype(np.float64), y.reshape(5, 2, 32)
    a, b = (x3[..., :16], x3[..., 16:]) if style == "neox" else (x3[..., 0::2], x3[..., 1::2])
    ya, yb = (y3[..., :16], y3[..., 16:]) if style == "neox" else (y3[..., 0::2], y3[..., 1::2])
    c, s = cos[:, None, :].astype(np.float64), sin[:, None, :].astype(np.float64)
    np.testing.assert_allclose(ya, a * c - b * s, atol=1e-6)
    np.testing.assert_allclose(yb, a * s + b * c, atol=1e-6)
    for i in range(5):
        assert_bitwise(K.rope(x[i:i + 1], cos[i:i + 1], sin[i:i + 1], 2, style)[0], y[i])


# ---- errors --------------------------------------------------------------------------

def raises_value_error(fn, *args, **kw):
    with pytest.raises(ValueError) as info:
        fn(*args, **kw)
    assert str(info.value)


def test_bad_inputs_raise_value_error():
    raises_value_error(K.quantize_rows, np.ones((2, 300), np.float32))
    raises_value_error(K.quantize_rows, np.ones((2, 112), np.float32))
    raises_value_error(K.NativeMatrix, "Q4_K", 896, 4, np.zeros((4, 504), np.uint8))  # K-quants: whole 256-blocks
    raises_value_error(K.NativeMatrix, "Q5_0", 48, 4, np.zeros((4, 33), np.uint8))
    raises_value_error(K.NativeMatrix, "Q4_K", 512, 4, np.zeros((4, 287), np.uint8))
    raises_value_error(K.NativeMatrix, "Q4_K", 512, 4, np.zeros((3, 288), np.uint8))
    raises_value_error(K.NativeMatrix, "Q4_K", 384, 4, np.zeros((4, 216), np.uint8))
    raises_value_error(K.NativeMatrix, "Q6_K", 512, 4, np.zeros((4, 421), np.uint8))
    raises_value_error(K.NativeMatrix, "Q8_0", 512, 4, np.zeros((4, 16 * 34 + 1), np.uint8))
    raises_value_error(K.NativeMatrix, "F32", 512, 4, np.zeros((4, 511), np.float32))
    for qtype in QTYPES:
        w, _ = weight(qtype, 512, 37)
        raises_value_error(K.matmul, w, np.ones((2, 768), np.float32))
        raises_value_error(K.matmul, w, np.ones((2, 256), np.float32))
        raises_value_error(K.matmul, w, K.quantize_rows(np.ones((2, 1024), np.float32)))
    x = np.ones((2, 64), np.float32)
    raises_value_error(K.rmsnorm, x, np.ones(63, np.float32), 1e-6)
    raises_value_error(K.swiglu, x, np.ones((2, 65), np.float32))
    raises_value_error(K.rope, np.ones((2, 64), np.float32), np.ones((2, 8), np.float32), np.ones((2, 8), np.float32),
                       2, "neox")  # 2 heads of 32 need tables of 16 pairs
    raises_value_error(K.rope, np.ones((2, 63), np.float32), np.ones((2, 16), np.float32),
                       np.ones((2, 16), np.float32), 2, "neox")
    raises_value_error(K.rope_tables, [0, 1], 0, 1e6)
    raises_value_error(K.dequantize, "Q9_K", np.zeros((1, 144), np.uint8), 256)
    raises_value_error(K.dequantize, "Q4_K", np.zeros((1, 143), np.uint8), 256)
    raises_value_error(K.dequantize, "Q4_K", np.zeros((1, 144), np.uint8), 288)  # not whole 256-blocks


BAD_BUT_RIGHT_SIZE = {  # spec: data is uint8 [n, row_bytes] (float32 [n, k] for F32); bytes alone are not enough
    "Q4_K float32 data": lambda: K.NativeMatrix("Q4_K", 512, 4, np.zeros((4, 72), np.float32)),
    "Q4_K [2, 576] for n=4": lambda: K.NativeMatrix("Q4_K", 512, 4, np.zeros((2, 576), np.uint8)),
    "F32 uint8 data": lambda: K.NativeMatrix("F32", 256, 2, np.zeros((2, 1024), np.uint8)),
    "int16 q": lambda: K.matmul(weight("Q8_0", 512, 37)[0], K.quantize_rows(np.ones((2, 512), np.float32))
                                ._replace(q=np.ones((2, 512), np.int16))),
}


@pytest.mark.parametrize("case", BAD_BUT_RIGHT_SIZE)
def test_wrong_dtype_or_shape_with_right_byte_count_raises(case):
    raises_value_error(BAD_BUT_RIGHT_SIZE[case])


def _attention_reference(q, k, v, perm, lengths, n_head):
    """Float64 softmax attention of each row over its keys ``perm[r, :lengths[r]]``."""
    kvh, _, d = k.shape
    out = np.zeros((len(q), n_head * d))
    for r in range(len(q)):
        keys = perm[r, :lengths[r]]
        for h in range(n_head):
            g = h // (n_head // kvh)
            qh = q[r, h * d:(h + 1) * d].astype(np.float64)
            s = k[g, keys].astype(np.float64) @ qh / np.sqrt(d)
            p = np.exp(s - s.max())
            out[r, h * d:(h + 1) * d] = (p / p.sum()) @ v[g, keys].astype(np.float64)
    return out


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.sampled_from([(2, 1), (4, 2), (6, 2), (12, 2), (14, 2), (9, 1)]), st.sampled_from([8, 64, 128]),
       st.integers(0, 2**31 - 1))
def test_attention_over_half_rows_is_exact_widening_and_stays_batch_invariant(n, heads, d, seed):
    """fp16 KV rows: the kernel reads exactly the values an fp32 cache of the rounded rows holds,
    matches float64 to fp32 accuracy, and a row's result does not depend on its batch."""
    n_head, kvh = heads
    rng = np.random.default_rng(seed)
    c = 24
    k = rng.standard_normal((kvh, c, d)).astype(np.float16)
    v = rng.standard_normal((kvh, c, d)).astype(np.float16)
    q = rng.standard_normal((n, n_head * d)).astype(np.float32)
    perm = np.stack([rng.permutation(c) for _ in range(n)])
    lengths = rng.integers(1, c + 1, n)
    half = K.attention(q, k, v, perm, lengths, n_head, 1 / np.sqrt(d))
    widened = K.attention(q, k.astype(np.float32), v.astype(np.float32), perm, lengths, n_head, 1 / np.sqrt(d))
    np.testing.assert_array_equal(bits(half), bits(widened))
    np.testing.assert_allclose(half, _attention_reference(q, k, v, perm, lengths, n_head), rtol=1e-4, atol=1e-5)
    alone = K.attention(q[-1:], k, v, perm[-1:], lengths[-1:], n_head, 1 / np.sqrt(d))
    np.testing.assert_array_equal(bits(alone[0]), bits(half[-1]))


# ---- bit for bit with llama.cpp's CPU kernels -------------------------------------------

def test_kernels_match_llamacpp_bit_for_bit():
    """Inputs and llama.cpp's own results (tools/golden_llamacpp_kernels.py called its q8_K
    quantization, Q4_K/Q6_K dot products, SwiGLU and Q4_K dequantization): ours are identical,
    which keeps our greedy output on llama.cpp's near-ties."""
    from pathlib import Path

    g = np.load(Path(__file__).parent / "golden" / "llamacpp_kernels.npz")
    a = K.quantize_rows(g["x"])
    # llama.cpp scales by -127/max (max: the signed element of largest magnitude), so its d and
    # codes may both carry the opposite sign: the same numbers
    sign = np.sign(np.repeat(g["q8_d"], 256, axis=1)).astype(np.int8)
    np.testing.assert_array_equal(a.q * sign, g["q8_qs"])
    assert_bitwise(np.abs(a.d), np.abs(g["q8_d"]))
    k = g["x"].shape[1]
    for qtype, name in (("Q4_K", "q4_K"), ("Q6_K", "q6_K")):  # ggml's spelling in the file
        w = g[f"w_{name}"]
        assert_bitwise(K.matmul(K.NativeMatrix(qtype, k, w.shape[0], w), a), g[f"y_{name}"])
    assert_bitwise(K.dequantize("Q4_K", g["w_q4_K"], k), g["dequant_q4_K"])
    assert_bitwise(K.swiglu(g["gate"], g["up"]), g["swiglu"])

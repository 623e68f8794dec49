"""Write ``tests/golden/llamacpp_kernels.npz``: llama.cpp's own CPU results on fixed inputs.

    python tools/golden_llamacpp_kernels.py [--build-dir ~/.cache/lever-actors/llamacpp]

The native kernels reproduce llama.cpp's CPU arithmetic bit for bit where the two compute the same
thing: q8_K activation quantization, the Q4_K / Q6_K dot products (its AVX2 lane split and sums),
SwiGLU (its vectorized exp) and Q4_K dequantization (the embedding rows). This tool calls those
functions in the llama.cpp build that ``tools/peer_llamacpp.py`` makes (ctypes into
``libggml-cpu.so`` / ``libggml-base.so``) and stores inputs and outputs; ``tests/test_kernels.py``
checks our kernels against the file on any machine, without llama.cpp. Regenerate it only when the
llama.cpp pin changes.
"""
from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "tests" / "golden" / "llamacpp_kernels.npz"
Q8K_BYTES = 4 + 256 + 32  # float d, int8 qs[256], int16 bsums[16]
BLOCK_BYTES = {"q4_K": 144, "q6_K": 210}
F16_SCALES = {"q4_K": (0, 2), "q6_K": (208,)}


def inputs(rng: np.random.Generator, k: int = 512, m: int = 16, n: int = 3) -> dict[str, np.ndarray]:
    x = (rng.standard_normal((n, k)) * rng.uniform(0.05, 4.0, (n, 1))).astype(np.float32)
    x[1, :256] = -np.abs(x[1, :256])  # a block whose largest magnitude is negative
    out = {"x": x}
    for name, bpb in BLOCK_BYTES.items():
        w = rng.integers(0, 256, (m, k // 256 * bpb), dtype=np.uint8)
        for b in range(k // 256):
            for off in F16_SCALES[name]:
                scale = np.float16(rng.uniform(0.001, 0.03)).tobytes()
                w[:, b * bpb + off:b * bpb + off + 2] = np.frombuffer(scale, np.uint8)
        out[f"w_{name}"] = w
    out["gate"] = np.concatenate([rng.uniform(-12, 12, 992), [-100, -90, -50, 0, 1e-3, 50, 90, 100]]).astype(np.float32)
    out["up"] = rng.standard_normal(1000).astype(np.float32)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", type=Path, default=Path.home() / ".cache" / "lever-actors" / "llamacpp")
    a = ap.parse_args()
    bin_dir = a.build_dir / "build" / "bin"
    base = ctypes.CDLL(str(bin_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(bin_dir / "libggml-cpu.so"))
    cpu.ggml_cpu_init()
    vp = ctypes.c_void_p
    data = inputs(np.random.default_rng(20261201))
    x = data["x"]
    n, k = x.shape
    q8 = np.zeros((n, k // 256 * Q8K_BYTES), np.uint8)
    for i in range(n):
        cpu.quantize_row_q8_K(x[i].ctypes.data_as(vp), q8[i].ctypes.data_as(vp), ctypes.c_int64(k))
    blocks = q8.reshape(n, k // 256, Q8K_BYTES)
    data["q8_d"] = np.ascontiguousarray(blocks[:, :, :4]).view(np.float32).reshape(n, -1)
    data["q8_qs"] = np.ascontiguousarray(blocks[:, :, 4:260]).view(np.int8).reshape(n, k)
    s = ctypes.c_float()
    for name in BLOCK_BYTES:
        w = data[f"w_{name}"]
        dot = getattr(cpu, f"ggml_vec_dot_{name}_q8_K")
        y = np.empty((n, w.shape[0]), np.float32)
        for i in range(n):
            for j in range(w.shape[0]):
                dot(ctypes.c_int(k), ctypes.byref(s), ctypes.c_size_t(0), w[j].ctypes.data_as(vp), ctypes.c_size_t(0),
                    q8[i].ctypes.data_as(vp), ctypes.c_size_t(0), ctypes.c_int(1))
                y[i, j] = s.value
        data[f"y_{name}"] = y
    w = data["w_q4_K"]
    deq = np.empty((w.shape[0], k), np.float32)
    for j in range(w.shape[0]):
        base.dequantize_row_q4_K(w[j].ctypes.data_as(vp), deq[j].ctypes.data_as(vp), ctypes.c_int64(k))
    data["dequant_q4_K"] = deq
    sw = np.empty_like(data["gate"])
    cpu.ggml_vec_swiglu_f32(ctypes.c_int(sw.size), sw.ctypes.data_as(vp), data["gate"].ctypes.data_as(vp),
                            data["up"].ctypes.data_as(vp))
    data["swiglu"] = sw
    np.savez_compressed(OUT, **data)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()

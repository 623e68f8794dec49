"""Two builds of the native kernels on the real model's matrices: the same bits, and which is faster.

Usage::

    cp lever_actors/_kernels*.so /tmp/kernels-before.so        # the build to compare against
    # ... change csrc/kernels.c, then: python setup.py build_ext --inplace
    python tools/compare_kernel_builds.py /tmp/kernels-before.so lever_actors/_kernels*.so
    python tools/compare_kernel_builds.py A.so B.so --rows 1,4,6 --threads 2 --tensors ffn_down

Both builds are loaded into one process. ``--check`` (the default) compares every output bit for
bit on a few of the target's matrices (every K-quant type it has), 1 to 27 activation rows and 40,
1 and 2 threads, rows at three scales and an all-zero row. The timing gives each build the same
activations over the same tensor of every layer (so the weights stream from DRAM as in a pass, not
from cache), alternates the builds four times and keeps each one's best: ms per matrix.
An AVX2 build runs on an AVX-512 host too (``LEVER_CFLAGS="-O3 -march=haswell"``).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load_build(path: str, i: int):
    # a name of its own per build: loaded as "lever_actors._kernels" twice, the second build came back
    # as the first module object (the interpreter caches single-phase extension modules by name)
    spec = importlib.util.spec_from_file_location(f"lever_kernels_build{i}._kernels", path)
    if spec is None or not path.endswith(".so"):
        raise ImportError(f"{path} is not a shared library (.so)")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs=2, metavar="KERNELS.so")
    ap.add_argument("--gguf", help="the model (default: the default target, as `models fetch` assembled it)")
    ap.add_argument("--tensors", default="ffn_gate,ffn_down,attn_q", help="tensor names to time (every layer's)")
    ap.add_argument("--rows", default="1,2,4,6,8,12", help="activation rows to time")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-check", action="store_true", help="time only")
    args = ap.parse_args(argv)

    import gguf
    from lever_actors import kernels as K
    from lever_actors.models import DEFAULT_PAIR, gguf_path

    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows takes whole numbers separated by commas, got {args.rows!r}")
    if min(rows) < 1 or args.threads < 1:
        ap.error("--rows and --threads must be at least 1")
    for p in args.builds:
        if not Path(p).is_file():
            ap.error(f"no kernels build at {p} (copy lever_actors/_kernels*.so aside before rebuilding)")
    path = Path(args.gguf) if args.gguf else gguf_path(DEFAULT_PAIR["target"])
    if not path.is_file():
        print(f"no GGUF at {path}: run `lever-actors models fetch` or pass --gguf", file=sys.stderr)
        return 2
    try:
        builds = [load_build(p, i) for i, p in enumerate(args.builds)]
    except ImportError as e:
        print(f"not a kernels build: {e}", file=sys.stderr)
        return 2
    if builds[0].matmul is builds[1].matmul:
        print("both paths loaded the same module", file=sys.stderr)
        return 2
    names = [Path(p).name for p in args.builds]
    print(f"A = {args.builds[0]} ({builds[0].simd()}), B = {args.builds[1]} ({builds[1].simd()})")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}

    def matrix(name: str):
        t = tensors[name]
        k, n = int(t.shape[0]), int(t.shape[1])
        return K.NativeMatrix(t.tensor_type.name, k, n, np.ascontiguousarray(np.asarray(t.data).view(np.uint8).reshape(n, -1)))

    def run(mod, w, a, n: int, threads: int) -> np.ndarray:
        out = np.empty((n, w.n), np.float32)
        mod.matmul(K.TYPES[w.qtype], w.data, w.n, w.k, a.q, a.d, a.bsums, None, n, out, w.n, threads)
        return out

    rng = np.random.default_rng(0)
    if not args.no_check:
        picked, seen = [], set()
        for name, t in tensors.items():  # the first matrix of each (tensor kind, type) the kernels take
            kind, qtype = name.split(".")[-2], t.tensor_type.name
            if name.startswith("blk.") and qtype in K.TYPES and qtype != "F32" and (kind, qtype) not in seen:
                seen.add((kind, qtype))
                picked.append(name)
        differing = 0
        for name in picked:
            w = matrix(name)
            for n in [*range(1, 28), 40]:
                x = rng.standard_normal((n, w.k)).astype(np.float32) * rng.choice([1e-3, 1.0, 30.0], (n, 1)).astype(np.float32)
                if n > 2:
                    x[1] = 0
                a = K.quantize_rows(x)
                for threads in (1, 2):
                    ya, yb = (run(b, w, a, n, threads) for b in builds)
                    if not np.array_equal(ya.view(np.uint32), yb.view(np.uint32)):
                        differing += 1
                        print(f"DIFFER {name} {w.qtype} rows {n} threads {threads}: max |A-B| {np.abs(ya - yb).max():.3g}")
            print(f"checked {name} ({w.qtype} {w.k}x{w.n})")
        print("the same bits" if not differing else f"{differing} outputs differ")
        if differing:
            return 1

    layers = sorted({int(n.split(".")[1]) for n in tensors if n.startswith("blk.")})
    kinds = sorted({n.split(".")[-2] for n, t in tensors.items()  # the matrices the kernels take
                    if n.startswith("blk.") and t.tensor_type.name in K.TYPES and t.tensor_type.name != "F32"})
    unknown = [t for t in args.tensors.split(",") if t not in kinds]
    if unknown:
        print(f"no tensor {', '.join(unknown)} in {path.name}; its layers have: {', '.join(kinds)}", file=sys.stderr)
        return 2
    for kind in args.tensors.split(","):
        ms = [matrix(f"blk.{i}.{kind}.weight") for i in layers]
        for qtype in sorted({m.qtype for m in ms}):
            group = [m for m in ms if m.qtype == qtype]
            for n in rows:
                a = K.quantize_rows(rng.standard_normal((n, group[0].k)).astype(np.float32))
                best = [float("inf")] * 2
                for _ in range(4):
                    for i, b in enumerate(builds):
                        t0 = time.perf_counter()
                        for w in group:
                            run(b, w, a, n, args.threads)
                        best[i] = min(best[i], (time.perf_counter() - t0) / len(group))
                print(f"{kind} {qtype} {group[0].k}x{group[0].n} ({len(group)} layers) rows {n:2d} threads {args.threads}: "
                      f"A {best[0] * 1e3:.3f} ms  B {best[1] * 1e3:.3f} ms  A/B {best[0] / best[1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

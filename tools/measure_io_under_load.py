"""Flash reads beside busy cores: does compute on the host's cores slow the O_DIRECT reads?

    python tools/measure_io_under_load.py [--gb 0.9] [--rounds 3] [--json OUT]

Reads the target bundle's flash file with O_DIRECT in layer-sized requests (as the
FlashPrefetcher does) while other processes keep no core, one core or every core busy, in
rounds that alternate the conditions. Two kinds of load: ``spin`` (a loop of integer
arithmetic, no memory traffic) and ``matmul`` (the Q4_K kernel over 92 MB of weights, one
thread: a verification lane's work). Prints the median read rate of each condition and its ratio to
reading alone.

Why: lever's schedule (``lever_actors/schedule.py``) drafts beside the pass only while the
reads, not the compute, bound it. If busy cores slow the reads themselves (a virtual
machine whose disk is served by host threads that share the physical cores), then work
beside a pass costs read time as well as compute, and taking turns wins more often.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lever_actors.bundle import load_bundle  # noqa: E402
from lever_actors.flashio import PAGE, FlashFile, aligned_buffer  # noqa: E402
from lever_actors.models import fetch  # noqa: E402

SPIN = "x = 0\nwhile True:\n    x = (x * 1103515245 + 12345) & 0xFFFFFFFF\n"
MATMUL = """
import numpy as np
from lever_actors import kernels as K
rng = np.random.default_rng(0)
ws = []
for _ in range(12):  # 12 x 7.7 MB: more than the last-level cache, so the weights come from DRAM
    raw = rng.integers(0, 256, (8960, K.row_bytes("Q4_K", 1536)), dtype=np.uint8)
    blocks = raw.reshape(8960, -1, 144)
    blocks[:, :, 0:4] = np.frombuffer(np.array([0.01, 0.01], np.float16).tobytes(), np.uint8)  # sane scales
    ws.append(K.NativeMatrix("Q4_K", 1536, 8960, raw))
a = K.quantize_rows(rng.standard_normal((5, 1536)).astype(np.float32))
while True:
    for w in ws:
        K.matmul(w, a, 1)
"""
LOADS = {"spin": SPIN, "matmul": MATMUL}


def read_rate(path: str, nbytes: int, chunk: int) -> tuple[float, bool]:
    """(GB/s, O_DIRECT used) reading ``nbytes`` of ``path`` in ``chunk``-byte requests, wrapping around."""
    f = FlashFile(path)
    buf = aligned_buffer(chunk)
    try:
        size = os.fstat(f.fd).st_size // chunk * chunk
        if not size:
            raise ValueError(f"{path} is smaller than one request of {chunk} bytes")
        done, off, t0 = 0, 0, time.perf_counter()
        while done < nbytes:
            done += f.read_into(buf, off, chunk, "probe")
            off = (off + chunk) % size
        return done / (time.perf_counter() - t0) / 1e9, f.direct
    finally:
        f.close()  # the buffer goes with its last reference (a failed read's traceback may still hold a view of it)


def with_load(kind: str | None, procs: int, fn):
    """Run ``fn()`` while ``procs`` processes run the ``kind`` load (given 1 s to start, the matmul load 3 s
    to build its weights); they are killed and reaped whatever ``fn`` does."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ps = [subprocess.Popen([sys.executable, "-c", LOADS[kind]], env=env) for _ in range(procs if kind else 0)]
    try:
        if ps:
            time.sleep(1.0 if kind == "spin" else 3.0)
            if any(p.poll() is not None for p in ps):
                raise RuntimeError(f"the {kind} load exited early")
        return fn()
    finally:
        for p in ps:
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=0.9, help="bytes read per measurement, in GB (default 0.9: a pass)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over every condition (default 3)")
    ap.add_argument("--json", dest="json_out", help="write the figures to this file")
    a = ap.parse_args()
    if a.gb <= 0 or a.rounds < 1:
        ap.error("--gb must be > 0 and --rounds >= 1")
    target = load_bundle(fetch(("target",))["target"])
    region = max(target.manifest["layers"], key=lambda r: r["nbytes"])
    path, chunk = str(target.file(region["file"])), region["nbytes"] // PAGE * PAGE  # O_DIRECT: whole pages
    cores = sorted({1, os.cpu_count() or 1})  # one busy core, then every core (two on the standard machine)
    conditions = [(None, 0)] + [(kind, n) for kind in LOADS for n in cores]
    rates: dict[str, list[float]] = {}
    direct = True
    for r in range(a.rounds):
        for kind, n in conditions:
            name = "alone" if kind is None else f"{n} core{'s' if n > 1 else ''} {kind}"
            rate, d = with_load(kind, n, lambda: read_rate(path, int(a.gb * 1e9), chunk))
            direct = direct and d
            rates.setdefault(name, []).append(rate)
            print(f"round {r + 1}/{a.rounds}: {name:16s} {rate:5.2f} GB/s", flush=True)
    alone = statistics.median(rates["alone"])
    out = {"file": path, "request_bytes": chunk, "bytes_per_measurement": int(a.gb * 1e9), "o_direct": direct,
           "cores": os.cpu_count(), "median_gb_s": {}, "vs_alone": {}, "runs_gb_s": rates}
    print(f"\n{'condition':16s} {'median GB/s':>12s} {'vs alone':>9s}   (O_DIRECT: {direct}, {chunk / 2**20:.1f} MiB requests)")
    for name, rs in rates.items():
        med = statistics.median(rs)
        out["median_gb_s"][name], out["vs_alone"][name] = round(med, 3), round(med / alone, 3)
        print(f"{name:16s} {med:12.2f} {med / alone:8.2f}x")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {a.json_out}")


if __name__ == "__main__":
    main()

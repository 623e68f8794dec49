"""What one draft call (one tree level) costs lever's draft, by layout and row count: its layers
and its calibrated subset head, one thread, after a prompt of ``--context`` tokens, with the draft's
Q4_0 in AMX tile strips (Q4_0T) and in the AVX-512 kernels' pairs (Q4_0R), built in one process.

    python tools/measure_draft_level.py [--rows 1,3,8] [--context 300] [--repeat 20] [--json OUT]

The median of ``--repeat`` calls per setting, the settings alternated call by call (the machine is
shared: a slow moment then hits both). Where the CPU or the build has no AMX, only the pairs run.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from lever_actors import kernels
from lever_actors.bundle import load_bundle
from lever_actors.draft_vocab import SubsetHead, subset_for
from lever_actors.model import Transformer, causal_layout
from lever_actors.models import resolve_bundle
from lever_actors.ortrt import LaneConfig


def draft_level(model: Transformer, head: SubsetHead, rows: int, rng) -> tuple[float, float]:
    """(layers s, head s) of one call of ``rows`` new rows after the model's committed context; the
    rows' KV slots are written but never committed, so every call sees the same context."""
    p0 = model.kv.length
    slots = np.arange(p0, p0 + rows)
    t0 = time.perf_counter()
    h = model.forward_resident(list(rng.integers(100, 20000, rows)), slots, slots, causal_layout(model.context, p0, rows))
    t1 = time.perf_counter()
    head.logits(h)
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,3,8", help="activation rows of a call (default 1,3,8)")
    ap.add_argument("--context", type=int, default=300, help="committed tokens before the calls (default 300)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    try:
        row_counts = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows takes row counts such as 1,3,8, not {args.rows!r}")
    if any(not 1 <= r <= 64 for r in row_counts) or args.context < 1 or args.repeat < 1:
        ap.error("--rows must be 1 to 64 each, --context and --repeat at least 1")
    bundle = load_bundle(resolve_bundle(None, "draft"))
    found = subset_for(bundle)
    if found is None:
        raise SystemExit("the draft has no calibrated vocabulary subset (tools/calibrate_draft_vocab.py)")
    lane = LaneConfig(threads=1)
    layouts = ["Q4_0T", "Q4_0R"] if kernels.amx() else ["Q4_0R"]
    rng = np.random.default_rng(0)
    prompt = list(rng.integers(100, 20000, args.context))
    setups = {}
    for layout in layouts:
        tiles = layout == "Q4_0T"
        model = Transformer(bundle, args.context + 64, lane, load_head=False, requantize=True, tiles=tiles)
        model.prefill(prompt)
        setups[layout] = (model, SubsetHead(bundle, found[0], lane, requantize=True, tiles=tiles))
    out = {"context": args.context, "repeat": args.repeat, "amx": kernels.amx_state(), "rows": {}}
    for rows in row_counts:
        times = {layout: [] for layout in layouts}
        for i in range(args.repeat + 2):
            for layout in layouts:
                t = draft_level(*setups[layout], rows, rng)
                if i >= 2:  # two warm-up calls
                    times[layout].append(t)
        out["rows"][rows] = {}
        for layout in layouts:
            layers, head = (float(np.median([t[j] for t in times[layout]])) for j in (0, 1))
            out["rows"][rows][layout] = {"layers_ms": 1e3 * layers, "head_ms": 1e3 * head}
            print(f"{rows:3d} rows, {layout}: layers {1e3 * layers:6.2f} ms, head {1e3 * head:5.2f} ms, "
                  f"the call {1e3 * (layers + head):6.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

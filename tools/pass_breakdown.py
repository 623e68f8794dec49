"""Where a decode pass's time goes beyond its reads, from ``--trace`` files.

    lever-actors generate --humaneval 5 --mode lever --dram-budget 768MiB --max-tokens 64 --trace t5.json
    python tools/pass_breakdown.py t5.json [t11.json ...] [--long-wait 40]

A decode pass runs from its first ``layer 0`` span to the next pass's. Bound by its reads, it lasts as long as the
flash lane reads; the rest is flash idle time: a pinned LM head at the end of the pass (lever streams
its head by default: its slices then compute behind the reads, and ``head_ms`` counts them all the same), the wait for
the next tree (short when the last level drafted ahead is still running, long when the guess
missed and the tree is drafted after the commit) and what two stream slots of read-ahead cannot
cover. Prints one line per file and one for all passes; ``--json`` prints the per-pass rows.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def passes(events: list[dict]) -> list[dict]:
    """One row per decode pass (a ``verify pass`` span; a prefill is not one) that has a successor
    (its end is the next pass's first ``layer 0``), in ms."""
    spans = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
    starts = np.array([e["ts"] for e in spans], float)
    layer0 = np.array([e["ts"] for e in spans if e["name"] == "layer 0"], float)
    rows = []
    for v in (e for e in spans if e["name"] == "verify pass"):
        k = int(np.searchsorted(layer0, v["ts"]))
        if k + 1 >= len(layer0):
            continue
        a, b = layer0[k], layer0[k + 1]
        inside = spans[np.searchsorted(starts, a):np.searchsorted(starts, b)]  # the spans starting in [a, b)
        heads = [e for e in inside if e["name"].startswith("lm head")]
        waits = [e["dur"] for e in inside if e["name"] == "draft wait"]
        rows.append({
            "pass_ms": (b - a) / 1e3,
            "reads_ms": sum(e["dur"] for e in inside if e["name"].startswith("read")) / 1e3,
            "head_ms": sum(e["dur"] for e in heads) / 1e3,
            "head_rows": int(heads[0].get("args", {}).get("rows", 0)) if heads else 0,
            "wait_ms": sum(waits) / 1e3,
        })
    return rows


def summary(rows: list[dict], long_wait_ms: float) -> dict:
    """Means over ``rows`` and the flash lane's idle share; long waits are those of a missed guess."""
    if not rows:
        return {"passes": 0}
    col = {k: np.array([r[k] for r in rows], float) for k in rows[0]}
    long = col["wait_ms"] >= long_wait_ms
    total = col["pass_ms"].sum()
    return {
        "passes": len(rows),
        "pass_ms": col["pass_ms"].mean(), "reads_ms": col["reads_ms"].mean(),
        "read_idle_share": 1.0 - col["reads_ms"].sum() / total,
        "head_ms": col["head_ms"].mean(), "head_rows": col["head_rows"].mean(),
        "head_share": col["head_ms"].sum() / total,
        "long_waits": int(long.sum()), "long_wait_share": col["wait_ms"][long].sum() / total,
        "short_wait_share": col["wait_ms"][~long].sum() / total,
    }


def line(name: str, s: dict) -> str:
    if not s["passes"]:
        return f"{name}: no decode pass with a successor"
    return (f"{name}: {s['passes']} passes, {s['pass_ms']:.0f} ms a pass, reads {s['reads_ms']:.0f} ms "
            f"(flash idle {s['read_idle_share']:.0%}); LM head {s['head_ms']:.1f} ms at {s['head_rows']:.1f} rows "
            f"({s['head_share']:.0%} of the time); waits for the drafter: {s['long_waits']} long "
            f"({s['long_wait_share']:.0%} of the time), short ones {s['short_wait_share']:.0%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", help="files written by --trace")
    ap.add_argument("--long-wait", type=float, default=40.0, metavar="MS",
                    help="a wait for the drafter at least this long counts as a missed guess (default 40 ms, "
                         "about three draft levels)")
    ap.add_argument("--json", action="store_true", help="print every pass's row as JSON instead")
    a = ap.parse_args()
    if a.long_wait <= 0:
        ap.error(f"--long-wait must be positive, got {a.long_wait:g}")
    every = []
    for path in a.traces:
        try:
            with open(path) as f:
                rows = passes(json.load(f)["traceEvents"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            sys.exit(f"pass_breakdown: {path}: not a trace written by --trace ({exc!r})")
        every += rows
        if a.json:
            print(json.dumps({"trace": path, "passes": rows}))
        else:
            print(line(path, summary(rows, a.long_wait)))
    if not a.json and len(a.traces) > 1:
        print(line("all", summary(every, a.long_wait)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

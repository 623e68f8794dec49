"""Render a pass timeline PNG from a ``--trace`` file: one row per lane, one bar per span.

    python tools/plot_trace.py TRACE.json OUT.png [--from S] [--seconds 4]

Needs matplotlib (``pip install 'lever-actors[plots]'``).
"""
from __future__ import annotations

import argparse
import json

LANE_ORDER = ["flash", "build", "npu", "cpu", "accept", "wait", "session"]
COLORS = {"flash": "#1f77b4", "build": "#ff7f0e", "npu": "#2ca02c", "cpu": "#d62728", "accept": "#9467bd",
          "session": "#7f7f7f", "wait": "#000000"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--from", dest="start", type=float, default=None, help="window start, seconds (default: 2nd pass)")
    ap.add_argument("--seconds", type=float, default=4.0)
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = [e for e in json.load(open(a.trace))["traceEvents"] if e.get("ph") == "X"]
    passes = sorted(e["ts"] for e in events if e["name"] == "verify pass")
    start = a.start * 1e6 if a.start is not None else (passes[1] if len(passes) > 1 else 0.0)
    end = start + a.seconds * 1e6
    fig, ax = plt.subplots(figsize=(12, 3.2))
    for row, lane in enumerate(LANE_ORDER):
        spans = [(e["ts"], e["dur"]) for e in events if e["cat"] == lane and e["ts"] + e["dur"] > start
                 and e["ts"] < end]
        ax.broken_barh([((s - start) / 1e3, d / 1e3) for s, d in spans], (row - 0.4, 0.8),
                       facecolors=COLORS[lane], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(LANE_ORDER)), LANE_ORDER)
    ax.set_xlim(0, a.seconds * 1e3)
    ax.set_xlabel("ms")
    ax.invert_yaxis()
    ax.set_title("lever-actors timeline: flash reads, layer compute (npu), drafting (cpu), passes")
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(a.out)


if __name__ == "__main__":
    main()

"""PNG plots from a ``lever-actors bench --json`` file: tokens/s per mode, tokens per pass vs tree size.

    python tools/plot_bench.py BENCH.json OUT_PREFIX

Needs matplotlib (``pip install 'lever-actors[plots]'``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench")
    ap.add_argument("prefix")
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = json.load(open(a.bench))["modes"]
    names = list(modes)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(names, [modes[m]["tokens_per_s"] for m in names], color="#2ca02c")
    for i, m in enumerate(names):
        ax.text(i, modes[m]["tokens_per_s"], f"{modes[m]['tokens_per_s']:.2f}", ha="center", va="bottom")
    ax.set_ylabel("tokens/s (decode)")
    ax.set_title("throughput per mode (same run, prompts interleaved)")
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(f"{a.prefix}-tokens-per-s.png", dpi=120)

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in names:
        size = modes[m]["draft_n"] / max(1, sum(r["stats"].get("passes", 0) for r in modes[m]["prompts"]))
        ax.scatter([size], [modes[m]["mean_accepted"]], s=60)
        ax.annotate(m, (size, modes[m]["mean_accepted"]), textcoords="offset points", xytext=(5, 5))
    ax.set_xlabel("drafted tokens verified per pass (tree size)")
    ax.set_ylabel("tokens committed per pass")
    ax.set_title("acceptance length vs tree size")
    fig.tight_layout()
    fig.savefig(f"{a.prefix}-acceptance.png", dpi=120)
    written = [f"{a.prefix}-tokens-per-s.png", f"{a.prefix}-acceptance.png"]
    sweep = budget_sweep(modes)
    if sweep:  # bench --budgets: tokens/s against the DRAM budget, one line per mode
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = sorted({b for line in sweep.values() for b, _ in line}, key=_budget_order)
        for base, line in sweep.items():
            pts = sorted(line, key=lambda p: _budget_order(p[0]))
            ax.plot([labels.index(b) for b, _ in pts], [t for _, t in pts], marker="o", label=base)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel("--dram-budget (the whole process)")
        ax.set_ylabel("tokens/s (decode)")
        ax.set_title("throughput against the DRAM budget")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(f"{a.prefix}-budgets.png", dpi=120)
        written.append(f"{a.prefix}-budgets.png")
    print(" ".join(written))


def budget_sweep(modes: dict) -> dict:
    """{mode without its budget: [(budget, tokens/s), ...]} for modes run at two budgets or more."""
    lines: dict = {}
    for m, r in modes.items():
        if "@" in m:
            base, b = m.split("@", 1)
            lines.setdefault(base, []).append((b, r["tokens_per_s"]))
    return {k: v for k, v in lines.items() if len(v) > 1}


def _budget_order(label: str) -> float:
    from lever_actors.engine import parse_size

    size = parse_size(label)
    return float("inf") if size is None else float(size)


if __name__ == "__main__":
    main()

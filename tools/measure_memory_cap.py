"""The DRAM budget as the kernel counts it: ``generate`` inside memory cgroups, greedy and sampled.

    python tools/measure_memory_cap.py --budgets 768,600 --json docs/memory-cap.json

For each budget (MiB) and each of greedy and sampled (T=0.8) decoding, runs
``lever-actors generate --humaneval N --mode MODE --dram-budget B`` inside a cgroup
whose limit is the budget (it must not be OOM-killed) and inside one at 1.25x the
budget (the kernel's peak count, ``memory.max_usage_in_bytes`` / ``memory.peak``,
must stay within the budget: a hard limit alone cannot show an overrun, since the
kernel reclaims before it kills). Needs root and a memory cgroup (v1 or v2).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lever_actors.memory import MemoryCgroup  # noqa: E402

DECODING = {"greedy": [], "sampled T=0.8": ["--temperature", "0.8", "--seed", "1"]}


def budget_list(text: str) -> list[int]:
    """'768,600' -> [768, 600]: whole MiB, each at least 1."""
    try:
        budgets = [int(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole MiB separated by commas, e.g. 768,600") from None
    if not budgets or min(budgets) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every budget must be at least 1 MiB")
    return budgets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=budget_list, default=[768], help="comma-separated budgets in MiB (default 768)")
    ap.add_argument("--mode", default="lever")
    ap.add_argument("--humaneval", type=int, default=3, help="the prompt (a development problem by default)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    out, ok = {}, True
    for budget in a.budgets:
        for label, extra in DECODING.items():
            for factor in (1.0, 1.25):
                name = f"{a.mode} {budget}MiB {label} limit x{factor}"
                try:
                    cg = MemoryCgroup(f"lever-cap-{budget}-{len(out)}", int(budget * 2**20 * factor))
                except OSError as e:
                    sys.exit(f"measure_memory_cap: cannot create a memory cgroup here ({e}); it needs root and "
                             "a memory controller (cgroup v1 or v2)")
                with cg:
                    p = subprocess.run([sys.executable, "-m", "lever_actors", "generate", "--humaneval",
                                        str(a.humaneval), "--mode", a.mode, "--dram-budget", f"{budget}MiB",
                                        "--max-tokens", str(a.max_tokens), *extra],
                                       capture_output=True, text=True, preexec_fn=cg.preexec,
                                       stdin=subprocess.DEVNULL)
                    row = {"rc": p.returncode, "peak_mib": round(cg.peak / 2**20, 1), "oom_kills": cg.oom_kills,
                           "tail": (p.stderr.strip().splitlines() or [""])[-1][:160]}
                held = row["rc"] == 0 and row["oom_kills"] == 0 and (factor == 1.0 or row["peak_mib"] <= budget)
                ok &= held
                out[name] = row
                print(f"{name}: {'held' if held else 'FAILED'}, peak {row['peak_mib']} MiB, {row['tail']}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

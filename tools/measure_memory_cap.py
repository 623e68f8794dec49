"""The DRAM budget as the kernel counts it: ``generate`` inside memory cgroups, greedy and sampled.

    python tools/measure_memory_cap.py --budgets 768,600 --json docs/memory-cap.json

For each budget (MiB) and each of greedy and sampled (T=0.8) decoding, runs
``lever-actors generate --humaneval N --mode MODE --dram-budget B`` inside a cgroup
whose limit is the budget (it must not be OOM-killed) and inside one at 1.25x the
budget (the process's peak resident set as the kernel keeps it, ``VmHWM``, which
``generate --json`` reports, must stay within the budget: a hard limit alone cannot
show an overrun, since the kernel reclaims before it kills). Each row also gives the
group's own peak count (``memory.max_usage_in_bytes`` / ``memory.peak``), which adds
the page cache the run's file reads leave behind: in the roomy group that fills what
room there is, so it is shown, not held to the budget. Needs root and a memory cgroup (v1 or v2).

With ``--conversations N`` it also runs the daemon (``lever-actors serve``) inside the same two
cgroups and holds N chats through its socket, their turns interleaved (``--turns`` each, greedy,
tools/measure_conversation.py): the prompt cache then fills with copies of every chat's rows,
which a single ``generate`` never does. ``--prompt-cache SIZE`` passes an explicit cache size to
every run. A conversation run holds when the daemon answers every turn, each warm output equals
its cold rerun, and nothing is OOM-killed (and, in the 1.25x group, the peak stays in the budget).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lever_actors.memory import MemoryCgroup  # noqa: E402
from tools import measure_conversation  # noqa: E402

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


def run_generate(a, budget: int, extra: list[str], cg: MemoryCgroup) -> dict:
    """One ``generate`` inside ``cg``."""
    p = subprocess.run([sys.executable, "-m", "lever_actors", "generate", "--humaneval",
                        str(a.humaneval), "--mode", a.mode, "--dram-budget", f"{budget}MiB",
                        "--max-tokens", str(a.max_tokens), "--json", *cache_args(a), *extra],
                       capture_output=True, text=True, preexec_fn=cg.preexec, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        return {"rc": p.returncode, "tail": (p.stderr.strip().splitlines() or [""])[-1][:160]}
    try:
        out = json.loads(p.stdout)
    except ValueError:
        return {"rc": 1, "tail": f"exit 0 but no JSON on stdout: {p.stdout[:120]!r}"}
    return {"rc": 0, "peak_rss_mib": round(out["peak_rss_bytes"] / 2**20, 1),
            "tail": f"{len(out['token_ids'])} tokens, {out['timings']['tokens_per_s']:.2f} tok/s, {out['mode']}"}


def run_conversations(a, budget: int, cg: MemoryCgroup) -> dict:
    """The daemon inside ``cg`` holding ``a.conversations`` interleaved chats (the client stays outside)."""
    args = measure_conversation.parse_args([
        "--turns", str(a.turns), "--conversations", str(a.conversations), "--mode", a.mode,
        "--dram-budget", f"{budget}MiB", "--context", str(a.context), "--max-tokens", str(a.max_tokens),
        *cache_args(a)])
    try:
        out = measure_conversation.run(args, preexec_fn=cg.preexec)
    except (SystemExit, Exception) as e:  # the daemon did not start, or died mid-chat
        return {"rc": 1, "tail": f"{type(e).__name__}: {e}"[:160]}
    turns = out["turns"]
    cached = ", ".join(f"{r['conversation']}.{r['turn']}:{r['cache_n']}/{r['prompt_tokens']}" for r in turns)
    return {"rc": 0 if out["all_identical"] else 1, "peak_rss_mib": round(out["daemon_peak_rss_bytes"] / 2**20, 1),
            "cache_n": [r["cache_n"] for r in turns],
            "prompt_tokens": [r["prompt_tokens"] for r in turns],
            "tail": f"{len(turns)} turns, rows reused (chat.turn:cached/prompt) {cached}; outputs "
                    f"{'identical to cold' if out['all_identical'] else 'DIFFER from cold'}"}


def cache_args(a) -> list[str]:
    return ["--prompt-cache", a.prompt_cache] if a.prompt_cache else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=budget_list, default=[768], help="comma-separated budgets in MiB (default 768)")
    ap.add_argument("--mode", default="lever")
    ap.add_argument("--humaneval", type=int, default=3, help="the prompt (a development problem by default)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-cache", default=None, help="an explicit --prompt-cache SIZE for every run (default: the plan's)")
    ap.add_argument("--conversations", type=int, default=0,
                    help="also run the daemon holding this many interleaved chats (1-3; default 0: generate only)")
    ap.add_argument("--turns", type=int, default=3, help="turns of each chat (default 3)")
    ap.add_argument("--context", type=int, default=1024, help="the daemon's --context (default 1024)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    if not 0 <= a.conversations <= len(measure_conversation.CHAT_OPENERS):
        ap.error(f"--conversations must be 0 to {len(measure_conversation.CHAT_OPENERS)}")
    if not 2 <= a.turns <= len(measure_conversation.QUESTIONS):
        ap.error(f"--turns must be 2 to {len(measure_conversation.QUESTIONS)}")
    runs = {label: (lambda b, cg, extra=extra: run_generate(a, b, extra, cg)) for label, extra in DECODING.items()}
    if a.conversations:
        runs[f"daemon, {a.conversations} chats x {a.turns} turns"] = lambda b, cg: run_conversations(a, b, cg)
    out, ok = {}, True
    for budget in a.budgets:
        for label, runner in runs.items():
            for factor in (1.0, 1.25):
                name = f"{a.mode} {budget}MiB {label} limit x{factor}"
                try:
                    cg = MemoryCgroup(f"lever-cap-{budget}-{len(out)}", int(budget * 2**20 * factor))
                except OSError as e:
                    sys.exit(f"measure_memory_cap: cannot create a memory cgroup here ({e}); it needs root and "
                             "a memory controller (cgroup v1 or v2)")
                with cg:
                    row = runner(budget, cg)
                    row.update(group_peak_mib=round(cg.peak / 2**20, 1), oom_kills=cg.oom_kills)
                held = row["rc"] == 0 and row["oom_kills"] == 0 and (factor == 1.0 or row["peak_rss_mib"] <= budget)
                ok &= held
                out[name] = row
                print(f"{name}: {'held' if held else 'FAILED'}, peak RSS {row.get('peak_rss_mib', '-')} MiB "
                      f"(group peak with page cache {row['group_peak_mib']} MiB), {row['tail']}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

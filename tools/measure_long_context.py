"""A long prompt at a long context inside a real memory cgroup: does the budget hold?

    python tools/measure_long_context.py --prompt-tokens 3000 --context 4096 --dram-budget 768MiB \\
        --limits 768MiB,960MiB --json docs/long-context-768.json

Builds a prompt of ``--prompt-tokens`` tokens from Python's own ``collections`` source, then runs
``lever-actors generate`` once per ``--limits`` entry, each inside its own memory cgroup with that
hard limit (as ``tests/test_memory_limit.py`` does). A limit equal to the budget shows the process
is never OOM-killed; a looser one lets the process's peak resident set (``VmHWM``) show how close to
the budget it came. Reported per run: exit status, OOM kills, the process's peak and the cgroup's
(which adds page cache), TTFT and decode tokens/s, the plan.
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lever_actors.engine import parse_size
from lever_actors.errors import LeverError
from lever_actors.memory import MemoryCgroup


def long_prompt(n_tokens: int) -> str:
    from lever_actors.models import resolve_bundle
    from lever_actors.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_bundle(None, "target"))
    ids = tok.encode(Path(collections.__file__).read_text())
    if len(ids) < n_tokens:
        sys.exit(f"--prompt-tokens {n_tokens}: the source text has only {len(ids)} tokens")
    return tok.decode(ids[:n_tokens])


def run_capped(limit: int, cmd: list[str]) -> dict:
    with MemoryCgroup(f"lever-long-context-{limit}", limit) as cg:
        t0 = time.time()
        p = subprocess.run(cmd, preexec_fn=cg.preexec, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        row = {"limit_bytes": limit, "exit": p.returncode, "oom_kills": cg.oom_kills, "peak_bytes": cg.peak,
               "wall_s": time.time() - t0}
    if p.returncode == 0:
        out = json.loads(p.stdout)
        st = out["stats"]
        row.update(ttft_s=st["ttft_s"], decode_tokens_per_s=st["n_tokens"] / st["decode_s"], plan=st["budget"],
                   peak_rss_bytes=out.get("peak_rss_bytes"))  # the process's own; peak_bytes adds page cache
    else:
        row["stderr"] = p.stderr[-2000:]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--dram-budget", default="768MiB")
    p.add_argument("--mode", default="lever")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--limits", default="768MiB,960MiB", help="cgroup limits, one run each")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        limits = [parse_size(x) for x in args.limits.split(",")]
    except LeverError as exc:
        p.error(f"--limits: {exc}")
    with tempfile.TemporaryDirectory() as tmp:
        prompt = Path(tmp) / "prompt.txt"
        prompt.write_text(long_prompt(args.prompt_tokens))
        cmd = [sys.executable, "-m", "lever_actors", "generate", "--prompt-file", str(prompt), "--mode", args.mode,
               "--dram-budget", args.dram_budget, "--context", str(args.context), "--max-tokens",
               str(args.max_tokens), "--json"]
        runs = []
        for limit in limits:
            runs.append(run_capped(limit, cmd))
            r = runs[-1]
            rss = f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB, " if r.get("peak_rss_bytes") else ""
            print(f"limit {limit / 2**20:.0f} MiB: exit {r['exit']}, OOM kills {r['oom_kills']}, {rss}cgroup peak "
                  f"{r['peak_bytes'] / 2**20:.0f} MiB" + (f", TTFT {r['ttft_s']:.1f} s, decode "
                                                         f"{r['decode_tokens_per_s']:.2f} tok/s" if r['exit'] == 0 else ""),
                  file=sys.stderr)
    out = {"args": vars(args), "runs": runs}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0 if all(r["exit"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Time to first token across a conversation through the daemon, warm (prompt caching) and cold.

    python tools/measure_conversation.py --turns 5 --mode lever --dram-budget 768MiB \\
        --max-tokens 48 --json docs/conversation-768.json

Starts ``lever-actors serve`` on a private socket, then holds a ``--turns``-turn chat: every turn
sends the whole conversation so far (earlier questions and the daemon's replies) plus a new
question, as an app would. With ``--conversations N`` it holds N chats at once, turn by turn in
turn (A1, B1, A2, B2, ...): each chat's rows are then never the live ones when its next turn
comes, so its reuse comes from the daemon's prompt cache (``--prompt-cache``). Each turn is then repeated cold (``cache_prompt: false``, the whole
prompt computed) and the greedy outputs are compared token for token. Reported per turn: prompt
tokens, ``cache_n`` (rows reused), TTFT warm and cold (the daemon's ``first_token_s``), and at the
end the bar of the conversations issue: every warm TTFT from turn 2 against the cold TTFT of the
last turn's full prompt.

JSON: ``{"args": {...}, "turns": [{"conversation", "turn", "prompt_tokens", "cache_n", "ttft_warm_s",
"ttft_cold_s", "identical"}], "last_cold_ttft_s", "max_warm_ttft_s_from_turn_2", "ratio"}``
(``ratio`` = that max over the last cold TTFT; the bar is <= 0.2).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTIONS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Now make it ignore case and punctuation.",
    "Add a docstring with two doctest examples.",
    "Write a pytest test for it with three cases.",
    "Finally, give it type hints and explain the complexity in one sentence.",
    "Rewrite it without slicing.",
    "Make it accept a list of strings and return the palindromes.",
    "Add logging of each rejected string.",
]
CHAT_OPENERS = [QUESTIONS[0], "Write a Python class for a bounded FIFO queue with put and get.",
                "Write a Python function that parses '1h30m' style durations into seconds."]


def start_daemon(sock: Path, serve_args: list[str], log: Path, preexec_fn=None) -> subprocess.Popen:
    """``preexec_fn`` runs in the daemon's process before it execs (tools/measure_memory_cap.py
    moves it into a memory cgroup there)."""
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lever_actors", "serve", "--socket", str(sock),
                                 *serve_args], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                preexec_fn=preexec_fn)
    deadline = time.monotonic() + 600
    while not sock.with_suffix(".json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"the daemon did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    return proc


def run(args: argparse.Namespace, preexec_fn=None) -> dict:
    from lever_actors.client import SyncClient
    from lever_actors.memory import peak_rss

    serve_args = ["--mode", args.mode, "--dram-budget", args.dram_budget, "--context", str(args.context),
                  "--threads", str(args.threads)] + (["--prompt-cache", args.prompt_cache] if args.prompt_cache else [])
    with tempfile.TemporaryDirectory() as tmp:
        sock, log = Path(tmp) / "lever.sock", Path(tmp) / "daemon.log"
        proc = start_daemon(sock, serve_args, log, preexec_fn)
        try:
            with SyncClient(sock) as client:
                chats: list[list[dict]] = [[] for _ in range(args.conversations)]
                rows = []
                for turn in range(args.turns):
                    for c, messages in enumerate(chats):
                        # each chat asks its own questions (a different start), so the chats share nothing
                        q = QUESTIONS[(turn + c) % len(QUESTIONS)] if turn else CHAT_OPENERS[c % len(CHAT_OPENERS)]
                        messages.append({"role": "user", "content": q})
                        warm = client.generate(messages=list(messages), max_tokens=args.max_tokens)
                        cold = client.generate(messages=list(messages), max_tokens=args.max_tokens,
                                               cache_prompt=False)
                        # the cold run left the cache holding this turn's prompt: the next warm turn
                        # reuses the same rows it would have after the warm run (both are this prompt
                        # plus the same output)
                        row = {"conversation": c + 1, "turn": turn + 1, "prompt_tokens": warm.prompt_tokens,
                               "cache_n": warm.stats.get("cache_n"), "ttft_warm_s": warm.timings["first_token_s"],
                               "ttft_cold_s": cold.timings["first_token_s"],
                               "identical": warm.token_ids == cold.token_ids}
                        rows.append(row)
                        print(f"chat {c + 1} turn {row['turn']}: {row['prompt_tokens']} prompt tokens, "
                              f"{row['cache_n']} cached; TTFT {row['ttft_warm_s']:.2f} s warm, "
                              f"{row['ttft_cold_s']:.2f} s cold; {'identical' if row['identical'] else 'DIFFERENT'}",
                              file=sys.stderr)
                        messages.append({"role": "assistant", "content": warm.text})
            daemon_peak = peak_rss(proc.pid)  # still running: its own high-water mark
        finally:
            proc.terminate()
            proc.wait(30)
    last_cold = max(r["ttft_cold_s"] for r in rows if r["turn"] == args.turns)
    later = [r["ttft_warm_s"] for r in rows if r["turn"] > 1]
    warm_later = max(later) if later else None
    return {"args": vars(args), "turns": rows, "last_cold_ttft_s": last_cold,
            "max_warm_ttft_s_from_turn_2": warm_later,
            "ratio": warm_later / last_cold if warm_later is not None else None,
            "all_identical": all(r["identical"] for r in rows), "daemon_peak_rss_bytes": daemon_peak}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--turns", type=int, default=5, help="turns of the conversation (default 5)")
    p.add_argument("--mode", default="lever", help="the daemon's --mode (default lever)")
    p.add_argument("--dram-budget", default="768MiB", help="the daemon's --dram-budget (default 768MiB)")
    p.add_argument("--context", type=int, default=2048, help="the daemon's --context (default 2048)")
    p.add_argument("--threads", type=int, default=1, help="the daemon's --threads (default 1)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per reply (default 48)")
    p.add_argument("--conversations", type=int, default=1,
                   help="chats held at once, their turns interleaved (default 1; at most 3)")
    p.add_argument("--prompt-cache", default=None, help="the daemon's --prompt-cache (default: its own)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if not 2 <= args.turns <= len(QUESTIONS):
        p.error(f"--turns must be 2 to {len(QUESTIONS)}")
    if not 1 <= args.conversations <= len(CHAT_OPENERS):
        p.error(f"--conversations must be 1 to {len(CHAT_OPENERS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"warm TTFT from turn 2 at most {out['max_warm_ttft_s_from_turn_2']:.2f} s = {out['ratio']:.2f}x "
          f"the cold TTFT of the last turn's prompt ({out['last_cold_ttft_s']:.2f} s); outputs "
          f"{'all identical' if out['all_identical'] else 'DIFFER'}", file=sys.stderr)
    return 0 if out["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())

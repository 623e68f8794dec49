"""Soak the daemon: several clients for a bounded time; nothing lost, nothing leaked.

    python tools/soak.py --seconds 600 --clients 3 --mode lever --dram-budget 768MiB --json soak.json

Starts ``lever-actors serve`` (or uses ``--socket`` of a running daemon), then ``--clients``
threads send generate requests back to back, streaming, from a fixed set of prompts with varied
``max_tokens`` and stop strings, for ``--seconds``. Checked, and reported:

- every request is answered, or refused with ``busy`` (then retried later);
- no token is lost or duplicated: the streamed chunks add up to the result, and every answer to
  the same request equals the first one (greedy output is deterministic);
- the daemon's RSS after warm-up and at the end (a leak shows as growth; the test allows a stated
  tolerance), and the prompt cache's bytes then (copies of earlier sequences' KV rows, which grow
  by design up to their line of the budget: ``rss_growth_net_bytes`` leaves them out), and
  ``rss_samples`` (seconds in, RSS, prompt-cache bytes) about every tenth of the run, which show
  whether the growth levels off;
- the buffer pool is whole at the end: no more slots lent than the pool holds (an idle streaming
  daemon keeps them filled with the next pass's first layers), every request completed.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROMPTS = ["def add(a, b):", "def fib(n):\n", "class Stack:\n    def __init__(self):", "import os\n\ndef walk(",
           "# sort a list of numbers\n", "def is_prime(n: int) -> bool:\n"]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def soak(sock: Path, pid: int, seconds: float, clients: int, warmup: int = 6, max_tokens: int = 24) -> dict:
    """Drive the daemon at ``sock`` (process ``pid``); return the figures (see the module docstring)."""
    from lever_actors.client import SyncClient
    from lever_actors.errors import RemoteError

    first: dict[tuple, list[int]] = {}
    lock = threading.Lock()
    counts = {"answered": 0, "busy": 0, "tokens": 0, "mismatch": 0, "stream_mismatch": 0, "errors": []}
    rss, cache = {}, {}
    start = time.monotonic()
    deadline = start + seconds
    samples: list[tuple[float, int, int]] = []  # (seconds in, RSS, prompt-cache bytes): does growth level off?

    def client(k: int) -> None:
        i = 0
        with SyncClient(sock) as c:
            while time.monotonic() < deadline:
                prompt = PROMPTS[(k + i) % len(PROMPTS)]
                # from one token up, and stops that often end a request at its first tokens: a request
                # that ends at its prefill once left the drafter's answer unread (a few in a row wedged it)
                n = 1 + (k * 7 + i * 5) % max_tokens
                stop = ["\n\n"] if i % 3 == 0 else ["\n"] if i % 5 == 0 else []
                key = (prompt, n, tuple(stop))
                i += 1
                chunks: list[tuple[str, list[int]]] = []
                try:
                    result = c.generate(prompt, max_tokens=n, stop=stop,
                                        on_token=lambda text, ids: chunks.append((text, list(ids))))
                except RemoteError as exc:
                    with lock:
                        if exc.code == "busy":
                            counts["busy"] += 1
                        else:
                            counts["errors"].append(f"{exc.code}: {exc.message}")
                    time.sleep(0.05)
                    continue
                with lock:
                    counts["answered"] += 1
                    counts["tokens"] += len(result.token_ids)
                    if "".join(t for t, _ in chunks) != result.text or \
                            [t for _, ids in chunks for t in ids] != list(result.token_ids):
                        counts["stream_mismatch"] += 1
                    if first.setdefault(key, list(result.token_ids)) != list(result.token_ids):
                        counts["mismatch"] += 1
                    cache["end"] = result.stats.get("prompt_cache_bytes", 0)
                    if counts["answered"] == warmup:
                        rss["after_warmup"] = rss_bytes(pid)
                        cache["after_warmup"] = cache["end"]
                    now = time.monotonic() - start
                    if counts["answered"] >= warmup and (not samples or now - samples[-1][0] >= seconds / 10):
                        samples.append((round(now, 1), rss_bytes(pid), cache["end"]))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with SyncClient(sock) as c:
        stats = c.stats()["daemon"]
    rss["end"] = rss_bytes(pid)
    warm = rss.get("after_warmup")
    return {"seconds": seconds, "clients": clients, **counts, "distinct_requests": len(first),
            "rss_after_warmup_bytes": warm, "rss_end_bytes": rss["end"],
            "prompt_cache_after_warmup_bytes": cache.get("after_warmup"), "prompt_cache_end_bytes": cache.get("end"),
            "rss_growth_net_bytes": None if warm is None else
            rss["end"] - warm - (cache.get("end", 0) - cache.get("after_warmup", 0)),
            "rss_samples": samples, "pool": stats["pool"], "daemon_requests": stats["requests"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--mode", default="lever")
    p.add_argument("--dram-budget", default="768MiB")
    p.add_argument("--serve-args", default="", help="more `serve` arguments, e.g. '--target T --draft D'")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        sock, log = Path(tmp) / "lever.sock", Path(tmp) / "daemon.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "lever_actors", "serve", "--socket", str(sock),
                                     "--mode", args.mode, "--dram-budget", args.dram_budget,
                                     *args.serve_args.split()], stdout=out, stderr=out, stdin=subprocess.DEVNULL)
        try:
            while not sock.with_suffix(".json").exists():
                if proc.poll() is not None:
                    sys.exit(f"the daemon did not start:\n{log.read_text()[-2000:]}")
                time.sleep(0.2)
            out = soak(sock, proc.pid, args.seconds, args.clients)
        finally:
            proc.terminate()
            proc.wait(30)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    # an idle streaming daemon keeps its slots filled with the next pass's first layers (lent to
    # the verifier, up to the pool): a leaked slot would stall the ring and leave requests unanswered
    ok = (not out["errors"] and not out["mismatch"] and not out["stream_mismatch"]
          and out["daemon_requests"]["completed"] == out["answered"]
          and out["pool"].get("buffers_lent", 0) <= out["pool"].get("buffers_total", 0))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

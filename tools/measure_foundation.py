"""Measure the foundation figures: resident decode speed, per-layer verify time, flash bytes per layer.

    python tools/measure_foundation.py [--tokens 32] [--json OUT]

Uses the default bundles (``lever-actors models fetch``). Figures:
* resident greedy decode tokens/s of the draft and the target at 1 and 2 threads;
* time of one target decoder layer verifying N = 1, 4, 16, 64 tokens (median of repeats,
  512 tokens already in the KV cache), at 1 and 2 threads;
* bytes per target layer on flash (bundle) and in the GGUF.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from lever_actors.bundle import load_bundle
from lever_actors.decode import decode_resident
from lever_actors.tokenizer import load_tokenizer
from lever_actors.model import Transformer, causal_layout
from lever_actors.models import fetch
from lever_actors.ortrt import LaneConfig
from lever_actors.sampling import SamplingParams

PROMPT = 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'


def decode_speed(bundle, threads: int, tokens: int) -> float:
    tok = load_tokenizer(bundle.path)
    m = Transformer(bundle, 1024, LaneConfig(threads=threads))
    gen = decode_resident(m, tok.encode(PROMPT), tokens, SamplingParams(), set())
    return gen.tokens_per_s


def layer_times(bundle, threads: int, sizes=(1, 4, 16, 64), past: int = 512, repeats: int = 7) -> dict:
    m = Transformer(bundle, 1024, LaneConfig(threads=threads), resident_layers=[0], load_head=False)
    rng = np.random.default_rng(0)
    m.kv.k[0, :, :past] = rng.normal(0, 1, m.kv.k[0, :, :past].shape)
    m.kv.v[0, :, :past] = rng.normal(0, 1, m.kv.v[0, :, :past].shape)
    out = {}
    for n in sizes:
        x = rng.normal(0, 1, (n, m.hidden)).astype(np.float32)
        slots = np.arange(past, past + n)
        feeds = m.feeds(slots, slots, causal_layout(m.context, past, n))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            m.run_layer(0, m.resident[0], x, feeds, slots)
            ts.append(time.perf_counter() - t0)
        out[n] = statistics.median(ts) * 1000
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", dest="json_out")
    a = ap.parse_args()
    paths = fetch()
    target, draft = load_bundle(paths["target"]), load_bundle(paths["draft"])
    res = {"decode_tok_s": {}, "layer_ms": {}, "layer_bytes": {}}
    for threads in (1, 2):
        for name, b in (("draft", draft), ("target", target)):
            res["decode_tok_s"][f"{name}@{threads}t"] = round(decode_speed(b, threads, a.tokens), 2)
            print(name, threads, "threads:", res["decode_tok_s"][f"{name}@{threads}t"], "tok/s", flush=True)
        res["layer_ms"][f"{threads}t"] = {k: round(v, 2) for k, v in layer_times(target, threads).items()}
        print("layer ms", threads, res["layer_ms"][f"{threads}t"], flush=True)
    lb, gb = target.layer_bytes(), target.manifest["gguf_layer_bytes"]
    res["layer_bytes"] = {"bundle_min": min(lb), "bundle_max": max(lb), "bundle_total": sum(lb),
                          "gguf_min": min(gb), "gguf_max": max(gb), "gguf_total": sum(gb),
                          "ratio": sum(lb) / sum(gb), "head_bytes": target.head_bytes()}
    print(json.dumps(res, indent=1))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

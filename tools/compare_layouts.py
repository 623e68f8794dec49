"""Decode speed of one model in two bundles (e.g. native and ORT layouts), interleaved prompt by prompt.

Usage::

    lever-actors convert MODEL.gguf /tmp/draft-ort.bundle --layout ort
    python tools/compare_layouts.py BUNDLE_A BUNDLE_B --humaneval 0:6 --tokens 96 --threads 1

Both models are loaded once; each prompt is decoded greedily by A then B, so load on
the shared machine hits both alike. Prints ms per token per prompt and whether the
greedy tokens agree (int8 near-ties may differ between layouts).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", nargs=2, metavar="BUNDLE")
    ap.add_argument("--humaneval", default="0:6", metavar="A:B")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    from lever_actors.bench import humaneval_prompts
    from lever_actors.bundle import load_bundle
    from lever_actors.decode import decode_resident
    from lever_actors.errors import LeverError
    from lever_actors.model import Transformer
    from lever_actors.ortrt import LaneConfig
    from lever_actors.sampling import SamplingParams
    from lever_actors.tokenizer import TextTokenizer

    try:
        bundles = [load_bundle(b) for b in args.bundles]
        prompts = [text for _, text in humaneval_prompts(args.humaneval)]
    except LeverError as e:
        print(f"compare_layouts: {e}", file=sys.stderr)
        return 1
    tok = TextTokenizer.from_file(Path(args.bundles[0]) / "tokenizer.json")
    models = [Transformer(b, 1024, LaneConfig(threads=args.threads)) for b in bundles]
    for b, m in zip(args.bundles, models):
        print(f"{b}: layout {m.bundle.layout}, weights {(sum(m.bundle.layer_bytes()) + m.bundle.head_bytes()) / 1e6:.0f} MB")
    for i, text in enumerate(prompts):
        ids, row = tok.encode(text), []
        for m in models:
            m.kv.truncate(0)
            r = decode_resident(m, ids, args.tokens, SamplingParams(), set(tok.eos_ids))
            row.append((1000 * r.decode_s / max(len(r.token_ids), 1), r.token_ids))
        (a_ms, a_ids), (b_ms, b_ids) = row
        print(f"prompt {i}: {a_ms:.1f} vs {b_ms:.1f} ms/token, same tokens: {a_ids == b_ids}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What coupled sampling costs in acceptance, on the same text: each position's draft token
accepted by coupling (the draft's argmax under the position's Gumbel noise is the target's token)
against rejection sampling's expected acceptance there (``sum(min(p, q))``, one minus the total
variation distance, the most any coupling accepts).

    python tools/measure_coupling.py --humaneval 0:6 [--tokens 48] [--temperature 0.8] [--seed 1]
        [--draft-scales 1,0.9] [--json OUT]

``--draft-scales`` also reports the match with the draft's temperature scaled by each factor (a
proposal may use any distribution: the target's draw does not depend on it).

The target draws each text alone (resident, coupled, the seed's text); both models then score every
position of prompt + text in one forward each, with their full heads. Development prompts only
(HumanEval 0-79) when tuning.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from lever_actors.bench import humaneval_prompts
from lever_actors.bundle import load_bundle
from lever_actors.decode import decode_resident
from lever_actors.model import Transformer, causal_layout
from lever_actors.models import resolve_bundle
from lever_actors.ortrt import LaneConfig
from lever_actors.sampling import SamplingParams, coupled_scores, probs_from_logits
from lever_actors.tokenizer import load_tokenizer


def position_logits(model: Transformer, ids: list[int], first: int) -> np.ndarray:
    """The model's logits after each of ``ids[first - 1:-1]`` (the rows that predict ``ids[first:]``)."""
    model.kv.truncate(0)
    h = model.forward_resident(ids, np.arange(len(ids)), np.arange(len(ids)), causal_layout(model.context, 0, len(ids)))
    return model.logits(h[first - 1:-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--humaneval", default="0:6", help="problems A:B (default 0:6)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--draft-scales", default="1", help="draft temperature factors to try (default 1)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    params = SamplingParams(args.temperature, args.top_p, args.seed, coupled=True)
    scales = [float(x) for x in args.draft_scales.split(",")]
    drafting = [SamplingParams(args.temperature * f, args.top_p, args.seed, coupled=True) for f in scales]
    tpath, dpath = resolve_bundle(None, "target"), resolve_bundle(None, "draft")
    tok = load_tokenizer(tpath)
    target = Transformer(load_bundle(tpath), 1024, LaneConfig(threads=2))
    draft = Transformer(load_bundle(dpath), 1024, LaneConfig(threads=2))
    rows = []
    for index, prompt in humaneval_prompts(args.humaneval):
        ids = tok.encode(prompt)
        target.kv.truncate(0)
        text = decode_resident(target, ids, args.tokens, params, set(tok.eos_ids)).token_ids
        full = ids + text
        tl, dl = position_logits(target, full, len(ids)), position_logits(draft, full, len(ids))
        coupled, rejection = [[] for _ in scales], []
        for k, tokn in enumerate(text):
            pos = len(ids) + k
            for hits, dp in zip(coupled, drafting):
                hits.append(int(np.argmax(coupled_scores(dl[k], dp, pos))) == tokn)
            rejection.append(float(np.minimum(probs_from_logits(tl[k], params), probs_from_logits(dl[k], params)).sum()))
        rows.append({"index": index, "tokens": len(text), "coupled": float(np.mean(coupled[0])),
                     "rejection": float(np.mean(rejection)),
                     "coupled_by_scale": {str(f): float(np.mean(h)) for f, h in zip(scales, coupled)}})
        print(f"problem {index:3d}: {len(text)} tokens, coupled match {rows[-1]['coupled']:.3f}, "
              f"rejection acceptance {rows[-1]['rejection']:.3f}", flush=True)
    n = sum(r["tokens"] for r in rows)
    out = {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed, "humaneval": args.humaneval,
           "coupled": sum(r["coupled"] * r["tokens"] for r in rows) / n,
           "rejection": sum(r["rejection"] * r["tokens"] for r in rows) / n, "prompts": rows,
           "coupled_by_scale": {str(f): sum(r["coupled_by_scale"][str(f)] * r["tokens"] for r in rows) / n
                                for f in scales}}
    print(f"all {n} positions: coupled match {out['coupled']:.3f}, rejection acceptance {out['rejection']:.3f}")
    if len(scales) > 1:
        print("coupled match by draft temperature factor: "
              + ", ".join(f"{f}: {v:.3f}" for f, v in out["coupled_by_scale"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

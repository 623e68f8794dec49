"""Fit lever's early-exit pruning (exit layer and threshold) on HumanEval 0-79.

Usage::

    python tools/calibrate_prune.py --humaneval 0:80 --max-tokens 64 --recall 0.98 --write

Runs ``lever`` greedily with the pruner scoring every tree node at several exit
layers but pruning nothing, and joins each score with the pass's verdict. A node
whose parent was accepted is *decisive*: pruning it loses tokens exactly when
the target accepted it. For each exit layer the threshold is the highest one
that keeps ``--recall`` of the accepted decisive nodes; the layer chosen is the
one that saves the most node-layers (pruned nodes and their subtrees times the
layers and LM head they skip). ``--write`` stores the result in
``lever_actors/prune_calibration.json`` under the target GGUF's digest, where
``lever`` finds it. Problems 80-163 are held out and refused.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEAD_LAYERS = 5.0  # the LM head costs about five layers per row (151936x1536 vs ~46M MACs per layer)


def fit_layer(samples: list[tuple[float, bool, bool]], recall: float) -> dict:
    """Threshold for one exit layer from (margin, decisive, accepted) samples."""
    m = np.array([s[0] for s in samples])
    decisive = np.array([s[1] for s in samples])
    acc = np.array([s[2] for s in samples])
    pos = np.sort(m[decisive & acc])
    if len(pos) == 0:
        return {"threshold": None}
    # keep at least `recall` of the accepted decisive nodes: threshold at that quantile from below
    k = int(np.floor((1 - recall) * len(pos)))
    threshold = float(pos[k]) if k < len(pos) else float(pos[-1])
    if k > 0:
        threshold = float((pos[k - 1] + pos[k]) / 2)
    pruned = m < threshold
    wrong = pruned & decisive & acc
    return {"threshold": threshold, "recall": float(1 - wrong.sum() / len(pos)),
            "precision": float(1 - wrong.sum() / max(pruned.sum(), 1)), "pruned_fraction": float(pruned.mean()),
            "scored": int(len(m))}


def main(argv: list[str] | None = None) -> int:
    from lever_actors.prune import CALIBRATION_FILE, prune_mask

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--humaneval", default="0:80", metavar="A:B", help="development problems (default 0:80)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--mode", default="lever:16", help="the lever mode whose trees are scored (default lever:16)")
    ap.add_argument("--exits", default="8,12,16,18,20,22,24", help="candidate exit layers (0-based)")
    ap.add_argument("--recall", type=float, default=0.98, help="share of accepted decisive nodes to keep")
    ap.add_argument("--dram-budget", default="unlimited", help="scores do not depend on it (default unlimited)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write every layer's fit here")
    ap.add_argument("--write", action="store_true", help=f"store the chosen fit in {CALIBRATION_FILE.name}")
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    args = ap.parse_args(argv)
    a, b = (int(x) for x in args.humaneval.split(":"))
    if b > 80 or a < 0 or a >= b:
        ap.error("calibrate on development problems only: A:B within 0:80 (80-163 are held out)")
    if not 0.5 <= args.recall < 1:
        ap.error("--recall must lie in [0.5, 1)")
    exits = tuple(sorted({int(x) for x in args.exits.split(",")}))

    import trio

    from lever_actors.bench import humaneval_prompts
    from lever_actors.bundle import load_bundle
    from lever_actors.engine import EngineConfig, load_tokenizer, parse_size
    from lever_actors.models import resolve_bundle
    from lever_actors.runtime import open_pipeline
    from lever_actors.sampling import SamplingParams

    target_dir, draft_dir = resolve_bundle(args.target, "target"), resolve_bundle(args.draft, "draft")
    tok = load_tokenizer(target_dir)
    prompts = [text for _, text in humaneval_prompts(f"{a}:{b}")]
    cfg = EngineConfig(context=1024, dram_budget=parse_size(args.dram_budget)).with_mode(args.mode)
    record: list = []

    async def run() -> list:
        async with open_pipeline(cfg, target_dir, draft_dir, set(tok.eos_ids), prune_exits=exits,
                                 prune_record=record) as pipe:
            pipe.verdicts = []

            async def emit(_):
                return False
            t0 = time.perf_counter()
            for i, prompt in enumerate(prompts):
                await pipe.generate(tok.encode(prompt), args.max_tokens, SamplingParams(), emit)
                print(f"calibrate: problem {a + i}: {len(pipe.verdicts)} passes, {len(record)} scores "
                      f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
            return pipe.verdicts

    verdicts = trio.run(run)
    n_layer = load_bundle(target_dir).n_layer
    by_pass = {(sid, step): (np.asarray(par), set(acc)) for sid, step, par, acc in verdicts}
    scores = defaultdict(dict)  # (sid, step, layer) -> {node: margin}
    for sid, step, layer, node, margin in record:
        scores[(sid, step, layer)][node] = margin
    fits = {}
    for layer in exits:
        samples = []
        for (sid, step), (par, acc) in by_pass.items():
            for node, margin in scores.get((sid, step, layer), {}).items():
                samples.append((margin, int(par[node]) in acc, node in acc))
        fit = fit_layer(samples, args.recall)
        if fit["threshold"] is not None:  # node-layers saved, pruned subtrees included
            saved = total = 0.0
            for (sid, step), (par, _) in by_pass.items():
                m = scores.get((sid, step, layer), {})
                keep = prune_mask(par, np.ones(len(par), bool), m, fit["threshold"])
                saved += (len(par) - keep.sum()) * (n_layer - 1 - layer + HEAD_LAYERS)
                total += len(par) * (n_layer + HEAD_LAYERS)
            fit["saved_fraction"] = float(saved / max(total, 1))
        fits[layer] = fit
        print(f"calibrate: exit layer {layer:2d}: {json.dumps(fit)}", file=sys.stderr)
    best = max((l for l in fits if fits[l]["threshold"] is not None), key=lambda l: fits[l]["saved_fraction"])
    choice = {"exit_layer": best, **fits[best], "recall_target": args.recall,
              "fitted_on": f"HumanEval {a}:{b}, {args.max_tokens} tokens, {args.mode}, greedy",
              "passes": len(by_pass), "per_layer": {str(k): v for k, v in fits.items()}}
    print(json.dumps({k: v for k, v in choice.items() if k != "per_layer"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(choice, indent=1))
    if args.write:
        sha = load_bundle(target_dir).manifest["source"]["sha256"]
        table = json.loads(CALIBRATION_FILE.read_text()) if CALIBRATION_FILE.exists() else {}
        table[sha] = {k: v for k, v in choice.items() if k != "per_layer"}
        CALIBRATION_FILE.write_text(json.dumps(table, indent=1) + "\n")
        print(f"calibrate: wrote {CALIBRATION_FILE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

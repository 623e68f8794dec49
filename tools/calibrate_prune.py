"""Fit lever's early-exit pruning (exit layer and threshold) on HumanEval 0-79.

Usage::

    python tools/calibrate_prune.py --humaneval 0:80 --max-tokens 64 --recall 0.98 --write

Runs ``lever`` greedily with the pruner scoring every tree node at several exit
layers but pruning nothing, and joins each score with the pass's verdict. A node
whose parent was accepted is *decisive*: pruning it loses tokens exactly when
the target accepted it. For each exit layer the threshold is the highest one
that keeps at least ``--recall`` of the accepted decisive nodes and has the
best estimated speed-up: the tokens kept (a wrongly pruned node loses its
accepted subtree) over the pass time left (pruned nodes and their subtrees skip
the later layers and the LM head, at ``--node-layer-ms`` each). When no setting
is estimated to pay, the fit says so and ``lever`` runs without pruning. ``--write`` stores the result in
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


def subtree_accepted(par: np.ndarray, acc: set, node: int) -> int:
    """Accepted nodes at or below ``node``: the tokens lost when it is pruned."""
    lost, v = 0, node
    while v in acc:
        lost += 1
        kids = [c for c in range(v + 1, len(par)) if par[c] == v and c in acc]
        v = kids[0] if kids else -1
    return lost


def evaluate(passes: list, layer: int, threshold: float, n_layer: int, per_node_layer_s: float,
             pass_s: float) -> dict:
    """What pruning at (layer, threshold) would have done to the recorded passes.

    ``passes`` holds (parents, accepted set, {node: margin at each layer}). Returns the
    accepted decisive nodes kept (recall), the precision of the pruned nodes, the
    node-layers saved and the estimated speed ratio: tokens kept over pass time left,
    with compute saved at ``per_node_layer_s`` per node and layer (head included).
    """
    from lever_actors.prune import directly_pruned, prune_mask

    pos = wrong = pruned = lost = tokens = 0
    saved = 0.0
    for par, acc, margins in passes:
        m = margins.get(layer, {})
        alive = np.ones(len(par), bool)
        keep = prune_mask(par, alive, m, threshold)
        direct = directly_pruned(par, alive, keep)
        pruned += len(direct)
        tokens += len(acc)  # accepted drafted nodes plus the root: one committed token each
        for v in range(1, len(par)):
            if int(par[v]) in acc and v in acc:
                pos += 1
        for v in direct:
            if v in acc:
                wrong += 1
                lost += subtree_accepted(par, acc, int(v))
        saved += (len(par) - keep.sum()) * (n_layer - 1 - layer + HEAD_LAYERS)
    n = max(len(passes), 1)
    time_left = max(pass_s - saved / n * per_node_layer_s, 1e-9)
    return {"threshold": threshold, "recall": 1 - wrong / max(pos, 1), "precision": 1 - wrong / pruned if pruned else None,
            "pruned_per_pass": pruned / n, "lost_tokens_per_pass": lost / n, "node_layers_saved_per_pass": saved / n,
            "est_speedup": ((tokens - lost) / max(tokens, 1)) / (time_left / pass_s)}


def fit(passes: list, exits: tuple[int, ...], n_layer: int, args) -> dict:
    """The (layer, threshold) with the best estimated speed-up among those keeping ``args.recall``."""
    per_layer = {}
    for layer in exits:
        ms = np.sort([m for _, _, mm in passes for m in mm.get(layer, {}).values()])
        cands = np.unique(np.quantile(ms, np.linspace(0, 0.5, 51))) if len(ms) else []
        rows = [evaluate(passes, layer, float(t), n_layer, args.node_layer_ms / 1e3, args.pass_ms / 1e3) for t in cands]
        rows = [r for r in rows if r["recall"] >= args.recall]
        per_layer[layer] = max(rows, key=lambda r: r["est_speedup"]) if rows else None
        print(f"calibrate: exit layer {layer:2d}: {json.dumps(per_layer[layer])}", file=sys.stderr)
    best = max((l for l in per_layer if per_layer[l]), key=lambda l: per_layer[l]["est_speedup"], default=None)
    if best is None or per_layer[best]["est_speedup"] <= 1.0:
        return {"exit_layer": None, "threshold": None, "per_layer": per_layer,
                "verdict": "no threshold keeping the recall target is estimated to pay: lever runs without pruning"}
    return {"exit_layer": best, **per_layer[best], "per_layer": per_layer}


def main(argv: list[str] | None = None) -> int:
    from lever_actors.prune import CALIBRATION_FILE

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--humaneval", default="0:80", metavar="A:B", help="development problems (default 0:80)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--mode", default="lever:16", help="the lever mode whose trees are scored (default lever:16)")
    ap.add_argument("--exits", default="4,6,8,12,16,20,24", help="candidate exit layers (0-based)")
    ap.add_argument("--recall", type=float, default=0.98, help="share of accepted decisive nodes to keep")
    ap.add_argument("--dram-budget", default="unlimited", help="scores do not depend on it (default unlimited)")
    ap.add_argument("--node-layer-ms", type=float, default=1.27,
                    help="compute per tree node and layer in a pass (bench: compute s/pass / nodes / (layers + 5))")
    ap.add_argument("--pass-ms", type=float, default=536.0, help="time of one lever pass (bench: ms/token x acc/pass)")
    ap.add_argument("--samples", default=None, metavar="FILE",
                    help="write the recorded passes (parents, verdicts, margins) here, to refit without rerunning")
    ap.add_argument("--from-samples", default=None, metavar="FILE", help="refit from a --samples file (no model run)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write every layer's fit here")
    ap.add_argument("--write", action="store_true", help=f"store the chosen fit in {CALIBRATION_FILE.name}")
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    args = ap.parse_args(argv)
    try:
        a, b = (int(x) for x in args.humaneval.split(":"))
    except ValueError:
        ap.error(f"--humaneval wants A:B (problems A..B-1), got {args.humaneval!r}")
    if b > 80 or a < 0 or a >= b:
        ap.error("calibrate on development problems only: A:B within 0:80 (80-163 are held out)")
    if not 0.5 <= args.recall < 1:
        ap.error("--recall must lie in [0.5, 1)")
    try:
        exits = tuple(sorted({int(x) for x in args.exits.split(",")}))
    except ValueError:
        ap.error(f"--exits wants comma-separated layer numbers such as 8,16,24, got {args.exits!r}")
    saved = None
    if args.from_samples:
        try:
            saved = json.loads(Path(args.from_samples).read_text())
            if not isinstance(saved, dict) or not {"passes", "a", "b", "max_tokens", "mode"} <= saved.keys():
                raise ValueError("missing keys")
        except (OSError, ValueError) as e:
            ap.error(f"--from-samples {args.from_samples}: not a samples file written by --samples ({e!r})")
    from lever_actors.errors import LeverError

    try:
        return fit_and_report(args, a, b, exits, saved)
    except LeverError as e:
        print(f"calibrate: {e}", file=sys.stderr)
        return 1


def fit_and_report(args, a: int, b: int, exits: tuple[int, ...], saved: dict | None) -> int:
    """Record (or load) scored passes, fit the exit layer and threshold, report and store them."""
    from lever_actors.prune import CALIBRATION_FILE

    import trio

    from lever_actors.bench import humaneval_prompts
    from lever_actors.bundle import load_bundle
    from lever_actors.engine import EngineConfig, parse_size
    from lever_actors.tokenizer import load_tokenizer
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

    n_layer = load_bundle(target_dir).n_layer
    if saved is not None:
        passes = [(np.asarray(par), set(acc), {int(l): {int(v): m for v, m in mm.items()} for l, mm in ms.items()})
                  for par, acc, ms in saved["passes"]]
        a, b, args.max_tokens, args.mode = saved["a"], saved["b"], saved["max_tokens"], saved["mode"]
        exits = tuple(sorted({l for _, _, ms in passes for l in ms}))
    else:
        verdicts = trio.run(run)
        by_pass = {(sid, step): (np.asarray(par), set(acc)) for sid, step, par, acc in verdicts}
        margins = defaultdict(lambda: defaultdict(dict))  # (sid, step) -> layer -> {node: margin}
        for sid, step, layer, node, margin in record:
            margins[(sid, step)][layer][node] = margin
        passes = [(par, acc, margins[key]) for key, (par, acc) in by_pass.items()]
        if args.samples:
            Path(args.samples).write_text(json.dumps({
                "a": a, "b": b, "max_tokens": args.max_tokens, "mode": args.mode,
                "passes": [[par.tolist(), sorted(acc), {str(l): {str(v): m for v, m in mm.items()} for l, mm in ms.items()}]
                           for par, acc, ms in passes]}))
    choice = fit(passes, exits, n_layer, args)
    choice.update(recall_target=args.recall, passes=len(passes),
                  fitted_on=f"HumanEval {a}:{b}, {args.max_tokens} tokens, {args.mode}, greedy")
    print(json.dumps({k: v for k, v in choice.items() if k != "per_layer"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(choice, indent=1, default=str))
    if args.write:
        sha = load_bundle(target_dir).manifest["source"]["sha256"]
        table = json.loads(CALIBRATION_FILE.read_text()) if CALIBRATION_FILE.exists() else {}
        table[sha] = {k: v for k, v in choice.items() if k != "per_layer"}
        CALIBRATION_FILE.write_text(json.dumps(table, indent=1) + "\n")
        print(f"calibrate: wrote {CALIBRATION_FILE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

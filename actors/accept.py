"""Acceptor: decides which drafted tokens the target accepts and what it commits."""
from __future__ import annotations

import time

import numpy as np
import trio

from lever_actors.prune import misses
from protocols import Commit, PassStats, VerifyDone


def decide(done: VerifyDone) -> tuple[list[int], list[int]]:
    """(accepted node ids root first, committed tokens) for one verified tree. Pure."""
    from lever_actors.sampling import (SamplingParams, accept_greedy, accept_sampled, next_token, probs_from_logits,
                                       tree_depths)

    params = SamplingParams(done.temperature, done.top_p, done.seed, done.coupled)
    if done.prefill:
        tok = int(done.argmax[0]) if params.greedy else next_token(done.logits[0], params, done.step, done.position + 1)
        return [], [tok]
    tokens = done.tokens
    if params.greedy:
        if done.pruned is not None and len(done.node_ids) < len(tokens):
            tokens = np.where(np.isin(np.arange(len(tokens)), done.node_ids), tokens, -1)  # never matches
        return accept_greedy(done.parents, tokens, done.argmax)
    if params.coupled:
        # the target's draw after node i is its argmax under the noise of the position after it:
        # greedy acceptance on those, computed only for the nodes the walk visits (a sampled pass is
        # never pruned: logits rows are node ids)
        if done.pruned is not None:
            raise ValueError("a coupled sampled pass cannot be pruned: its logits rows must be its nodes")
        depths = tree_depths(done.parents)
        choice = _Lazy(lambda i: next_token(done.logits[i], params, done.step, done.position + int(depths[i]) + 1),
                       remember=True)
        return accept_greedy(done.parents, tokens, choice)
    n = len(done.tokens)
    # a distribution is a float64 row of the vocabulary: only the nodes the walk visits get one
    target = _Lazy(lambda i: probs_from_logits(done.logits[i], params))
    # node i's children were drawn from the draft distribution at node i (a chain: dists[i])
    drafts = [done.draft_dists[i] if done.draft_dists is not None and i < len(done.draft_dists) else None
              for i in range(n)]
    return accept_sampled(done.parents, done.tokens, drafts, target, done.seed, done.step)


class _Lazy:
    """``f(i)`` computed on indexing and not kept (a walk holds one node's distribution at a time),
    or kept when ``remember`` (small results: the greedy walk reads its last node's twice)."""

    def __init__(self, f, remember: bool = False) -> None:
        self.f, self.kept = f, {} if remember else None

    def __getitem__(self, i: int):
        if self.kept is None:
            return self.f(i)
        if i not in self.kept:
            self.kept[i] = self.f(i)
        return self.kept[i]


class Acceptor:
    """Inputs: ``done_recv`` (VerifyDone). Outputs: ``commit_send`` (Commit), then ``stats_send``
    (PassStats of the same pass, for the planner and the run statistics).

    Invariants: every Commit carries at least one token (the target's own token
    after the accepted path); accepted nodes form a root-first path.
    Backpressure: one verified pass at a time. Cancellation: stateless.
    """

    def __init__(self, done_recv, commit_send, stats_send, tracer) -> None:
        self.done_recv, self.commit_send, self.stats_send, self.tracer = done_recv, commit_send, stats_send, tracer

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with self.done_recv, self.commit_send, self.stats_send:
            task_status.started()
            async for done in self.done_recv:
                if done.fault:  # a lost pass: nothing to decide, the driver fails the request
                    header = dict(session_id=done.session_id, step=done.step, epoch=done.epoch)
                    await self.commit_send.send(Commit(**header, tokens=(), fault=done.fault,
                                                       fault_retryable=done.fault_retryable))
                    await self.stats_send.send(PassStats(**header, n_nodes=0, n_accepted=0, n_pruned=0,
                                                         io_s=done.io_wait_s, compute_s=done.compute_s, draft_s=0.0,
                                                         pass_s=0.0, bytes_read=done.bytes_read))
                    continue
                t0 = time.perf_counter()
                path, tokens = decide(done)
                pruned = done.pruned if done.pruned is not None else np.zeros(0, np.int32)
                wrong = misses(done.parents, done.tokens, done.argmax, path, pruned) if len(pruned) else 0
                self.tracer.add("accept", "accept", t0, time.perf_counter(), accepted=len(tokens))
                await self.commit_send.send(Commit(session_id=done.session_id, step=done.step, epoch=done.epoch,
                                                   tokens=tuple(tokens), accepted_nodes=tuple(path)))
                await self.stats_send.send(PassStats(
                    session_id=done.session_id, step=done.step, epoch=done.epoch, n_nodes=len(done.tokens),
                    n_accepted=len(tokens) - 1, n_pruned=len(pruned), io_s=done.io_wait_s, compute_s=done.compute_s,
                    draft_s=0.0, pass_s=0.0, bytes_read=done.bytes_read, n_pruned_wrong=wrong,
                    n_dropped=len(done.tokens) - len(done.node_ids) if done.pruned is not None else 0,
                    cache_n=done.cache_n))

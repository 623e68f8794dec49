"""Drafter: the resident draft model proposes the next tokens."""
from __future__ import annotations

import time

import numpy as np
import trio

from lever_actors.prune import ALTERNATIVES
from protocols import DraftExpansion, DraftRequest


class Drafter:
    """Owns the draft model and its KV cache; answers each DraftRequest with a DraftExpansion.

    Inputs: ``requests_recv`` (DraftRequest: newly committed tokens, the last one
    being the root, and how much to draft).
    Outputs: ``out_send`` (DraftExpansion; ``parents`` -1 = child of the root).
    Invariants: the draft KV holds exactly the committed prefix plus scratch rows
    of the last draft tree (node i in slot prefix+i); rows on the path that was
    then committed are kept, not recomputed, and the rest is fed (after a fully
    accepted chain that includes the last drafted token: the catch-up step).
    Cross-step drafting: a speculative request (sent while the last tree is
    verified) commits an *assumed* outcome, its main path plus the draft's own
    top choice as the next root, and drafts the next tree from it; the
    assumption stays ``pending`` (KV length before it, tokens assumed) until the
    next request confirms it or undoes it (keeping the rows the real tokens share
    with the assumption).
    Backpressure: one request at a time on the CPU lane.
    Cancellation: a draft in a thread finishes; its scratch rows are discarded
    by the next request's sync (or its reset).
    """

    def __init__(self, model, requests_recv, out_send, lanes, tracer, head=None) -> None:
        from lever_actors.draft_vocab import FullHead

        self.m = model
        # the draft's LM head: the whole vocabulary, or a calibrated subset (ids maps its columns to tokens)
        self.head = head if head is not None else FullHead(model)
        self.threads = model.lane.threads  # its own setting; a request may borrow more
        self.requests_recv, self.out_send = requests_recv, out_send
        self.lanes, self.tracer = lanes, tracer
        # the last draft tree: node i sits in KV slot (prefix length + i) once fed
        self.children: dict[int, dict[int, int]] = {}  # parent node (-1 = root) -> token -> node
        self.fed: list[bool] = []
        self.pending: tuple[int, list[int]] | None = None  # (KV length before, tokens assumed)

    def _use_threads(self, n: int) -> None:
        """Kernel threads of this draft (native kernels take them per call; ORT sessions keep theirs)."""
        from dataclasses import replace

        if self.m.lane.threads != n:
            self.m.lane = replace(self.m.lane, threads=n)
            if hasattr(self.head, "lane"):
                self.head.lane = self.m.lane

    def reset(self, sequence: list[int] | None = None) -> int:
        """Start a new sequence; with ``sequence``, keep the rows of the prefix it shares with
        the committed rows (prompt caching). Returns how many rows were kept."""
        keep = self.m.kv.reusable(sequence) if sequence else 0
        self.m.kv.truncate(keep)
        self.children, self.fed, self.pending = {}, [], None
        return keep

    def _undo_speculation(self, actual: list[int]) -> list[int]:
        """Roll the KV back to before the pending assumption; returns the tokens still to feed
        (the scratch tree is dropped, so :meth:`_sync` feeds them all)."""
        base, assumed = self.pending
        self.pending = None
        keep = 0
        while keep < min(len(assumed), len(actual) - 1) and assumed[keep] == actual[keep]:
            keep += 1  # rows of the shared prefix are right; the root is always fed (its logits)
        self.m.kv.truncate(base + keep)
        self.children, self.fed = {}, []
        return actual[keep:]

    def _speculate(self, path: list[int], hidden: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        """Commit ``path`` (nodes of the last tree) and the draft's top choice after it: (root, hidden).

        An empty ``path`` assumes from the last committed token, whose ``hidden`` row the caller has.
        """
        base = self.m.kv.length
        if path:
            hidden = self._sync(path)
        root = self._token(int(np.argmax(self.head.logits(hidden)[0])))
        self.pending = (base, path + [root])
        return root, self._feed([root])

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with self.requests_recv, self.out_send:
            task_status.started()
            async for req in self.requests_recv:
                await self.out_send.send(await self.lanes.run("cpu", self.draft, req))

    def _feed(self, tokens: list[int]) -> np.ndarray:
        """Append committed tokens to the KV; returns the last hidden row."""
        from lever_actors.model import causal_layout

        kv, last = self.m.kv, None
        for lo in range(0, len(tokens), 64):
            part = tokens[lo:lo + 64]
            p0 = kv.length
            slots = np.arange(p0, p0 + len(part))
            last = self.m.forward_resident(part, slots, slots, causal_layout(kv.context, p0, len(part)))[-1:]
            kv.commit(slots, part)
        return last

    def _sync(self, new: list[int]) -> np.ndarray | None:
        """Commit ``new`` tokens: keep drafted rows on the accepted path, feed the rest.

        Returns the hidden row of the last token fed (the root), or None if nothing was.
        """
        kv = self.m.kv
        base, node, keep = kv.length, -1, []
        for t in new[:-1]:  # never reuse the root's row: its logits are needed and were not kept
            child = self.children.get(node, {}).get(t)
            if child is None or not self.fed[child]:
                break
            keep.append(base + child)
            node = child
        kv.commit(keep, new[:len(keep)])  # moves the accepted path's rows next to the prefix
        self.children, self.fed = {}, []
        return self._feed(new[len(keep):]) if len(keep) < len(new) else None

    def draft(self, req: DraftRequest) -> DraftExpansion:
        """Grow a token tree below the root, one batched draft call per level.

        Growth also stops once the best path of the last level is below
        ``min_path_p`` (adaptive depth, set by the planner). Every level scores the children (top ``top_k`` when greedy, sampled without
        replacement when sampling) of the frontier and keeps the most probable
        paths, at most ``ceil(max_nodes / max_depth)`` per level and ``max_nodes``
        in all; the kept nodes of the level are fed to the
        draft model together, which gives the next level's distributions. A chain
        is the case ``top_k == 1``.
        """
        from lever_actors.sampling import SamplingParams, probs_from_logits, rng_for

        t0 = time.perf_counter()
        self._use_threads(req.threads or self.threads)
        root, position = req.root_token, req.position
        committed = list(req.committed)
        if req.reset:
            keep = self.reset(committed if req.reuse_prefix else None)
            self.head.set_prompt(req.committed)
            committed = committed[keep:]
        if self.pending is not None:
            if req.confirmed:
                self.pending = None  # the assumption held: it is plain committed history now
            else:
                committed = self._undo_speculation(committed)  # scratch rows are gone: feed what is left
        if req.speculative:
            # with new tokens (a prompt, during its prefill pass) digest them first
            hidden = self._sync(committed) if committed else None
            root, hidden = self._speculate(list(req.assume), hidden)
            position = req.position + len(req.assume) + 1
        else:
            hidden = self._sync(committed)
        params = SamplingParams(req.temperature, req.top_p, req.seed)
        parents, tokens, probs, path_p = [], [], [], []
        dists: dict[int, np.ndarray] = {}  # node (-1 = root) -> distribution its children came from
        alts: dict[int, np.ndarray] = {}  # node (-1 = root) -> the draft's top tokens after it (greedy)
        if req.max_depth > 0 and req.max_nodes > 0:
            if hidden is None:
                raise RuntimeError("draft request commits nothing new: the root must be newly committed")
            frontier, rows = [-1], hidden  # nodes whose children we can score now, and their hidden rows
            for depth in range(req.max_depth):
                logits = self.head.logits(rows)
                cands = []
                for r, node in enumerate(frontier):
                    p = self._distribution(logits[r], params)  # over the head's columns
                    if params.greedy:  # one top-k selection serves the children and the pruner's rivals
                        top = self._children(p, min(max(ALTERNATIVES, req.top_k), len(p)), params, req.step, node)
                        children = top[:req.top_k]
                        alts[node] = self._tokens(top[:ALTERNATIVES])
                    else:
                        dists[node] = self._full_distribution(p)
                        children = self._children(p, req.top_k, params, req.step, node)
                    base_p = path_p[node] if node >= 0 else 1.0
                    for col in children:
                        tok = self._token(col)
                        cands.append((base_p * float(p[col]), node, tok, float(p[col])))
                cands.sort(key=lambda c: -c[0])
                # a level holds at most max_nodes/max_depth nodes, so the budget buys depth
                room = min(req.max_nodes - len(tokens), -(-req.max_nodes // req.max_depth))
                level = []
                for pp, parent, tok, q in cands[:room]:
                    parents.append(parent)
                    tokens.append(tok)
                    probs.append(q)
                    path_p.append(pp)
                    level.append(len(tokens) - 1)
                if not level or len(tokens) >= req.max_nodes or depth + 1 == req.max_depth:
                    break
                if max(path_p[n] for n in level) < req.min_path_p:
                    break  # adaptive depth: the next level would not pay for its drafting time
                rows = self._feed_level(level, parents, tokens)
                frontier = level
        self.tracer.add(f"draft {len(tokens)}", "cpu", t0, time.perf_counter())
        dist_rows = None
        if dists:
            vocab = next(iter(dists.values())).shape[0]
            dist_rows = np.zeros((len(tokens) + 1, vocab), np.float32)  # row 0: root, row i+1: node i
            for node, p in dists.items():
                dist_rows[node + 1] = p
        alt_rows = None
        if alts:
            # row 0: root, row i+1: node i; a node never expanded lists its own token (no rival)
            k = len(next(iter(alts.values())))
            alt_rows = np.empty((len(tokens) + 1, k), np.int32)
            alt_rows[0] = root
            alt_rows[1:] = np.asarray(tokens, np.int32)[:, None]
            for node, top in alts.items():
                alt_rows[node + 1] = top
        return DraftExpansion(
            session_id=req.session_id, step=req.step, epoch=req.epoch, root_token=root,
            position=position, parents=np.asarray(parents, np.int32), tokens=np.asarray(tokens, np.int32),
            draft_probs=np.asarray(probs, np.float32), draft_s=time.perf_counter() - t0, dists=dist_rows,
            alternatives=alt_rows,
        )

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

    @staticmethod
    def _distribution(logits: np.ndarray, params) -> np.ndarray:
        from lever_actors.sampling import probs_from_logits

        if params.greedy:
            z = logits.astype(np.float64)
            p = np.exp(z - z.max())
            return p / p.sum()
        return probs_from_logits(logits, params)

    @staticmethod
    def _children(p: np.ndarray, k: int, params, step: int, node: int) -> list[int]:
        """Greedy: the top-k tokens. Sampling: k tokens drawn without replacement from p."""
        from lever_actors.sampling import rng_for

        if params.greedy:
            top = np.argpartition(-p, min(k, len(p) - 1))[:k]
            return [int(t) for t in top[np.argsort(-p[top], kind="stable")]]
        rng = rng_for(params.seed ^ 0x5EED, step, node + 1)
        nz = int(np.count_nonzero(p))
        return [int(t) for t in rng.choice(len(p), size=min(k, nz), replace=False, p=p)]

    def _feed_level(self, level: list[int], parents: list[int], tokens: list[int]) -> np.ndarray:
        """Run one tree level through the draft model; its rows go to scratch slots base+node."""
        from lever_actors.model import attention_layout

        kv = self.m.kv
        base = kv.length
        for node in level:  # record the scratch tree for the next request's sync
            self.children.setdefault(parents[node], {})[tokens[node]] = node
        while len(self.fed) <= max(level):
            self.fed.append(False)
        visible = []
        for node in level:
            path, n = [], node
            while n >= 0:
                path.append(base + n)
                n = parents[n]
            visible.append(path[::-1])
        slots = np.asarray([base + n for n in level])
        positions = np.asarray([base + len(v) - 1 for v in visible])
        hidden = self.m.forward_resident([tokens[n] for n in level], positions, slots,
                                         attention_layout(kv.context, base, visible))
        for n in level:
            self.fed[n] = True
        return hidden

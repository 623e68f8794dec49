"""Drafter: the resident draft model proposes the next tokens."""
from __future__ import annotations

import time

import numpy as np
import trio

from protocols import DraftExpansion, DraftRequest


class Drafter:
    """Owns the draft model and its KV cache; answers each DraftRequest with a DraftExpansion.

    Inputs: ``requests_recv`` (DraftRequest: newly committed tokens, the last one
    being the root, and how much to draft).
    Outputs: ``out_send`` (DraftExpansion; ``parents`` -1 = child of the root).
    Invariants: the draft KV holds exactly the committed prefix before the root
    plus scratch rows of the last draft; scratch rows whose tokens were then
    committed are kept, not recomputed (and after a fully accepted chain the last
    drafted token, never fed, is fed now: the catch-up step).
    Backpressure: one request at a time on the CPU lane.
    Cancellation: a draft in a thread finishes; the KV may hold a partial
    scratch area, which the next request's prefix matching discards.
    """

    def __init__(self, model, requests_recv, out_send, lanes, tracer) -> None:
        self.m = model
        self.requests_recv, self.out_send = requests_recv, out_send
        self.lanes, self.tracer = lanes, tracer
        self.scratch: list[int] = []  # tokens fed after the committed prefix, in slot order

    def reset(self) -> None:
        self.m.kv.truncate(0)
        self.scratch = []

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
            kv.commit(slots)
        return last

    def draft(self, req: DraftRequest) -> DraftExpansion:
        from lever_actors.model import causal_layout
        from lever_actors.sampling import SamplingParams, probs_from_logits, rng_for, sample

        t0 = time.perf_counter()
        if req.reset:
            self.reset()
        new = list(req.committed)
        kv = self.m.kv
        k = 0
        while k < min(len(self.scratch), len(new) - 1) and self.scratch[k] == new[k]:
            k += 1  # never reuse the root's row: its logits are needed and were not kept
        kv.commit(list(range(kv.length, kv.length + k)))  # scratch rows that became committed stay
        self.scratch = []
        hidden = self._feed(new[k:]) if k < len(new) else None
        parents, tokens, probs, dists = [], [], [], []
        params = SamplingParams(req.temperature, req.top_p, req.seed)
        if req.max_depth > 0:
            if hidden is None:
                raise RuntimeError("draft request commits nothing new: the root must be newly committed")
            for depth in range(req.max_depth):
                logits = self.m.logits(hidden)[0]
                if params.greedy:
                    z = logits.astype(np.float64)
                    p = np.exp(z - z.max())
                    p /= p.sum()
                    tok = int(np.argmax(logits))
                else:
                    p = probs_from_logits(logits, params)
                    tok = sample(p, rng_for(params.seed ^ 0x5EED, req.step, depth))
                    dists.append(p.astype(np.float32))
                parents.append(depth - 1)
                tokens.append(tok)
                probs.append(float(p[tok]))
                if depth + 1 == req.max_depth:
                    break
                pos = kv.length + len(self.scratch)
                hidden = self.m.forward_resident([tok], [pos], [pos], self._layout(pos))
                self.scratch.append(tok)
        self.tracer.add(f"draft {len(tokens)}", "cpu", t0, time.perf_counter())
        return DraftExpansion(
            session_id=req.session_id, step=req.step, epoch=req.epoch, root_token=req.root_token,
            position=req.position, parents=np.asarray(parents, np.int32), tokens=np.asarray(tokens, np.int32),
            draft_probs=np.asarray(probs, np.float32), draft_s=time.perf_counter() - t0,
            dists=np.stack(dists) if dists else None,
        )

    def _layout(self, pos: int):
        from lever_actors.model import attention_layout

        # committed prefix + the scratch chain up to and including this token
        kv = self.m.kv
        return attention_layout(kv.context, kv.length, [list(range(kv.length, pos + 1))])

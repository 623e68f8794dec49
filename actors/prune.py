"""CpuPruner: scores tree nodes at an exit layer and tells the verifier which ones survive."""
from __future__ import annotations

import time

import numpy as np
import trio

from lever_actors.prune import directly_pruned, lens_margins, prune_mask
from protocols import ExitHidden, PruneMask


class CpuPruner:
    """Inputs: ``exits_recv`` (ExitHidden; hidden rows behind a handle of ``hidden``).
    Outputs: ``masks_send`` (PruneMask, one per ExitHidden, same session and step).

    Invariants: the mask keeps the root, is ancestor-closed and never revives a
    node that an earlier exit dropped; with no threshold it keeps every node
    (scores are still recorded, which is how calibration runs).
    Backpressure: the verifier waits for each mask, so one message is in flight.
    Cancellation: stateless between messages; the handle stays the verifier's.
    """

    def __init__(self, head_rows, eps: float, exits_recv, masks_send, hidden, lanes, tracer,
                 record: list | None = None) -> None:
        self.head_rows, self.eps = head_rows, eps
        self.exits_recv, self.masks_send = exits_recv, masks_send
        self.hidden, self.lanes, self.tracer = hidden, lanes, tracer
        self.record = record  # calibration: (session, step, layer, node, margin) per scored node
        self.scored = 0
        self.pruned = 0

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with self.exits_recv, self.masks_send:
            task_status.started()
            async for msg in self.exits_recv:
                keep = await self.lanes.run("prune", self.decide, msg)
                await self.masks_send.send(PruneMask(session_id=msg.session_id, step=msg.step, epoch=msg.epoch,
                                                     layer=msg.layer, keep=keep))

    def decide(self, msg: ExitHidden) -> np.ndarray:
        t0 = time.perf_counter()
        n = len(msg.tokens)
        alive = np.zeros(n, bool)
        alive[msg.node_ids] = True
        parents = np.asarray(msg.parents, np.int64)
        nodes = np.asarray([v for v in range(1, n) if alive[v] and alive[parents[v]]], np.int64)
        margins = {}
        if msg.alternatives is not None and len(nodes):
            rows_of = {int(v): r for r, v in enumerate(msg.node_ids)}
            m = lens_margins(self.hidden.get(msg.handle), rows_of, parents, np.asarray(msg.tokens), msg.alternatives,
                             self.head_rows, self.head_rows.norm, self.eps, nodes)
            margins = {int(v): float(x) for v, x in zip(nodes, m)}
            if self.record is not None:
                self.record.extend((msg.session_id, msg.step, msg.layer, v, x) for v, x in margins.items())
        keep = prune_mask(parents, alive, margins, msg.threshold)
        self.scored += len(margins)
        self.pruned += len(directly_pruned(parents, alive, keep))
        self.tracer.add(f"prune {int(alive.sum() - keep.sum())}/{len(nodes)}", "prune", t0, time.perf_counter())
        return keep

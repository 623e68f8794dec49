"""CpuPruner: scores tree nodes at an exit layer, tells the verifier which ones survive and the
drafter which outcome the pass is heading for."""
from __future__ import annotations

import time

import numpy as np
import trio

from lever_actors.prune import directly_pruned, lens_margins, predict_outcome, prune_mask
from protocols import DraftSteer, ExitHidden, PruneMask


class CpuPruner:
    """Inputs: ``exits_recv`` (ExitHidden; hidden rows behind a handle of ``hidden``).
    Outputs: ``masks_send`` (PruneMask, one per ExitHidden, same session and step);
    ``steer_send`` (optional: a DraftSteer predicting the pass's outcome after each ExitHidden
    of layer ``predict_layer``, sent without waiting: a steer the drafter has no room for is
    advice lost, never a stall of the verifier).

    Invariants: the mask keeps the root, is ancestor-closed and never revives a
    node that an earlier exit dropped; with no threshold it keeps every node
    (scores are still recorded, which is how calibration runs).
    Backpressure: the verifier waits for each mask, so one message is in flight.
    Cancellation: stateless between messages; the handle stays the verifier's.
    """

    def __init__(self, head_rows, eps: float, exits_recv, masks_send, hidden, lanes, tracer,
                 record: list | None = None, steer_send=None, predict_layer: int | None = None,
                 prune_layers: tuple[int, ...] | None = None) -> None:
        self.head_rows, self.eps = head_rows, eps
        self.exits_recv, self.masks_send = exits_recv, masks_send
        self.hidden, self.lanes, self.tracer = hidden, lanes, tracer
        self.record = record  # calibration: (session, step, layer, node, margin) per scored node
        self.scored = 0
        self.pruned = 0
        self.steer_send, self.predict_layer = steer_send, predict_layer
        self.prune_layers = prune_layers  # where the threshold applies (None: every exit; not the prediction's)
        self.predictions = 0

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with self.exits_recv, self.masks_send:
            task_status.started()
            async for msg in self.exits_recv:
                keep, steer = await self.lanes.run("prune", self._decide_and_predict, msg)
                await self.masks_send.send(PruneMask(session_id=msg.session_id, step=msg.step, epoch=msg.epoch,
                                                     layer=msg.layer, keep=keep))
                if steer is not None:
                    try:
                        self.steer_send.send_nowait(steer)
                    except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                        pass

    def _decide_and_predict(self, msg: ExitHidden) -> tuple[np.ndarray, DraftSteer | None]:
        keep = self.decide(msg)
        return keep, self.predict(msg, keep)

    def predict(self, msg: ExitHidden, keep: np.ndarray) -> DraftSteer | None:
        """The pass's outcome as the lens at this exit sees it (over the nodes that go on), as a steer."""
        if self.steer_send is None or msg.layer != self.predict_layer or msg.alternatives is None:
            return None
        t0 = time.perf_counter()
        rows_of = {int(v): r for r, v in enumerate(msg.node_ids)}
        path, nxt = predict_outcome(self.hidden.get(msg.handle), rows_of, np.asarray(msg.parents, np.int64),
                                    np.asarray(msg.tokens), msg.alternatives, self.head_rows, self.head_rows.norm,
                                    self.eps, keep)
        self.predictions += 1
        self.tracer.add(f"predict {len(path)}+{nxt}", "prune", t0, time.perf_counter())
        return DraftSteer(session_id=msg.session_id, step=msg.step, epoch=msg.epoch, path=path, next_token=nxt)

    def decide(self, msg: ExitHidden) -> np.ndarray:
        t0 = time.perf_counter()
        n = len(msg.tokens)
        alive = np.zeros(n, bool)
        alive[msg.node_ids] = True
        parents = np.asarray(msg.parents, np.int64)
        nodes = np.asarray([v for v in range(1, n) if alive[v] and alive[parents[v]]], np.int64)
        margins = {}
        threshold = msg.threshold if self.prune_layers is None or msg.layer in self.prune_layers else None
        if msg.alternatives is not None and len(nodes) and (threshold is not None or self.record is not None):
            rows_of = {int(v): r for r, v in enumerate(msg.node_ids)}
            m = lens_margins(self.hidden.get(msg.handle), rows_of, parents, np.asarray(msg.tokens), msg.alternatives,
                             self.head_rows, self.head_rows.norm, self.eps, nodes)
            margins = {int(v): float(x) for v, x in zip(nodes, m)}
            if self.record is not None:
                self.record.extend((msg.session_id, msg.step, msg.layer, v, x) for v, x in margins.items())
        keep = prune_mask(parents, alive, margins, threshold)
        self.scored += len(margins)
        self.pruned += len(directly_pruned(parents, alive, keep))
        self.tracer.add(f"prune {int(alive.sum() - keep.sum())}/{len(nodes)}", "prune", t0, time.perf_counter())
        return keep

"""Lanes: where blocking work runs. One lane = one limiter = one kind of hardware.

``flash`` reads, ``build`` turns a streamed buffer into a session, ``npu`` runs
target layers, ``cpu`` drafts, ``prune`` scores tree nodes at an exit layer (small, and
never queued behind a draft the verifier is not waiting for). Each lane is serial (or ``width``-wide), and lanes
run in parallel with each other because ORT and ``preadv`` release the GIL.
Tests swap in :class:`VirtualLanes`, which charge a modelled duration on trio's
clock instead of using threads, so overlap can be checked exactly under MockClock.
"""
from __future__ import annotations

from typing import Callable

import trio


class ThreadLanes:
    """``inline`` lanes run their calls on the event loop's own thread: for work of microseconds
    (wrapping a streamed buffer as a native layer) the round trip through a worker thread costs
    more than the work, and it sits between every read and the compute of its layer (measured:
    a median 0.4-0.9 ms from a read's end to its build's start on a busy 2-core machine)."""

    def __init__(self, widths: dict[str, int] | None = None, inline: tuple[str, ...] = ()) -> None:
        widths = {"flash": 1, "build": 1, "npu": 1, "cpu": 1, "prune": 1, **(widths or {})}
        self.limiters = {name: trio.CapacityLimiter(w) for name, w in widths.items()}
        self.inline = frozenset(inline)

    async def run(self, lane: str, fn: Callable, *args, cost=None):
        if lane in self.inline:
            return fn(*args)
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiters[lane])


class VirtualLanes:
    """Runs ``fn`` inline and then sleeps ``cost(lane, *args)`` virtual seconds holding the lane."""

    def __init__(self, cost: Callable[..., float]) -> None:
        self.cost = cost
        self.limiters = {name: trio.CapacityLimiter(1) for name in ("flash", "build", "npu", "cpu", "prune")}
        self.busy: dict[str, float] = {}

    async def run(self, lane: str, fn: Callable, *args, cost=None):
        async with self.limiters[lane]:
            out = fn(*args)
            seconds = self.cost(lane, fn, *args)
            self.busy[lane] = self.busy.get(lane, 0.0) + seconds
            await trio.sleep(seconds)
            return out

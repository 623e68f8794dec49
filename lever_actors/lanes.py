"""Lanes: where blocking work runs. One lane = one limiter = one kind of hardware.

``flash`` reads, ``build`` turns a streamed buffer into a session, ``npu`` runs
target layers, ``cpu`` drafts, ``prune`` scores tree nodes at an exit layer (small, and
never queued behind a draft the verifier is not waiting for). Each lane is serial (or ``width``-wide), and lanes
run in parallel with each other because ORT and ``preadv`` release the GIL.
Tests swap in :class:`VirtualLanes`, which charge a modelled duration on trio's
clock instead of using threads, so overlap can be checked exactly under MockClock.
"""
from __future__ import annotations

import queue
import threading
from contextlib import asynccontextmanager
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

    @asynccontextmanager
    async def serial(self, lane: str, capacity: int):
        """A thread of the lane's own for a stream of calls, run one after another in the order
        submitted, each result posted without waiting for the event loop. The next call starts the
        moment the last one ends if it was already submitted: on two busy cores, the round trip
        through the event loop between two reads (result back, next call out, a worker woken)
        cost a mean 0.8 ms a read (p90 1.8 ms), 7% of a decode pass. At most ``capacity`` calls
        may be outstanding. Leaving waits for the call in progress (a thread cannot be
        interrupted, and its buffer must outlive it), abandoning those not started."""
        results_send, results_recv = trio.open_memory_channel(max(capacity, 1))
        token = trio.lowlevel.current_trio_token()
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        stop = threading.Event()

        def post(outcome) -> None:
            try:
                results_send.send_nowait(outcome)
            # no one collects any more; a callback of run_sync_soon must never raise (it would crash trio)
            except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                pass

        def work() -> None:
            while True:
                job = jobs.get()
                if job is None or stop.is_set():
                    return
                fn, args = job
                try:
                    outcome = (True, fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the submitter, who raises it
                    outcome = (False, exc)
                token.run_sync_soon(post, outcome)

        async with self.limiters[lane]:  # the lane is this thread's while it lives
            thread = threading.Thread(target=work, name=f"lever-{lane}", daemon=True)
            thread.start()
            try:
                yield SerialLane(lambda fn, *args: jobs.put((fn, args)), results_recv)
            finally:
                stop.set()
                jobs.put(None)
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(thread.join)
                results_send.close()


class SerialLane:
    """What :meth:`ThreadLanes.serial` yields: ``submit(fn, *args)`` (never blocks) and
    ``results``, which receives ``(True, value)`` or ``(False, exception)`` per call, in order."""

    def __init__(self, submit: Callable, results) -> None:
        self.submit, self.results = submit, results


class VirtualLanes:
    """Runs ``fn`` inline and then sleeps ``cost(lane, *args)`` virtual seconds holding the lane."""

    def __init__(self, cost: Callable[..., float]) -> None:
        self.cost = cost
        self.limiters = {name: trio.CapacityLimiter(1) for name in ("flash", "build", "npu", "cpu", "prune")}
        self.spans: list[tuple[str, float, float]] = []  # (lane, start, end) of every call, virtual time

    async def run(self, lane: str, fn: Callable, *args, cost=None):
        async with self.limiters[lane]:
            out = fn(*args)
            seconds = self.cost(lane, fn, *args)
            start = trio.current_time()
            self.spans.append((lane, start, start + seconds))
            await trio.sleep(seconds)
            return out

    def busy(self, t0: float = float("-inf"), t1: float = float("inf")) -> dict[str, float]:
        """Seconds each lane was busy inside ``[t0, t1]``: a call still running at either edge (a
        read-ahead of the next pass) counts only for its part inside the window."""
        out: dict[str, float] = {}
        for lane, start, end in self.spans:
            inside = min(end, t1) - max(start, t0)
            if inside > 0:
                out[lane] = out.get(lane, 0.0) + inside
        return out

    @asynccontextmanager
    async def serial(self, lane: str, capacity: int):
        """The same contract as :meth:`ThreadLanes.serial`, on virtual time: one task runs the
        submitted calls in order through :meth:`run`."""
        jobs_send, jobs_recv = trio.open_memory_channel(max(capacity, 1))
        results_send, results_recv = trio.open_memory_channel(max(capacity, 1))

        async def work() -> None:
            async for fn, args in jobs_recv:
                try:
                    outcome = (True, await self.run(lane, fn, *args))
                except Exception as exc:  # noqa: BLE001 - handed to the submitter
                    outcome = (False, exc)
                results_send.send_nowait(outcome)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(work)
            try:
                yield SerialLane(lambda fn, *args: jobs_send.send_nowait((fn, args)), results_recv)
            finally:
                nursery.cancel_scope.cancel()

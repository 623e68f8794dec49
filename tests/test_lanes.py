"""ThreadLanes: blocking work runs in its lane's worker thread, except on an inline lane."""
from __future__ import annotations

import threading

import trio
import trio.testing

from lever_actors.lanes import ThreadLanes


def _thread_of_each(lanes: ThreadLanes, names: tuple[str, ...]) -> dict[str, int]:
    async def main():
        loop = threading.get_ident()
        return loop, {name: await lanes.run(name, threading.get_ident) for name in names}

    loop, seen = trio.run(main)
    return {name: ident == loop for name, ident in seen.items()}


def test_inline_lane_runs_on_the_event_loop_and_the_others_in_threads():
    on_loop = _thread_of_each(ThreadLanes(inline=("build",)), ("build", "flash", "npu"))
    assert on_loop == {"build": True, "flash": False, "npu": False}


def test_no_lane_is_inline_by_default():
    on_loop = _thread_of_each(ThreadLanes(), ("build", "flash", "npu", "cpu", "prune"))
    assert not any(on_loop.values())



def _serial_run(lanes, body):
    async def main():
        async with lanes.serial("flash", 4) as lane:
            return await body(lane)

    return trio.run(main)


def test_serial_lane_starts_the_next_call_without_the_event_loop():
    """Two calls submitted together: the second starts while the event loop is still blocked, so
    nothing between two reads waits for the loop (what the per-call thread hop cost)."""
    import time

    starts = []

    def call(i):
        starts.append((i, time.perf_counter(), threading.get_ident()))
        return i

    async def body(lane):
        lane.submit(call, 0)
        lane.submit(call, 1)
        time.sleep(0.3)  # the loop is blocked: nothing can be dispatched from it
        blocked_until = time.perf_counter()
        got = [await lane.results.receive() for _ in range(2)]
        return got, blocked_until, threading.get_ident()

    got, blocked_until, loop = _serial_run(ThreadLanes(), body)
    assert got == [(True, 0), (True, 1)]
    assert [i for i, _, _ in starts] == [0, 1]
    assert all(t < blocked_until for _, t, _ in starts)
    assert len({ident for _, _, ident in starts}) == 1 and starts[0][2] != loop


def test_serial_lane_hands_back_exceptions_in_order():
    def fail():
        raise OSError("disk gone")

    async def body(lane):
        lane.submit(fail)
        lane.submit(lambda: "after")
        return [await lane.results.receive() for _ in range(2)]

    (ok0, exc), second = _serial_run(ThreadLanes(), body)
    assert not ok0 and isinstance(exc, OSError) and second == (True, "after")


def test_leaving_a_serial_lane_waits_for_the_call_in_progress_and_drops_the_rest():
    """The pool a read writes into is closed right after the prefetcher exits: a read still
    running then would write into freed memory."""
    import time

    started, finished, ran_later = threading.Event(), [], []

    class _Leave(Exception):
        pass

    def slow():
        started.set()
        time.sleep(0.2)
        finished.append(time.perf_counter())

    async def main():
        with trio.move_on_after(5):
            async with ThreadLanes().serial("flash", 4) as lane:
                lane.submit(slow)
                lane.submit(lambda: ran_later.append(1))
                await trio.to_thread.run_sync(started.wait)
                raise _Leave()

    try:
        trio.run(main)
    except _Leave:
        pass
    left = time.perf_counter()
    assert finished and finished[0] <= left
    assert ran_later == []


def test_virtual_serial_lane_charges_each_call_in_order_on_virtual_time():
    from lever_actors.lanes import VirtualLanes

    lanes = VirtualLanes(lambda lane, fn, *args: 0.5)

    async def body(lane):
        t0 = trio.current_time()
        for i in range(3):
            lane.submit(lambda i=i: i)
        got = []
        for _ in range(3):
            got.append((await lane.results.receive(), trio.current_time() - t0))
        return got

    async def main():
        async with lanes.serial("flash", 4) as lane:
            return await body(lane)

    got = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert [g for g, _ in got] == [(True, 0), (True, 1), (True, 2)]
    assert [t for _, t in got] == [0.5, 1.0, 1.5]


def test_virtual_busy_counts_only_the_part_of_a_call_inside_the_window():
    # a read-ahead still running when a generation ends must not be charged to that generation
    from lever_actors.lanes import VirtualLanes

    lanes = VirtualLanes(lambda lane, fn, *args: 1.0)

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lanes.run, "flash", lambda: None)  # [0, 1]
            await trio.sleep(0.25)
            nursery.start_soon(lanes.run, "npu", lambda: None)  # [0.25, 1.25]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert lanes.busy() == {"flash": 1.0, "npu": 1.0}
    assert lanes.busy(0.5, 1.0) == {"flash": 0.5, "npu": 0.5}
    assert lanes.busy(1.0, 2.0) == {"npu": 0.25}

"""ThreadLanes: blocking work runs in its lane's worker thread, except on an inline lane."""
from __future__ import annotations

import threading

import trio

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


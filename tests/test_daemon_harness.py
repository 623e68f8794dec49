"""The MockClock harness of the daemon tests: a run that spins fails, it never hangs.

Under ``MockClock(autojump_threshold=0)`` virtual time moves only when every
task is blocked. A task that keeps checkpointing without blocking therefore
freezes virtual time, so no ``fail_after`` can end the test and CI would hang at
100% CPU. ``run_autojump`` (behind ``@trio_autojump`` and the fuzz tests) adds a
real-time watchdog; these tests check that it turns each kind of spin into a
failure that names the spinning code.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio

from fake_backend import (FakeBackend, RawConnection, WatchdogTimeout, run_autojump,
                          running_daemon, trio_autojump)


async def spin_with_checkpoints() -> None:
    while True:
        await trio.lowlevel.checkpoint()


def test_a_task_that_keeps_checkpointing_fails_with_its_stack():
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(spin_with_checkpoints)
            await trio.sleep(1)  # never: virtual time cannot move

    t0 = time.monotonic()
    with pytest.raises(WatchdogTimeout, match="busy loop") as info:
        run_autojump(main, watchdog_s=0.5, grace_s=5.0)
    assert time.monotonic() - t0 < 5.0  # stage 1: the sample named it and cancelled the run
    assert "steps: test_daemon_harness.spin_with_checkpoints" in str(info.value)
    assert "in spin_with_checkpoints" in str(info.value)


def test_a_loop_without_any_checkpoint_is_interrupted():
    async def main() -> None:
        while True:
            pass

    # the grace is what the interrupted run gets to stop before the last resort (exiting the
    # process): 0.5 s once proved too short on a loaded machine, and the whole suite died with it
    with pytest.raises(WatchdogTimeout, match="did not answer") as info:
        run_autojump(main, watchdog_s=0.3, grace_s=3.0)
    assert "in main" in str(info.value)  # the main thread's stack, taken by the watchdog


def test_a_wedged_run_fails_at_once_in_virtual_time():
    t0 = time.monotonic()
    with pytest.raises(trio.TooSlowError):
        run_autojump(trio.sleep_forever, watchdog_s=30)
    assert time.monotonic() - t0 < 5.0


def test_a_healthy_run_returns_its_result():
    async def main(x: int) -> int:
        await trio.sleep(100)  # virtual
        return x + 1

    assert run_autojump(main, 41, watchdog_s=5) == 42


class SpinningBackend(FakeBackend):
    """A backend bug: it polls instead of sleeping, so virtual time never advances."""

    async def generate(self, params, emit):
        deadline = trio.current_time() + 1.0
        while trio.current_time() < deadline:
            await trio.lowlevel.checkpoint()
        return await super().generate(params, emit)


def test_a_daemon_test_that_spins_fails_instead_of_hanging(tmp_path: Path):
    @trio_autojump(watchdog_s=1.0)
    async def daemon_test(tmp_path: Path) -> None:
        async with running_daemon(tmp_path / "d.sock", SpinningBackend()):
            conn = await RawConnection.open(tmp_path / "d.sock")
            await conn.request(1, "generate", {"prompt": "x", "max_tokens": 2})

    with pytest.raises(WatchdogTimeout) as info:
        daemon_test(tmp_path)
    assert "in generate" in str(info.value) and "Engine.run" in str(info.value)


def test_a_slow_run_whose_clock_moves_is_not_a_busy_loop():
    """A loaded machine makes a healthy run slow in real time; its virtual clock still moves, so
    the watchdog extends the deadline instead of failing it (a CI run once died this way)."""
    async def main() -> int:
        for _ in range(12):
            time.sleep(0.1)  # real time passes, as on a loaded machine
            await trio.sleep(1)  # and the run goes on in virtual time
        return 7

    t0 = time.monotonic()
    assert run_autojump(main, watchdog_s=0.3, grace_s=3.0) == 7
    assert time.monotonic() - t0 > 0.9  # it really outlived several watchdog windows

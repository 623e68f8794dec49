"""The MockClock harness of the daemon tests: a run that spins fails, it never hangs.

Under ``MockClock(autojump_threshold=0)`` virtual time moves only when every
task is blocked. A task that keeps checkpointing without blocking therefore
freezes virtual time, so no ``fail_after`` can end the test and CI would hang at
100% CPU. ``run_autojump`` (behind ``@trio_autojump`` and the fuzz tests) adds a
real-time watchdog; these tests check that it turns each kind of spin into a
failure that names the spinning code.
"""
from __future__ import annotations

import os
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


CHECKPOINTLESS = """
import sys
sys.path[:0] = sys.argv[1:]
from fake_backend import WatchdogTimeout, run_autojump

async def main():
    while True:
        pass

try:
    run_autojump(main, watchdog_s=0.3, grace_s=3.0)
except WatchdogTimeout as exc:
    print(exc)
"""


def test_a_loop_without_any_checkpoint_is_interrupted(tmp_path):
    """In a process of its own: this is the one case whose last resort is exiting the process.

    Either way the run must end with the main thread's stack in a report: interrupted (the test's
    WatchdogTimeout), or, when the interrupt is not taken (seen under a CPU hog in a full suite
    run), by the last resort, exit 70 with the report in a file."""
    import subprocess
    import sys

    tests = Path(__file__).parent
    report = tmp_path / "watchdog-report.txt"
    p = subprocess.run([sys.executable, "-c", CHECKPOINTLESS, str(tests), str(tests.parent)], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "LEVER_TEST_WATCHDOG_REPORT": str(report)})
    assert p.returncode in (0, 70), (p.returncode, p.stderr[-2000:])
    text = p.stdout if p.returncode == 0 else report.read_text()
    assert "did not answer" in text and "in main" in text  # the main thread's stack, taken by the watchdog


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

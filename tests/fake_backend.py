"""A deterministic Backend for daemon tests, plus the tests' shared harness.

FakeBackend: tokens come from a hash of (prompt, seed, position); each token
takes ``await trio.sleep(delay_s)`` (virtual time under MockClock); chunks of
1-3 tokens are emitted the way speculative passes commit them. A buffer pool
counts what each generation holds, so tests can prove cancellation frees
everything. A prompt containing ``FAIL`` raises after two tokens.

Usable from a daemon process: ``python -m lever_actors.daemon --backend
fake_backend:make_backend`` with this directory on PYTHONPATH; LEVER_FAKE_DELAY_S
and LEVER_FAKE_CONTEXT set its token delay and context length.
"""
from __future__ import annotations

import _thread
import collections
import contextlib
import functools
import hashlib
import os
import socket
import sys
import threading
import traceback
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import trio
import trio.testing

from lever_actors.backend import Emit, GenerateOutcome, GenerateParams
from lever_actors.daemon import ServeConfig, serve
from lever_actors.errors import ConfigError

WORDS = ("alpha ", "beta ", "gamma ", "delta ", "eps ", "zeta ", "eta ", "theta ", "iota ",
         "kappa ", "lambda ", "mu ", "nu ", "xi ", "omicron ", "pi ", "rho ", "sigma ", "tau ",
         "phi ", "chi ", "psi ", "omega ", "é ", "→ ", "\n", "(", ")", ":", "=", "return ", "def ")


class BufferPool:
    """Counts buffers; acquiring from an empty pool is a test failure (a leak)."""

    def __init__(self, total: int):
        self.total, self.free = total, total

    def acquire(self) -> None:
        if self.free == 0:
            raise RuntimeError("buffer pool exhausted: a previous request leaked buffers")
        self.free -= 1

    def release(self) -> None:
        self.free += 1
        assert self.free <= self.total


def prompt_text(params: GenerateParams) -> str:
    if params.prompt is not None:
        return params.prompt
    return "".join(f"{m['role']}: {m['content']}\n" for m in params.messages or ())


def _digest(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def token_at(params: GenerateParams, position: int) -> int:
    return _digest(prompt_text(params), params.seed, params.temperature, position) % len(WORDS)


def expected_tokens(params: GenerateParams) -> tuple[list[int], str, str]:
    """What FakeBackend produces for ``params``: (token ids, text, finish reason)."""
    ids: list[int] = []
    text = ""
    for pos in range(params.max_tokens):
        tok = token_at(params, pos)
        if any(s in text + WORDS[tok] for s in params.stop):
            return ids, text, "stop"
        ids.append(tok)
        text += WORDS[tok]
    return ids, text, "length"


class FakeBackend:
    def __init__(self, *, delay_s: float = 0.01, context_length: int = 8192,
                 buffers: int = 4, modes: tuple[str, ...] = ("resident-ar", "flash-ar", "flash-chain"),
                 description_padding: int = 0, prefill_s: float = 0.0):
        self.delay_s = delay_s
        self.prefill_s = prefill_s
        self.description_padding = description_padding
        self.context_length = context_length
        self.modes = modes
        self.pool = BufferPool(buffers)
        self.generations = 0

    def describe(self) -> dict:
        return {"models": {"draft": {"name": "fake-draft", "n_vocab": len(WORDS)},
                           "target": {"name": "fake-target", "n_vocab": len(WORDS)}},
                "mode": self.modes[0], "modes": list(self.modes),
                "context_length": self.context_length, "dram_budget_bytes": None,
                "padding": "x" * self.description_padding}

    def count_prompt_tokens(self, params: GenerateParams) -> int:
        return len(prompt_text(params).split()) + 1

    def pool_stats(self) -> dict:
        return {"buffers_total": self.pool.total, "buffers_free": self.pool.free}

    async def generate(self, params: GenerateParams, emit: Emit) -> GenerateOutcome:
        self.generations += 1
        if params.mode is not None and params.mode.startswith("flash-chain:"):
            if not params.mode.partition(":")[2].isdigit():
                raise ConfigError(f"flash-chain needs an integer draft length, got {params.mode!r}")
        self.pool.acquire()  # the request's KV buffer, held until the end
        try:
            await trio.sleep(self.prefill_s)  # the prompt pass: no emit for a while
            ids, text, reason = expected_tokens(params)
            pos = passes = 0
            while pos < len(ids):
                n = 1 + _digest("chunk", prompt_text(params), pos) % 3
                chunk = ids[pos:pos + n]
                self.pool.acquire()  # a per-pass scratch buffer, across the await
                try:
                    await trio.sleep(self.delay_s * len(chunk))
                    if "FAIL" in prompt_text(params) and pos >= 2:
                        raise RuntimeError("injected backend failure")
                    await emit("".join(WORDS[t] for t in chunk), chunk)
                finally:
                    self.pool.release()
                pos += len(chunk)
                passes += 1
            drafted = len(ids) + passes
            stats = {"draft_n": drafted, "draft_n_accepted": len(ids) - passes,
                     "mean_accepted": (len(ids) - passes) / passes if passes else 0.0,
                     "passes": passes, "flash_bytes_read": 1000 * passes,
                     "flash_bytes_per_token": 1000 * passes / len(ids) if ids else 0.0,
                     "io_s": self.delay_s * passes / 2, "compute_s": self.delay_s * len(ids),
                     "n_tokens": len(ids)}
            return GenerateOutcome(text=text, token_ids=ids, finish_reason=reason, stats=stats)
        finally:
            self.pool.release()


class SlowLoadingFakeBackend(FakeBackend):
    """A FakeBackend whose ``run`` takes ``load_s`` to "load the models" before it is ready."""

    def __init__(self, load_s: float, **kw: Any):
        super().__init__(**kw)
        self.load_s = load_s

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await trio.sleep(self.load_s)
        task_status.started()
        await trio.sleep_forever()


def make_backend(args: Any) -> FakeBackend:
    """Factory for ``--backend fake_backend:make_backend`` in a daemon process."""
    kw = dict(delay_s=float(os.environ.get("LEVER_FAKE_DELAY_S", "0.005")),
              context_length=int(os.environ.get("LEVER_FAKE_CONTEXT", "8192")))
    load_s = float(os.environ.get("LEVER_FAKE_LOAD_S", "0"))
    return SlowLoadingFakeBackend(load_s, **kw) if load_s else FakeBackend(**kw)


def params(prompt: str = "def add(a, b):", **kw: Any) -> GenerateParams:
    base = dict(prompt=prompt, messages=None, max_tokens=16, temperature=0.0, top_p=1.0,
                seed=None, stop=(), mode=None)
    base.update(kw)
    return GenerateParams(**base)


# --- harness ------------------------------------------------------------------------

#: Real seconds a MockClock run may take before the watchdog fails it. A daemon
#: test needs well under a second; only a busy loop (tasks that stay runnable,
#: so autojump never fires) gets near this.
WATCHDOG_S = float(os.environ.get("LEVER_TEST_WATCHDOG_S", "120"))


class WatchdogTimeout(AssertionError):
    """A MockClock run took too long in real time: something kept the loop busy."""


class _Watchdog(trio.abc.Instrument):
    """Fails a MockClock run that is still going after ``seconds`` of real time.

    A busy loop keeps tasks runnable, so the autojump clock never advances and
    no virtual timeout (``fail_after``) can fire; only real time can end such
    a run. A run whose virtual clock still moves is slow, not busy (a loaded
    machine): its deadline is extended. Escalation, from a helper thread, ``grace_s`` apart: (1) count
    which tasks the loop keeps stepping, report their await stacks and cancel
    the run; (2) if the loop does not answer (a loop with no checkpoint), take
    every thread's stack and interrupt the main thread; (3) as a last resort,
    exit the process, so CI fails instead of hanging.
    """

    SAMPLE_STEPS = 5000  # task steps counted to name the busy tasks
    MAX_EXTENSIONS = 10  # windows a slow run may take while its virtual clock still moves
    LAST_RESORT_S = 60.0  # real seconds the interrupted main thread gets before the process exits

    def __init__(self, seconds: float, grace_s: float = 10.0):
        self.seconds, self.grace_s = seconds, grace_s
        self.scope = trio.CancelScope()
        self.report: str | None = None
        self._done = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._in_main_thread = threading.current_thread() is threading.main_thread()
        self._steps: collections.Counter = collections.Counter()
        self._n_steps = 0
        self._thread = threading.Thread(target=self._watch, name="mockclock-watchdog", daemon=True)

    def start(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _call_soon(self, fn: Callable[[], None]) -> bool:
        try:
            self._token.run_sync_soon(fn)
        except trio.RunFinishedError:
            return False
        return True

    def _virtual_now(self) -> float | None:
        """The run's virtual time, read inside the loop (None if the loop did not answer in time)."""
        got, answered = [], threading.Event()

        def read() -> None:
            got.append(trio.current_time())
            answered.set()

        if not self._call_soon(read) or not answered.wait(min(1.0, self.grace_s)):
            return None
        return got[0]

    def _watch(self) -> None:
        # A slow run (a loaded machine) still moves virtual time, because its tasks block and
        # autojump fires; a busy loop keeps it still. So the deadline is extended while virtual
        # time moves, up to MAX_EXTENSIONS windows, and only a still clock (or no answer) fires.
        last = None
        for _ in range(self.MAX_EXTENSIONS + 1):
            if self._done.wait(self.seconds):
                return
            now = self._virtual_now()
            if self._done.is_set():
                return
            if now is None or now == last:
                break
            last = now
        if not self._call_soon(self._begin_sample):
            return
        # The sample reports after SAMPLE_STEPS steps; report anyway if steps are rare.
        if self._done.wait(min(1.0, self.grace_s)) or not self._call_soon(self._fire):
            return
        if self._done.wait(self.grace_s):
            return
        stacks = "".join(f"--- thread {ident}\n{''.join(traceback.format_stack(frame))}"
                         for ident, frame in sys._current_frames().items())
        self.report = (f"the trio loop did not answer {self.seconds:g} s + {self.grace_s:g} s "
                       f"of real time after the run began (a loop without a checkpoint?); "
                       f"stacks of all threads:\n{stacks}")
        if self._in_main_thread:
            # KeyboardInterrupt in the main thread ends trio.run; run_autojump turns it into this
            # test's WatchdogTimeout, so the test fails with the report and the suite goes on
            _thread.interrupt_main()
            if self._done.wait(self.LAST_RESORT_S):
                return
        # Last resort, for a main thread stuck in C code: the report goes to a file (pytest
        # captures fd 2, so a message there dies with the process) and the process exits.
        path = Path(os.environ.get("LEVER_TEST_WATCHDOG_REPORT", "watchdog-report.txt")).resolve()
        path.write_text(f"MockClock watchdog: {self.report}\n")
        err = sys.__stderr__
        err.write(f"\nMockClock watchdog: the run did not stop; report in {path}; exiting\n")
        err.flush()
        os._exit(70)

    def _begin_sample(self) -> None:
        trio.lowlevel.add_instrument(self)

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._steps[task] += 1
        self._n_steps += 1
        if self._n_steps == self.SAMPLE_STEPS:
            self._call_soon(self._fire)

    def _fire(self) -> None:
        if self.report is not None:
            return
        with contextlib.suppress(KeyError):
            trio.lowlevel.remove_instrument(self)
        lines = [f"the run was still going {self.seconds:g} s of real time after it began, at "
                 f"virtual time {trio.current_time():.3f}: a busy loop kept MockClock's autojump "
                 f"from firing. Tasks stepped in {self._n_steps} steps:"]
        for task, n in self._steps.most_common(8):
            stack = "".join(traceback.StackSummary.extract(task.iter_await_frames()).format())
            lines.append(f"--- {n} steps: {task.name}\n{stack}")
        self.report = "\n".join(lines)
        self.scope.cancel()


def run_autojump(async_fn: Callable[..., Awaitable[Any]], *args: Any,
                 watchdog_s: float | None = None, grace_s: float = 10.0) -> Any:
    """``trio.run(async_fn, *args)`` on ``MockClock(autojump_threshold=0)``, guarded.

    Virtual time: a wedged run (every task blocked) fails with TooSlowError
    after a virtual hour, which costs nothing. Real time: a run that keeps
    the loop busy, so that virtual time never moves, fails with
    :class:`WatchdogTimeout` after ``watchdog_s`` seconds (default
    ``$LEVER_TEST_WATCHDOG_S`` or 120), naming the busy tasks.
    """
    watchdog = _Watchdog(WATCHDOG_S if watchdog_s is None else watchdog_s, grace_s)

    async def guarded() -> Any:
        watchdog.start()
        with watchdog.scope, trio.fail_after(3600):
            return await async_fn(*args)

    try:
        result = trio.run(guarded, clock=trio.testing.MockClock(autojump_threshold=0))
    except BaseException as exc:
        if watchdog.report is None:
            raise
        raise WatchdogTimeout(watchdog.report) from exc
    finally:
        watchdog.stop()
    if watchdog.report is not None:
        raise WatchdogTimeout(watchdog.report)
    return result


def trio_autojump(fn=None, *, watchdog_s: float | None = None):
    """Run an async test in a fresh :func:`run_autojump` (MockClock, watchdog).

    Use as ``@trio_autojump`` or ``@trio_autojump(watchdog_s=...)``.
    """
    if fn is None:
        return functools.partial(trio_autojump, watchdog_s=watchdog_s)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return run_autojump(functools.partial(fn, *args, **kwargs), watchdog_s=watchdog_s)
    return wrapper


@contextlib.asynccontextmanager
async def running_daemon(socket_path: Path, backend: FakeBackend | None = None, **config: Any):
    """Run the real daemon in this trio run; yield it; shut it down gracefully."""
    backend = backend or FakeBackend()
    try:
        async with trio.open_nursery() as nursery:
            daemon = await nursery.start(serve, ServeConfig(socket=Path(socket_path), **config), backend)
            try:
                yield daemon
            finally:
                daemon.shutdown()
    except BaseExceptionGroup as group:  # let tests see the one exception they expect
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


class RawConnection:
    """A client that speaks raw msgpack over a trio socket (no lever client code)."""

    def __init__(self, stream: trio.SocketStream):
        self.stream = stream
        self.unpacker = msgpack.Unpacker(raw=False)

    @classmethod
    async def open(cls, path: Path) -> RawConnection:
        return cls(await trio.open_unix_socket(str(path)))

    async def send(self, obj: Any) -> None:
        await self.stream.send_all(msgpack.packb(obj, use_bin_type=True))

    async def send_bytes(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def receive(self) -> Any:
        """Next message, or None at EOF."""
        while True:
            for obj in self.unpacker:
                return obj
            data = await self.stream.receive_some(65536)
            if not data:
                return None
            self.unpacker.feed(data)

    async def request(self, msgid: int, method: str, params: dict | None = None) -> tuple[list, Any]:
        """Send a request; return (notifications seen before the response, response)."""
        await self.send([0, msgid, method, [params or {}]])
        notes = []
        while True:
            msg = await self.receive()
            if msg is None or (msg[0] == 1 and msg[1] == msgid):
                return notes, msg
            notes.append(msg)

    async def aclose(self) -> None:
        await self.stream.aclose()


def raw_blocking_request(path: Path, requests: list[list], timeout: float = 10.0) -> list:
    """Blocking socket: send requests, read until every one is answered; return all messages."""
    wanted = {r[1] for r in requests}
    out = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(b"".join(msgpack.packb(r) for r in requests))
        unpacker = msgpack.Unpacker(raw=False)
        while wanted:
            data = s.recv(65536)
            if not data:
                break
            unpacker.feed(data)
            for msg in unpacker:
                out.append(msg)
                if msg[0] == 1:
                    wanted.discard(msg[1])
    return out

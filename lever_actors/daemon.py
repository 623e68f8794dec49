"""The lever-actors daemon: msgpack-RPC on a Unix socket in front of one Backend.

Layers, bottom up: the socket files (lock, socket, status file) and the
listener, in ``lever_actors.daemon_files``; :class:`Connection` (a reader that
decodes and dispatches, a writer that drains one bounded outbound channel);
:class:`Engine` (a bounded FIFO of generations run one at a time on the
backend); :func:`serve` wires them; :func:`serve_main` adds the process
boundary (arguments, model loading, signals). The protocol itself is
documented in ``protocols/rpc.py`` only.

Concurrency rules: a connection's reader never waits for the engine or another
connection. It admits generations with a non-blocking ``submit`` (``busy``
when the queue is full) and awaits only its own connection's outbound channel,
so a client that stops reading only stalls itself, and is closed after
``stall_timeout_s``. Cancellation of one request is its job's cancel scope;
a disconnect cancels every job of that connection.

Run standalone (tests use this): ``python -m lever_actors.daemon --socket PATH
--backend MODULE:FACTORY``.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import signal
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import msgpack
import trio

from lever_actors import __version__
from lever_actors.backend import Backend, GenerateParams
from lever_actors.client import default_socket_path
from lever_actors.daemon_files import SocketFiles
from lever_actors.errors import ConfigError, ContextOverflow, DaemonAlreadyRunning, FlashFault, LeverError, first_leaf
from lever_actors.http_front import HttpConfig, HttpFront, parse_address
from lever_actors.memory import peak_rss_or_none
from protocols import rpc
from protocols.rpc import ErrorCode, RpcError

log = logging.getLogger(__name__)

_OUTBOUND_DEPTH = 64        # packed messages waiting for one connection's writer
_RECEIVE_CHUNK = 65536
_FINISHED_KEPT = 256        # finished requests per connection kept for `stats`
_MAX_CONTAINER_LEN = 65536  # array/map entries; msgpack preallocates per header
_ADDITIVE_STATS = ("draft_n", "draft_n_accepted", "passes", "flash_bytes_read", "pass_s",
                   "io_s", "compute_s", "n_tokens")


@dataclass(frozen=True)
class ServeConfig:
    socket: Path
    queue_depth: int = 8
    max_message_bytes: int = rpc.DEFAULT_MAX_MESSAGE_BYTES
    max_tokens: int = 4096
    max_connections: int = 64
    stall_timeout_s: float = 30.0
    shutdown_grace_s: float = 2.0
    http: HttpConfig | None = None  # the OpenAI-compatible HTTP face, when asked for


def _plain(obj: Any) -> Any:
    """msgpack fallback for numpy scalars and arrays a backend may put in stats."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"cannot send {type(obj).__name__} over msgpack")


def _pack(message: Any) -> bytes:
    return msgpack.packb(message, use_bin_type=True, default=_plain)


# --- engine: one generation at a time ---------------------------------------------

class Job:
    """One admitted generate request, from queue to response.

    ``conn`` is whoever asked: a msgpack-RPC :class:`Connection` or one HTTP exchange
    (``lever_actors.http_front``). The engine needs four things of it: ``id`` (for logs), the
    ``jobs`` and ``finished`` maps, and ``deliver_tokens``/``deliver_end``, which put the job's
    chunks and end on that client's wire. ``deliver_tokens`` raises ``trio.BrokenResourceError``
    or ``trio.ClosedResourceError`` when the client is gone, which cancels the job.
    """

    def __init__(self, conn: Connection, request_id: int, params: GenerateParams,
                 prompt_tokens: int):
        self.conn, self.request_id = conn, request_id
        self.params, self.prompt_tokens = params, prompt_tokens
        self.scope = trio.CancelScope()
        self.state = "queued"          # queued, running, done, cancelled, failed
        self.abandoned = False         # the connection is gone: send nothing more
        self.texts: list[str] = []     # chunks the client was sent, in order
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stats: dict = {}
        self.received_at = trio.current_time()
        self.started_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    def timings(self) -> dict:
        now = self.finished_at if self.finished_at is not None else trio.current_time()
        start = self.started_at if self.started_at is not None else now
        return {"queue_s": start - self.received_at,
                "first_token_s": (None if self.first_token_at is None
                                  else self.first_token_at - self.received_at),
                "generate_s": now - start, "total_s": now - self.received_at}

    def record(self) -> dict:
        return {"request_id": self.request_id, "state": self.state,
                "prompt_tokens": self.prompt_tokens, "n_tokens": len(self.token_ids),
                "max_tokens": self.params.max_tokens, "finish_reason": self.finish_reason,
                "stats": self.stats, "timings": self.timings()}

    def result(self) -> dict:
        return {"request_id": self.request_id, "text": "".join(self.texts),
                "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_tokens, "stats": self.stats,
                "timings": self.timings()}


class Engine:
    """A bounded FIFO of jobs and the one task that runs them on the backend.

    Backpressure: ``submit`` never waits; it refuses when ``queue_depth`` jobs
    wait. Cancellation: a job's scope cancels only that job; a queued job is
    withdrawn at once. Delivering a job's chunks and result awaits its
    connection's outbound channel (the writer's stall timeout bounds that).
    """

    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.waiting: deque[Job] = deque()
        self.running: Job | None = None
        self._lot = trio.lowlevel.ParkingLot()

    def submit(self, job: Job) -> bool:
        """Admit ``job`` unless ``queue_depth`` jobs already wait behind the running one."""
        admitted = len(self.waiting) + (self.running is not None)
        if admitted > self.daemon.config.queue_depth:
            return False
        self.waiting.append(job)
        self._lot.unpark()
        return True

    def withdraw(self, job: Job) -> bool:
        try:
            self.waiting.remove(job)
        except ValueError:
            return False
        return True

    async def run(self) -> None:
        while True:
            while not self.waiting:
                await self._lot.park()
            await self._run_one(self.waiting.popleft())

    async def _emit(self, job: Job, text: str, token_ids: list[int]) -> None:
        ids = [int(t) for t in token_ids]
        if not text and not ids:
            return
        try:
            await job.conn.deliver_tokens(job, text, ids)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            job.scope.cancel()
            await trio.lowlevel.checkpoint()  # raises Cancelled into the backend
        # Record only what was sent, so the result equals the streamed chunks.
        if job.first_token_at is None:
            job.first_token_at = trio.current_time()
        job.texts.append(text)
        job.token_ids.extend(ids)
        self.daemon.counters["tokens_generated"] += len(ids)

    async def _run_one(self, job: Job) -> None:
        job.state, job.started_at, self.running = "running", trio.current_time(), job
        outcome, error = None, None
        try:
            with job.scope:
                outcome = await self.daemon.backend.generate(job.params, partial(self._emit, job))
        except ContextOverflow as exc:
            error = (ErrorCode.CONTEXT_OVERFLOW, str(exc))
        except ConfigError as exc:  # e.g. a mode parameter the backend does not accept
            error = (ErrorCode.INVALID_PARAMS, str(exc))
        except FlashFault as exc:  # this request's pass was lost; the pipeline serves the next one
            log.error("flash fault conn=%d request_id=%d: %s", job.conn.id, job.request_id, exc)
            error = (ErrorCode.IO_ERROR if exc.retryable else ErrorCode.MODEL_DAMAGED, str(exc))
        except Exception as exc:  # the session boundary: this request fails, the daemon goes on
            log.exception("generate failed conn=%d request_id=%d", job.conn.id, job.request_id)
            error = (ErrorCode.INTERNAL, f"generation failed: {type(exc).__name__}: {exc}")
        finally:
            self.running = None
        if error is not None:
            job.state = "failed"
        elif outcome is None:
            job.state, job.finish_reason = "cancelled", "cancelled"
        else:
            job.state, job.finish_reason = "done", outcome.finish_reason
            job.stats = dict(outcome.stats)
            peak = peak_rss_or_none()
            if peak is not None:  # what --dram-budget bounds: the serving process, not the client's
                job.stats["peak_rss_bytes"] = peak
            if "".join(job.texts) != outcome.text or job.token_ids != list(outcome.token_ids):
                log.error("backend outcome differs from its emitted chunks request_id=%d", job.request_id)
        job.finished_at = trio.current_time()
        self.daemon.record_finished(job)
        if not job.abandoned:
            await job.conn.deliver_end(job, error)


# --- connections ------------------------------------------------------------------

class Connection:
    """One client: a reader that decodes and dispatches, a writer that drains."""

    def __init__(self, daemon: Daemon, stream: trio.SocketStream, conn_id: int):
        self.daemon, self.stream, self.id = daemon, stream, conn_id
        self.out_send, self._out_recv = trio.open_memory_channel[bytes](_OUTBOUND_DEPTH)
        self.jobs: dict[int, Job] = {}
        self.finished: OrderedDict[int, dict] = OrderedDict()
        self._read_scope = trio.CancelScope()
        self._stopping = False
        self._handlers = {"hello": self._hello, "generate": self._generate,
                          "cancel": self._cancel, "stats": self._stats,
                          "health": self._health, "models": self._models}

    def stop(self) -> None:
        """Daemon shutdown: stop reading; pending requests get ``cancelled``."""
        self._stopping = True
        self._read_scope.cancel()

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_loop, nursery.cancel_scope)
                with self._read_scope:
                    await self._read_loop()
                self._abandon_jobs()
                self.out_send.close()  # the writer sends what is queued, then ends
        finally:
            self._abandon_jobs()
            await trio.aclose_forcefully(self.stream)

    def _abandon_jobs(self) -> None:
        for job in list(self.jobs.values()):
            if self._stopping:
                try:
                    self.out_send.send_nowait(_pack(rpc.error_response(
                        job.request_id, ErrorCode.CANCELLED, "the daemon is shutting down")))
                except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            self.daemon.abandon(job)

    async def deliver_tokens(self, job: Job, text: str, token_ids: list[int]) -> None:
        """The engine's chunk of ``job``: a token notification (raises if the client is gone)."""
        await self.out_send.send(_pack(rpc.token_notification(job.request_id, text, token_ids)))

    async def deliver_end(self, job: Job, error: tuple[ErrorCode, str] | None) -> None:
        """The engine is done with ``job``: its result, or the error that ended it."""
        await self.send(rpc.error_response(job.request_id, *error) if error is not None
                        else rpc.result_response(job.request_id, job.result()))

    async def send(self, message: Any) -> None:
        """Queue one message for the writer; drop it if the connection is gone."""
        try:
            data = _pack(message)
        except (TypeError, ValueError, OverflowError) as exc:
            log.exception("cannot pack a reply conn=%d", self.id)
            msgid = message[1] if message[0] == rpc.RESPONSE else None
            data = _pack(rpc.error_response(msgid, ErrorCode.INTERNAL, f"unpackable reply: {exc}"))
        try:
            await self.out_send.send(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def _write_loop(self, connection_scope: trio.CancelScope) -> None:
        stall = self.daemon.config.stall_timeout_s
        try:
            async with self._out_recv:
                async for data in self._out_recv:
                    with trio.move_on_after(stall) as timer:
                        await self.stream.send_all(data)
                    if timer.cancelled_caught:
                        log.warning("conn=%d closed: the client read nothing for %.1f s", self.id, stall)
                        break
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            log.debug("conn=%d: the client went away", self.id)
        connection_scope.cancel()

    async def _fatal(self, code: ErrorCode, message: str) -> None:
        self.daemon.counters["protocol_errors"] += 1
        log.warning("conn=%d closing: %s: %s", self.id, code, message)
        await self.send(rpc.error_response(None, code, message))

    async def _read_loop(self) -> None:
        """Decode messages and dispatch them until EOF or a fatal protocol error.

        Oversize guard: ``fed - start`` is the length of the message being
        assembled; input is fed only up to the limit, so a longer message is
        refused before more of it is buffered. Stall guard: a message must be
        complete ``stall_timeout_s`` after the read that began it. The deadline
        is fixed per message, not re-armed per read, so a client that trickles
        bytes cannot hold a connection open forever.
        """
        config = self.daemon.config
        limit = config.max_message_bytes
        container = min(limit, _MAX_CONTAINER_LEN)
        unpacker = msgpack.Unpacker(raw=False, use_list=False, strict_map_key=True,
                                    max_buffer_size=limit, max_array_len=container,
                                    max_map_len=container)
        fed = start = 0
        deadline, deadline_of = math.inf, -1  # deadline of the message that starts at deadline_of
        while True:
            if fed == start:
                deadline = math.inf
            elif deadline_of != start:
                deadline, deadline_of = trio.current_time() + config.stall_timeout_s, start
            data = None
            with trio.move_on_at(deadline):
                try:
                    data = await self.stream.receive_some(_RECEIVE_CHUNK)
                except trio.BrokenResourceError:  # reset: the client closed with replies unread
                    return
            if data is None:
                return await self._fatal(ErrorCode.INVALID_REQUEST,
                                         f"incomplete message: {fed - start} bytes, not complete "
                                         f"{config.stall_timeout_s} s after it began")
            if not data:
                return
            view = memoryview(data)
            while view:
                room = limit - (fed - start)
                if room <= 0:
                    return await self._fatal(ErrorCode.FRAME_TOO_LARGE,
                                             f"message longer than max_message_bytes ({limit})")
                piece, view = view[:room], view[room:]
                try:
                    unpacker.feed(piece)
                except msgpack.BufferFull:
                    return await self._fatal(ErrorCode.FRAME_TOO_LARGE,
                                             f"message longer than max_message_bytes ({limit})")
                fed += len(piece)
                while True:
                    try:
                        obj = next(unpacker)
                    except StopIteration:
                        break
                    except (ValueError, msgpack.UnpackException) as exc:
                        why = f"{type(exc).__name__} {exc}".rstrip()
                        return await self._fatal(ErrorCode.PARSE_ERROR, f"invalid msgpack: {why}")
                    start = unpacker.tell()
                    await self._dispatch(obj)

    async def _dispatch(self, obj: Any) -> None:
        counters = self.daemon.counters
        msgid = None
        try:
            message = rpc.parse_message(obj)
            if not isinstance(message, rpc.Request):
                if isinstance(message, rpc.Response):
                    counters["protocol_errors"] += 1
                log.debug("conn=%d ignoring %s", self.id, type(message).__name__)
                return
            msgid = message.msgid
            handler = self._handlers.get(message.method)
            if handler is None:
                raise RpcError(ErrorCode.METHOD_NOT_FOUND,
                               f"unknown method {message.method!r:.80}; methods: "
                               f"{', '.join(rpc.METHODS)}", msgid)
            result = await handler(message)
        except RpcError as exc:
            key = "rejected_busy" if exc.code == ErrorCode.BUSY else "rejected_invalid"
            counters[key] += 1
            await self.send(rpc.error_response(exc.msgid, exc.code, exc.message))
        except Exception as exc:  # the session boundary: reply, log, keep serving
            counters["internal_errors"] += 1
            log.exception("request failed conn=%d", self.id)
            await self.send(rpc.error_response(msgid, ErrorCode.INTERNAL,
                                               f"{type(exc).__name__}: {exc}"))
        else:
            if result is not None:
                await self.send(rpc.result_response(message.msgid, result))

    # Handlers return the result, or None when the reply comes later (generate).

    async def _hello(self, request: rpc.Request) -> dict:
        rpc.check_hello(request)
        return self.daemon.hello()

    async def _health(self, request: rpc.Request) -> dict:
        rpc.check_no_params(request)
        return self.daemon.health()

    async def _models(self, request: rpc.Request) -> dict:
        rpc.check_no_params(request)
        return self.daemon.description

    async def _generate(self, request: rpc.Request) -> None:
        daemon, msgid = self.daemon, request.msgid
        params = GenerateParams(**rpc.check_generate(
            request, max_tokens_limit=daemon.config.max_tokens, modes=daemon.modes))
        if msgid in self.jobs:
            raise RpcError(ErrorCode.INVALID_REQUEST,
                           f"msgid {msgid} is already in flight on this connection", msgid)
        daemon.admit(self, msgid, params)
        return None

    async def _cancel(self, request: rpc.Request) -> dict:
        request_id = rpc.check_request_id(request, required=True)
        job = self.jobs.get(request_id)
        if job is None:
            state = self.finished[request_id]["state"] if request_id in self.finished else "unknown"
            return {"request_id": request_id, "cancelled": False, "state": state}
        state = job.state
        if self.daemon.engine.withdraw(job):
            job.state, job.finish_reason = "cancelled", "cancelled"
            job.finished_at = trio.current_time()
            self.daemon.record_finished(job)
            await self.send(rpc.result_response(request_id, job.result()))
        else:
            job.scope.cancel()
        return {"request_id": request_id, "cancelled": True, "state": state}

    async def _stats(self, request: rpc.Request) -> dict:
        request_id = rpc.check_request_id(request, required=False)
        out = {"daemon": self.daemon.stats()}
        if request_id is not None:
            if request_id in self.jobs:
                out["request"] = self.jobs[request_id].record()
            elif request_id in self.finished:
                out["request"] = self.finished[request_id]
            else:
                raise RpcError(ErrorCode.INVALID_PARAMS,
                               f"request_id {request_id} is not a generate request of this "
                               f"connection (in flight or among its last {_FINISHED_KEPT})",
                               request.msgid)
        return out


# --- the daemon -------------------------------------------------------------------

class Daemon:
    """Shared state of one serving daemon: config, backend, engine, counters."""

    def __init__(self, config: ServeConfig, backend: Backend):
        self.config, self.backend = config, backend
        self.description = dict(backend.describe())
        self.context_length = int(self.description["context_length"])
        self.modes = tuple(self.description.get("modes") or ())
        self.engine = Engine(self)
        self.connections: set[Connection] = set()
        self.counters = dict.fromkeys(
            ("accepted", "completed", "cancelled", "failed", "rejected_busy", "rejected_invalid",
             "tokens_generated", "protocol_errors", "internal_errors", "connections_total"), 0)
        self.backend_totals = dict.fromkeys(_ADDITIVE_STATS, 0)
        self.stopping = False
        self.http: HttpFront | None = None
        self._started = trio.current_time()
        self._stop = trio.Event()
        self._idle = trio.Event()
        self.accept_scope = trio.CancelScope()

    def shutdown(self) -> None:
        """Begin a graceful shutdown (what SIGINT/SIGTERM do)."""
        self.stopping = True
        self._stop.set()

    def admit(self, owner: Any, request_id: int, params: GenerateParams, n_prompt: int | None = None) -> Job:
        """Queue a generation for ``owner`` (see :class:`Job`) and return its job; ``n_prompt`` is
        the prompt's token count when the caller already has it (tokenizing runs on the event loop).

        Raises:
            RpcError: ``cancelled`` while shutting down, ``invalid_params`` for messages the chat
                template refuses, ``context_overflow`` with both token counts, ``busy`` when the
                queue is full.
        """
        if self.stopping:
            raise RpcError(ErrorCode.CANCELLED, "the daemon is shutting down", request_id)
        if n_prompt is None:
            try:
                n_prompt = self.backend.count_prompt_tokens(params)
            except ValueError as exc:  # the chat template refused the messages: the caller's mistake
                raise RpcError(ErrorCode.INVALID_PARAMS, str(exc), request_id) from None
        if n_prompt + params.max_tokens > self.context_length:
            raise RpcError(ErrorCode.CONTEXT_OVERFLOW,
                           f"the prompt is {n_prompt} tokens and max_tokens is {params.max_tokens}, "
                           f"together more than context_length {self.context_length}", request_id)
        job = Job(owner, request_id, params, n_prompt)
        if not self.engine.submit(job):
            raise RpcError(ErrorCode.BUSY, f"{self.config.queue_depth} requests already wait "
                           f"in the queue; retry later", request_id)
        owner.jobs[request_id] = job
        self.counters["accepted"] += 1
        return job

    def abandon(self, job: Job) -> None:
        """Its client is gone: withdraw ``job`` if queued, else cancel it; send it nothing more."""
        job.abandoned = True
        if not self.engine.withdraw(job):
            job.scope.cancel()
        if job.state == "queued":
            job.state, job.finish_reason = "cancelled", "cancelled"
            job.finished_at = trio.current_time()
            self.record_finished(job)

    def record_finished(self, job: Job) -> None:
        job.conn.jobs.pop(job.request_id, None)
        finished = job.conn.finished
        finished[job.request_id] = job.record()
        while len(finished) > _FINISHED_KEPT:
            finished.popitem(last=False)
        self.counters[{"done": "completed", "cancelled": "cancelled"}.get(job.state, "failed")] += 1
        for key in _ADDITIVE_STATS:
            value = job.stats.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.backend_totals[key] += value

    async def accept(self, listener: trio.SocketListener, handler_nursery: trio.Nursery, *,
                     task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        """Accept connections until ``accept_scope`` is cancelled (closes the listener)."""
        with self.accept_scope:
            await trio.serve_listeners(self.handle_connection, [listener],
                                       handler_nursery=handler_nursery, task_status=task_status)

    async def handle_connection(self, stream: trio.SocketStream) -> None:
        self.counters["connections_total"] += 1
        conn = Connection(self, stream, self.counters["connections_total"])
        if self.stopping or len(self.connections) >= self.config.max_connections:
            code, why = ((ErrorCode.CANCELLED, "the daemon is shutting down") if self.stopping else
                         (ErrorCode.BUSY, f"too many connections (max {self.config.max_connections})"))
            with trio.move_on_after(1):
                try:
                    await stream.send_all(_pack(rpc.error_response(None, code, why)))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            await trio.aclose_forcefully(stream)
            return
        self.connections.add(conn)
        log.debug("conn=%d open", conn.id)
        try:
            await conn.run()
        except Exception:  # a bug in this connection's code must not stop the others
            self.counters["internal_errors"] += 1
            log.exception("conn=%d crashed", conn.id)
        finally:
            self.connections.discard(conn)
            if self.stopping and not self.connections:
                self._idle.set()
            log.debug("conn=%d closed", conn.id)

    def hello(self) -> dict:
        c = self.config
        return {"protocol": list(rpc.PROTOCOL_VERSION), "server": "lever-actors",
                "version": __version__, "pid": os.getpid(), "methods": list(rpc.METHODS),
                "capabilities": list(rpc.CAPABILITIES),
                "models": self.description.get("models", {}),
                "mode": self.description.get("mode"), "modes": list(self.modes),
                "http": "%s:%d" % self.http.address if self.http is not None else None,
                "limits": {"max_message_bytes": c.max_message_bytes, "queue_depth": c.queue_depth,
                           "max_tokens": c.max_tokens, "context_length": self.context_length,
                           "max_connections": c.max_connections,
                           "stall_timeout_s": c.stall_timeout_s}}

    def health(self) -> dict:
        return {"status": "stopping" if self.stopping else "ok", "pid": os.getpid(),
                "uptime_s": trio.current_time() - self._started,
                "queue_length": len(self.engine.waiting),
                "running": self.engine.running is not None,
                "connections_open": len(self.connections)}

    def stats(self) -> dict:
        c, totals = self.counters, dict(self.backend_totals)
        if totals["n_tokens"]:
            totals["flash_bytes_per_token"] = totals["flash_bytes_read"] / totals["n_tokens"]
        if totals["passes"]:
            totals["mean_accepted"] = totals["draft_n_accepted"] / totals["passes"]
        return {"uptime_s": trio.current_time() - self._started,
                "connections_open": len(self.connections),
                "connections_total": c["connections_total"],
                "queue_length": len(self.engine.waiting), "queue_depth": self.config.queue_depth,
                "running": self.engine.running is not None,
                "requests": {k: c[k] for k in ("accepted", "completed", "cancelled", "failed",
                                                "rejected_busy", "rejected_invalid")},
                "tokens_generated": c["tokens_generated"], "protocol_errors": c["protocol_errors"],
                "internal_errors": c["internal_errors"], "backend": totals,
                "pool": self.backend.pool_stats(), "peak_rss_bytes": peak_rss_or_none()}


async def serve(config: ServeConfig, backend: Backend, *, files: SocketFiles | None = None,
                task_status: trio.TaskStatus[Daemon] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``backend`` on ``config.socket`` until :meth:`Daemon.shutdown`.

    Starts with ``nursery.start(serve, ...)``, which returns the :class:`Daemon`
    once the listener is up and the status file written. A caller that already
    holds the lock passes ``files`` and releases them itself afterwards.

    Raises:
        DaemonAlreadyRunning: another daemon serves this socket.
        ConfigError: the socket's directory or path is unusable.
    """
    own_files = files is None
    if files is None:
        files = SocketFiles(config.socket)
        files.acquire()
    try:
        async with trio.open_nursery() as nursery:
            front = None
            if config.http is not None:  # up first, so /health can say "loading" meanwhile
                front = await nursery.start(HttpFront(config.http).serve)
            if callable(getattr(backend, "run", None)):
                await nursery.start(backend.run)  # the backend's own tasks, for the daemon's life
            daemon = Daemon(config, backend)
            daemon.http = front
            listener = files.open_listener()
            nursery.start_soon(daemon.engine.run)
            await nursery.start(daemon.accept, listener, nursery)
            if front is not None:
                front.daemon = daemon
            files.write_status({"http": "%s:%d" % front.address} if front is not None else None)
            log.info("listening socket=%s pid=%d queue_depth=%d", files.socket, os.getpid(),
                     config.queue_depth)
            task_status.started(daemon)
            await daemon._stop.wait()
            log.info("shutting down: %d connection(s), %d queued", len(daemon.connections),
                     len(daemon.engine.waiting))
            daemon.accept_scope.cancel()
            if front is not None:
                front.stop()
            for conn in list(daemon.connections):
                conn.stop()
            if daemon.connections:
                with trio.move_on_after(config.shutdown_grace_s):
                    await daemon._idle.wait()
            nursery.cancel_scope.cancel()
    finally:
        if own_files:
            files.release()


# --- the process boundary -------------------------------------------------------

def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``serve``'s options to ``parser`` (the CLI's ``serve`` subcommand)."""
    d = ServeConfig(socket=Path())
    parser.add_argument("--socket", type=Path, default=None,
                        help=f"Unix socket path (default: {default_socket_path()})")
    parser.add_argument("--queue-depth", type=int, default=d.queue_depth,
                        help="generate requests that may wait behind the running one; "
                             "more are refused with 'busy' (default: %(default)s)")
    parser.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes,
                        help="largest request message accepted (default: %(default)s)")
    parser.add_argument("--max-tokens-limit", type=int, default=d.max_tokens,
                        help="largest max_tokens a request may ask for (default: %(default)s)")
    parser.add_argument("--max-connections", type=int, default=d.max_connections,
                        help="connections served at once (default: %(default)s)")
    parser.add_argument("--stall-timeout", type=float, default=d.stall_timeout_s,
                        help="seconds a connection may leave a message half-sent or not read "
                             "its replies before it is closed (default: %(default)s)")
    parser.add_argument("--log-level", default="INFO",
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="daemon log level on stderr (default: %(default)s)")
    h = HttpConfig()
    web = parser.add_argument_group("HTTP (OpenAI-compatible API, off unless --http is given)")
    web.add_argument("--http", metavar="HOST:PORT", default=None,
                     help="also serve /v1/completions, /v1/chat/completions, /v1/models, /health "
                          "and /metrics on HOST:PORT, e.g. 127.0.0.1:8080 (a bare port binds "
                          "loopback only; 0 picks a free port, written to the status file)")
    web.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every route but /health "
                          "(default: $LEVER_API_KEY, else no key)")
    web.add_argument("--cors-origin", default=None,
                     help="allow browser pages from this origin ('*' = any); CORS is off without it")
    web.add_argument("--max-body-bytes", type=int, default=h.max_body_bytes,
                     help="largest request body, refused with 413 before it is read (default: %(default)s)")
    web.add_argument("--request-timeout", type=float, default=h.request_timeout_s,
                     help="seconds a request's head and body may take to arrive (default: %(default)s)")
    # Hidden: MODULE:FACTORY building the backend instead of make_backend (tests).
    parser.add_argument("--backend", default=None, help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Build and check a :class:`ServeConfig`.

    Raises:
        ConfigError: a value is out of range (the message names the option).
    """
    checks = (("--queue-depth", args.queue_depth, 0), ("--max-message-bytes", args.max_message_bytes, 64),
              ("--max-tokens-limit", args.max_tokens_limit, 1), ("--max-connections", args.max_connections, 1))
    for option, value, low in checks:
        if value < low:
            raise ConfigError(f"{option} must be at least {low}, got {value}")
    if not args.stall_timeout > 0:
        raise ConfigError(f"--stall-timeout must be positive, got {args.stall_timeout}")
    return ServeConfig(socket=Path(args.socket) if args.socket else default_socket_path(),
                       queue_depth=args.queue_depth, max_message_bytes=args.max_message_bytes,
                       max_tokens=args.max_tokens_limit, max_connections=args.max_connections,
                       stall_timeout_s=args.stall_timeout, http=http_config_from_args(args))


def http_config_from_args(args: argparse.Namespace) -> HttpConfig | None:
    """The HTTP face's config, or None without ``--http``.

    Raises:
        ConfigError: a bad address, body limit or timeout (the message names the option).
    """
    if not getattr(args, "http", None):
        return None
    try:
        host, port = parse_address(args.http)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.max_body_bytes < 64:
        raise ConfigError(f"--max-body-bytes must be at least 64, got {args.max_body_bytes}")
    if not args.request_timeout > 0:
        raise ConfigError(f"--request-timeout must be positive, got {args.request_timeout}")
    key = args.api_key if args.api_key is not None else os.environ.get("LEVER_API_KEY") or None
    return HttpConfig(host=host, port=port, api_key=key, cors_origin=args.cors_origin,
                      max_body_bytes=args.max_body_bytes, request_timeout_s=args.request_timeout,
                      keepalive_timeout_s=args.stall_timeout, max_connections=args.max_connections)


def load_backend_factory(spec: str) -> Callable[[argparse.Namespace], Backend]:
    """Resolve ``MODULE:FACTORY`` (``fake`` means ``fake_backend:make_backend``)."""
    if spec == "fake":
        spec = "fake_backend:make_backend"
    module_name, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr or "make_backend")
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--backend {spec}: {exc}") from None


async def _serve_until_signal(config: ServeConfig, backend: Backend, files: SocketFiles) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            daemon = await nursery.start(partial(serve, config, backend, files=files))

            async def watch() -> None:
                async for signum in signals:
                    log.info("received %s", signal.Signals(signum).name)
                    daemon.shutdown()
                    return

            nursery.start_soon(watch)


def serve_main(args: argparse.Namespace, make_backend: Callable[[argparse.Namespace], Backend]) -> int:
    """Run the daemon in the foreground until SIGINT/SIGTERM; return the exit status.

    Order: take the socket lock (refusing a second daemon before any model is
    loaded), call ``make_backend(args)`` once, listen, write the status file,
    serve. On a signal, in-flight requests are cancelled and the socket and
    status file removed. Exit status 0 after a clean shutdown, 1 when the daemon
    cannot start.
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(level=getattr(args, "log_level", "INFO"), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        config = config_from_args(args)
        files = SocketFiles(config.socket)
        files.acquire()
    except (ConfigError, DaemonAlreadyRunning, OSError) as exc:
        print(f"lever-actors serve: {exc}", file=sys.stderr)
        return 1
    try:
        factory = load_backend_factory(args.backend) if getattr(args, "backend", None) else make_backend
        backend = factory(args)
        trio.run(_serve_until_signal, config, backend, files)
    except (LeverError, BaseExceptionGroup) as exc:
        # a task's refusal (the HTTP port in use) reaches here inside trio's exception group
        found, other = (exc, None) if isinstance(exc, LeverError) else exc.split(LeverError)
        if found is None or other is not None:  # anything else is a defect: its traceback stays
            raise
        print(f"lever-actors serve: {first_leaf(found)}", file=sys.stderr)
        return 1
    finally:
        files.release()
    log.info("stopped")
    return 0


def _no_backend(args: argparse.Namespace) -> Backend:
    raise ConfigError("this entry point has no engine of its own: pass --backend MODULE:FACTORY "
                      "(or run `lever-actors serve`)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lever_actors.daemon",
        description="Run the lever-actors daemon in the foreground with a backend given as "
                    "--backend MODULE:FACTORY ('fake' = fake_backend:make_backend from tests/, "
                    "which must be on PYTHONPATH). `lever-actors serve` runs the real engine.")
    add_serve_arguments(parser)
    return serve_main(parser.parse_args(argv), _no_backend)


if __name__ == "__main__":
    # Run the imported module's main, so logger and class names are lever_actors.daemon's.
    from lever_actors.daemon import main as _main
    sys.exit(_main())

"""The daemon's HTTP face: OpenAI-compatible endpoints on h11, driven by trio streams.

h11 is a protocol-only HTTP/1.1 library: it parses and frames, we own every byte of I/O. That is
what lets this face keep the daemon's rules on trio without a second event loop: bounded head and
body sizes checked before anything is buffered, a deadline per request (slow clients are timed
out), and a watcher that reads the socket while a generation runs, so a client that disconnects
(mid-stream or still queued) cancels its job at once. The wire format lives in
``protocols/openai_http.py``; the engine, queue, cancellation and counters are the daemon's.

One :class:`HttpExchange` per request is the job's owner in the daemon's sense (see
``daemon.Job``): the engine hands it chunks through a bounded channel and the request's task turns
them into server-sent events or one JSON body.
"""
from __future__ import annotations

import hmac
from http import HTTPStatus
import json
import logging
import math
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from dataclasses import replace
from typing import Any

import h11
import trio

from lever_actors.backend import GenerateParams
from lever_actors.errors import ConfigError
from protocols import openai_http as api
from protocols.rpc import ErrorCode, RpcError

# Daemon and Job (lever_actors.daemon) are named in annotations only, never imported: the daemon
# imports this module.
log = logging.getLogger(__name__)

_RECEIVE_CHUNK = 65536
_EXCHANGE_DEPTH = 64  # engine chunks waiting for one request's writer
_RPC_STATUS = {ErrorCode.BUSY: 429, ErrorCode.CANCELLED: 503, ErrorCode.CONTEXT_OVERFLOW: 400,
               ErrorCode.INVALID_PARAMS: 400, ErrorCode.INTERNAL: 500, ErrorCode.IO_ERROR: 503,
               ErrorCode.MODEL_DAMAGED: 500}
_RPC_CODE = {ErrorCode.BUSY: "queue_full", ErrorCode.CANCELLED: "shutting_down",
             ErrorCode.CONTEXT_OVERFLOW: "context_length_exceeded",
             ErrorCode.INVALID_PARAMS: "invalid_value", ErrorCode.INTERNAL: "generation_failed",
             ErrorCode.IO_ERROR: "io_error", ErrorCode.MODEL_DAMAGED: "model_damaged"}


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    cors_origin: str | None = None
    max_body_bytes: int = 1 << 20
    max_header_bytes: int = 16384
    max_headers: int = 64
    request_timeout_s: float = 30.0    # a request's head and body must arrive within this
    keepalive_timeout_s: float = 30.0  # an idle connection is closed after this
    max_connections: int = 64


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` or ``PORT`` (loopback) for ``--http``; ValueError says what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--http {text!r}: expected HOST:PORT such as 127.0.0.1:8080")
    return host, int(port)


def model_ids(description: dict) -> tuple[str, ...]:
    """The names clients see in ``/v1/models``: the target (the servable model) first."""
    out = []
    for role in ("target", "draft"):
        model = (description.get("models") or {}).get(role)
        if isinstance(model, dict):
            out.append(str(model.get("name") or role))
        elif model:
            out.append(Path(str(model)).name)
    return tuple(out) or ("lever-actors",)


class HttpExchange:
    """One HTTP generate request as the owner of its job: the engine's chunks go into a channel."""

    def __init__(self, conn_id: int) -> None:
        self.id = conn_id
        self.jobs: dict[int, Job] = {}
        self.finished: OrderedDict[int, dict] = OrderedDict()
        self.send, self.receive = trio.open_memory_channel[tuple](_EXCHANGE_DEPTH)

    async def deliver_tokens(self, job: Job, text: str, token_ids: list[int]) -> None:
        await self.send.send(("tokens", text))

    async def deliver_end(self, job: Job, error: tuple[ErrorCode, str] | None) -> None:
        try:
            await self.send.send(("end", error))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


class ClientGone(Exception):
    """The client closed or reset its connection, or stopped reading."""


class HttpFront:
    """Serves the OpenAI endpoints for one daemon; ``daemon`` is None while the models load."""

    def __init__(self, config: HttpConfig) -> None:
        self.config = config
        self.daemon: Daemon | None = None
        self.connections: set[trio.CancelScope] = set()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.address: tuple[str, int] | None = None
        self._accept_scope = trio.CancelScope()
        self._ids = 0
        self._created = int(time.time())

    async def serve(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``config.host:port`` and serve until :meth:`stop`."""
        try:
            listeners = await trio.open_tcp_listeners(self.config.port, host=self.config.host)
        except OSError as exc:  # a port in use, a host not ours: one line naming the address
            raise ConfigError(f"--http cannot listen on {self.config.host}:{self.config.port}: "
                              f"{exc.strerror or exc}") from None
        self.address = listeners[0].socket.getsockname()[:2]
        log.info("http listening on %s:%d", *self.address)
        async with trio.open_nursery() as nursery:
            with self._accept_scope:
                await nursery.start(trio.serve_listeners, self._handle, listeners)
                task_status.started(self)
                await trio.sleep_forever()
            for scope in list(self.connections):
                scope.cancel()

    def stop(self) -> None:
        """Close the listener and cut every connection (their jobs are cancelled)."""
        self._accept_scope.cancel()
        for scope in list(self.connections):
            scope.cancel()

    async def _handle(self, stream: trio.SocketStream) -> None:
        self._ids += 1
        conn_id = self._ids  # this connection's, whatever later connections do to the counter
        if len(self.connections) >= self.config.max_connections:
            with trio.move_on_after(2):
                conn = _HttpConnection(self, stream, conn_id)
                await conn.send_error(api.ApiError(
                    503, f"too many connections (max {self.config.max_connections})",
                    code="too_many_connections", retry_after=1), close=True)
                await conn._linger()  # the request is unread: closing at once would reset the answer
            await trio.aclose_forcefully(stream)
            return
        with trio.CancelScope() as scope:
            self.connections.add(scope)
            try:
                await _HttpConnection(self, stream, conn_id).run()
            except ClientGone:
                log.debug("http conn=%d: the client went away", conn_id)
            except Exception:  # a bug in one connection must not stop the others
                log.exception("http conn crashed")
            finally:
                self.connections.discard(scope)
                await trio.aclose_forcefully(stream)

    # -- metrics ------------------------------------------------------------------------

    def metrics(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        return generate_latest(registry)


class _Collector:
    """Reads the daemon's counters at scrape time (nothing is counted twice)."""

    def __init__(self, front: HttpFront) -> None:
        self.front = front

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        d = self.front.daemon
        http = CounterMetricFamily("lever_http_requests", "HTTP requests answered",
                                   labels=["route", "status"])
        for (route, status), n in sorted(self.front.requests.items()):
            http.add_metric([route, str(status)], n)
        yield http
        if d is None:
            return
        stats = d.stats()
        requests = CounterMetricFamily("lever_requests", "generate requests by outcome",
                                       labels=["outcome"])
        for outcome, n in stats["requests"].items():
            requests.add_metric([outcome], n)
        yield requests
        backend = stats["backend"]
        for name, value, text in (
                ("lever_tokens_generated", stats["tokens_generated"], "tokens sent to clients"),
                ("lever_spec_decode_num_draft_tokens", backend["draft_n"], "draft tokens proposed"),
                ("lever_spec_decode_num_accepted_tokens", backend["draft_n_accepted"],
                 "draft tokens the target accepted"),
                ("lever_verify_passes", backend["passes"], "target verification passes"),
                ("lever_flash_read_bytes", backend["flash_bytes_read"], "bytes streamed from flash"),
                ("lever_pass_seconds", backend.get("pass_s", 0.0), "time in verification passes"),
                ("lever_flash_io_seconds", backend["io_s"], "time the flash lane was busy")):
            yield CounterMetricFamily(name, text, value=value)
        yield GaugeMetricFamily("lever_queue_length", "requests waiting", value=stats["queue_length"])
        yield GaugeMetricFamily("lever_queue_depth", "requests that may wait", value=stats["queue_depth"])
        yield GaugeMetricFamily("lever_requests_running", "requests generating", value=int(stats["running"]))
        if stats.get("peak_rss_bytes") is not None:  # what --dram-budget bounds
            yield GaugeMetricFamily("lever_peak_resident_bytes", "the daemon process's peak resident set (VmHWM)",
                                    value=stats["peak_rss_bytes"])


class _HttpConnection:
    """One client connection: requests in order (keep-alive), each answered before the next."""

    def __init__(self, front: HttpFront, stream: trio.SocketStream, conn_id: int) -> None:
        self.front, self.stream, self.id = front, stream, conn_id
        self.config = front.config
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self.config.max_header_bytes)
        self.origin: str | None = None
        self.began: float | None = None  # when the first bytes of the request being read arrived

    # -- reading ------------------------------------------------------------------------

    async def _next_event(self, deadline: float, *, head: bool = False) -> Any:
        """h11's next event, or None once ``deadline`` passes.

        ``head``: between requests, where ``deadline`` is the idle one. Once a request's first
        bytes arrive its deadline is ``request_timeout_s`` from then (:attr:`began`), and a head
        still incomplete at it is a 408, not an idle close.
        """
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = None
            with trio.move_on_at(deadline):
                try:
                    data = await self.stream.receive_some(_RECEIVE_CHUNK)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    raise ClientGone from None
            if data is None:
                if head and self.began is not None:
                    raise _request_timeout(self.config)
                return None
            if head and self.began is None and data:
                self.began = trio.current_time()
                deadline = self.began + self.config.request_timeout_s
            self.h11.receive_data(data)

    async def run(self) -> None:
        c = self.config
        while True:
            idle_deadline = trio.current_time() + c.keepalive_timeout_s
            self.began = None
            try:
                event = await self._next_event(idle_deadline, head=True)
                if event is None or isinstance(event, h11.ConnectionClosed):
                    return  # idle too long, or closed between requests: nothing to answer
                # a request sent early (pipelined) begins now, when it is read
                deadline = (self.began or trio.current_time()) + c.request_timeout_s
                body = await self._read_body(event, deadline)
            except h11.RemoteProtocolError as exc:
                status = exc.error_status_hint if exc.error_status_hint in (400, 413, 431) else 400
                await self.send_error(api.ApiError(status, f"malformed HTTP request: {exc}",
                                                   code="bad_http"), close=True)
                return await self._linger()
            except api.ApiError as exc:
                await self.send_error(exc, close=True)
                return await self._linger()
            await self._route(event, body)
            if self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
                return
            self.h11.start_next_cycle()

    async def _linger(self) -> None:
        """Close after an error without resetting: a close with unread input sends a TCP reset,
        which can destroy the error response before the client reads it. So: end our side, then
        discard what the client still sends, for a moment."""
        with trio.move_on_after(1.0):
            try:
                await self.stream.send_eof()
                while await self.stream.receive_some(_RECEIVE_CHUNK):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def _read_body(self, request: h11.Request, deadline: float) -> bytes:
        c = self.config
        if request.http_version not in (b"1.0", b"1.1"):
            raise api.ApiError(505, f"HTTP/{request.http_version.decode()} is not supported; "
                                    f"use HTTP/1.1", code="http_version")
        if len(request.headers) > c.max_headers:
            raise api.ApiError(431, f"more than {c.max_headers} headers", code="too_many_headers")
        # h11 bounds only a head still incomplete; one that arrived whole is measured here
        if sum(len(k) + len(v) + 4 for k, v in request.headers) > c.max_header_bytes:
            raise api.ApiError(431, f"headers over {c.max_header_bytes} bytes", code="headers_too_large")
        self.origin = _header(request, b"origin")
        length = _header(request, b"content-length")
        if length is not None and length.isdigit() and int(length) > c.max_body_bytes:
            raise api.ApiError(413, f"the body is {length} bytes; the limit is {c.max_body_bytes}",
                               code="body_too_large")
        if self.h11.they_are_waiting_for_100_continue:
            await self._send(h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue"))
        parts, size = [], 0
        while True:
            event = await self._next_event(deadline)
            if event is None:
                raise _request_timeout(c)
            if isinstance(event, h11.EndOfMessage):
                return b"".join(parts)
            if isinstance(event, h11.ConnectionClosed):
                raise ClientGone
            size += len(event.data)
            if size > c.max_body_bytes:
                raise api.ApiError(413, f"the body is over the limit of {c.max_body_bytes} bytes",
                                   code="body_too_large")
            parts.append(bytes(event.data))

    # -- writing ------------------------------------------------------------------------

    async def _send(self, event: Any) -> None:
        data = self.h11.send(event)
        if not data:
            return
        stall = self.front.daemon.config.stall_timeout_s if self.front.daemon else 30.0
        with trio.move_on_after(stall) as timer:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise ClientGone from None
        if timer.cancelled_caught:
            raise ClientGone

    def _headers(self, content_type: bytes, extra: list | None = None) -> list:
        headers = [(b"content-type", content_type), (b"server", b"lever-actors")]
        cors = self.config.cors_origin
        if cors and self.origin and (cors == "*" or self.origin == cors):
            headers.append((b"access-control-allow-origin", cors.encode()))
        return headers + (extra or [])

    async def send_json(self, status: int, body: Any, *, extra: list | None = None,
                        close: bool = False) -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        await self.send_body(status, data, b"application/json", extra=extra, close=close)

    async def send_body(self, status: int, data: bytes, content_type: bytes, *,
                        extra: list | None = None, close: bool = False) -> None:
        headers = self._headers(content_type, extra) + [(b"content-length", str(len(data)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            raise ClientGone  # a response already began; nothing sane can follow
        await self._send(h11.Response(status_code=status, headers=headers, reason=_reason(status)))
        await self._send(h11.Data(data=data))
        await self._send(h11.EndOfMessage())

    async def send_error(self, error: api.ApiError, *, close: bool = False) -> None:
        extra = [(b"retry-after", str(error.retry_after).encode())] if error.retry_after else None
        self.front.requests[("error", error.status)] += 1
        await self.send_json(error.status, error.body(), extra=extra, close=close)

    # -- routing ------------------------------------------------------------------------

    async def _route(self, request: h11.Request, body: bytes) -> None:
        method, path = request.method.decode(), request.target.decode("latin-1").split("?")[0]
        routes = {"/health": ("GET", self._health), "/metrics": ("GET", self._metrics),
                  "/v1/models": ("GET", self._models),
                  "/v1/completions": ("POST", self._completions),
                  "/v1/chat/completions": ("POST", self._chat)}
        try:
            if method == "OPTIONS" and self.config.cors_origin:
                return await self._preflight(path in routes)
            if path not in routes:
                raise api.ApiError(404, f"no route {method} {path[:200]}; routes: "
                                        f"{', '.join(routes)}", code="unknown_route")
            allowed, handler = routes[path]
            if method != allowed:
                raise api.ApiError(405, f"{path} takes {allowed}, not {method}", code="method_not_allowed")
            if path != "/health":
                self._authorize(request)
            status = await handler(body)
            self.front.requests[(path, status)] += 1
        except api.ApiError as exc:
            await self.send_error(exc)

    def _authorize(self, request: h11.Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = _header(request, b"authorization") or ""
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise api.ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                               code="invalid_api_key")

    async def _preflight(self, known: bool) -> None:
        extra = [(b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                 (b"access-control-allow-headers", b"authorization, content-type"),
                 (b"access-control-max-age", b"600")]
        await self.send_body(204 if known else 404, b"", b"text/plain", extra=extra)

    def _daemon(self) -> Daemon:
        d = self.front.daemon
        if d is None:
            raise api.ApiError(503, "the models are still loading", code="loading", retry_after=2)
        if d.stopping:
            raise api.ApiError(503, "the daemon is shutting down", code="shutting_down")
        return d

    async def _health(self, body: bytes) -> int:
        d = self.front.daemon
        if d is None or d.stopping:
            status = {"status": "loading" if d is None else "stopping"}
            await self.send_json(503, status, extra=[(b"retry-after", b"2")])
            return 503
        await self.send_json(200, {"status": "ok", "queue_length": len(d.engine.waiting),
                                   "running": d.engine.running is not None})
        return 200

    async def _metrics(self, body: bytes) -> int:
        await self.send_body(200, self.front.metrics(), b"text/plain; version=0.0.4; charset=utf-8")
        return 200

    async def _models(self, body: bytes) -> int:
        await self.send_json(200, api.models(model_ids(self._daemon().description), self.front._created))
        return 200

    async def _completions(self, body: bytes) -> int:
        return await self._generate(body, chat=False)

    async def _chat(self, body: bytes) -> int:
        return await self._generate(body, chat=True)

    # -- generation ---------------------------------------------------------------------

    def _admit(self, d: Daemon, req: api.CompletionRequest, exchange: HttpExchange) -> Job:
        params = GenerateParams(prompt=req.prompt, messages=req.messages, max_tokens=req.max_tokens or 1,
                                temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                stop=req.stop, mode=None, cache_prompt=req.cache_prompt)
        n_prompt = None
        try:
            if req.max_tokens is None:  # the API's default: whatever room the context leaves
                n_prompt = d.backend.count_prompt_tokens(params)
                params = replace(params, max_tokens=max(1, min(d.config.max_tokens, d.context_length - n_prompt)))
            return d.admit(exchange, 0, params, n_prompt)
        except RpcError as exc:
            d.counters["rejected_busy" if exc.code == ErrorCode.BUSY else "rejected_invalid"] += 1
            err = _api_error(exc.code, exc.message)
            if exc.code in (ErrorCode.CONTEXT_OVERFLOW, ErrorCode.INVALID_PARAMS):  # the input too long or refused
                err.param = "messages" if req.messages is not None else "prompt"
            raise err from None
        except ValueError as exc:  # the chat template refused the messages
            d.counters["rejected_invalid"] += 1
            raise api.ApiError(400, str(exc), param="messages", code="invalid_value") from None

    async def _generate(self, body: bytes, *, chat: bool) -> int:
        d = self._daemon()
        try:
            req = api.check_completion(body, chat=chat, model_ids=model_ids(d.description),
                                       max_tokens_limit=d.config.max_tokens)
        except api.ApiError:
            d.counters["rejected_invalid"] += 1
            raise
        exchange = HttpExchange(self.id)
        job = self._admit(d, req, exchange)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        failure: Exception | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, nursery.cancel_scope, job)
                try:
                    with exchange.receive:
                        if req.stream:
                            await self._stream(req, job, exchange, ident, created)
                        else:
                            await self._answer(req, job, exchange, ident, created)
                except (api.ApiError, ClientGone) as exc:  # raised past the nursery, not in a group
                    failure = exc
                nursery.cancel_scope.cancel()
        finally:
            if job.state in ("queued", "running"):
                d.abandon(job)
        if failure is not None:
            raise failure
        if self.h11.our_state is not h11.DONE:
            raise ClientGone  # the watcher saw the client leave
        return 200

    async def _watch_disconnect(self, scope: trio.CancelScope, job: Job) -> None:
        """While the job runs, a read that ends means the client left: cancel at once.

        A client that sends its next request early (pipelining) is not gone: the bytes are kept
        for h11, up to one request's limits. Past them this stops reading (TCP pushes back on the
        client) until the answer is sent; h11 only measures a request when it is parsed, after.
        A half-close counts as leaving, as for every HTTP server that streams.
        """
        kept, limit = 0, self.config.max_header_bytes + self.config.max_body_bytes
        while True:
            if kept > limit:
                await trio.sleep_forever()
            try:
                data = await self.stream.receive_some(_RECEIVE_CHUNK)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                # A client that read its whole answer closes at once, often before this exchange
                # has wound down (the job ended before its answer was sent): there is nothing to
                # cancel then, and the rest of the answer, if any, fails on its own as ClientGone.
                if job.state in ("queued", "running"):
                    log.info("http conn=%d: client disconnected; cancelling its request", self.id)
                    scope.cancel()
                return
            kept += len(data)
            try:
                self.h11.receive_data(data)
            except RuntimeError:  # h11 takes no more input after a close: treat as gone
                scope.cancel()
                return

    async def _events(self, exchange: HttpExchange):
        async for event in exchange.receive:
            yield event
            if event[0] == "end":
                return
        raise ClientGone  # the engine let go without an end: the daemon is shutting down

    async def _answer(self, req, job, exchange, ident, created) -> None:
        async for kind, value in self._events(exchange):
            if kind == "end":
                if value is not None:
                    raise _api_error(*value)
                result = job.result()
                await self.send_json(200, api.completion(
                    req, ident, created, result["text"], result["finish_reason"],
                    _usage(job), _timings(job)))

    async def _stream(self, req, job, exchange, ident, created) -> None:
        started = False
        async for kind, value in self._events(exchange):
            if kind == "end" and value is not None and not started:
                raise _api_error(*value)  # nothing sent yet: a proper status code
            if not started:
                started = True
                await self._send(h11.Response(status_code=200, reason=b"OK", headers=self._headers(
                    b"text/event-stream", [(b"cache-control", b"no-cache")])))
                if req.chat:
                    await self._send(h11.Data(data=api.sse(api.chunk(req, ident, created, text="", role=True))))
            if kind == "tokens":
                if value:
                    await self._send(h11.Data(data=api.sse(api.chunk(req, ident, created, text=value))))
                continue
            if value is not None:  # failed mid-stream: an error event, then the stream ends
                await self._send(h11.Data(data=api.sse(_api_error(*value).body())))
            else:
                await self._send(h11.Data(data=api.sse(api.chunk(
                    req, ident, created, finish_reason=job.finish_reason, timings_=_timings(job)))))
                if req.include_usage:
                    await self._send(h11.Data(data=api.sse(api.usage_chunk(req, ident, created, _usage(job)))))
            await self._send(h11.Data(data=api.SSE_DONE))
            await self._send(h11.EndOfMessage())


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def _header(request: h11.Request, name: bytes) -> str | None:
    for key, value in request.headers:
        if key == name:
            return value.decode("latin-1")
    return None


def _request_timeout(c: HttpConfig) -> api.ApiError:
    return api.ApiError(408, f"the request was not complete {c.request_timeout_s} s after it began",
                        code="request_timeout")


def _api_error(code: ErrorCode, message: str) -> api.ApiError:
    return api.ApiError(_RPC_STATUS.get(code, 500), message, code=_RPC_CODE.get(code),
                        retry_after=1 if code in (ErrorCode.BUSY, ErrorCode.IO_ERROR) else None)


def _usage(job: Job) -> dict:
    return api.usage(job.prompt_tokens, len(job.token_ids))


def _timings(job: Job) -> dict:
    t = job.timings()
    predicted_s = job.stats.get("decode_s")
    if not isinstance(predicted_s, (int, float)) or math.isnan(predicted_s):
        first = t["first_token_s"] if t["first_token_s"] is not None else t["total_s"]
        predicted_s = max(t["total_s"] - first, 0.0)
    prompt_s = max(t["generate_s"] - predicted_s, 0.0)
    prompt_n = job.stats.get("prompt_n", job.prompt_tokens)  # computed, not taken from the cache
    return api.timings(job.stats, prompt_n, len(job.token_ids), prompt_s, predicted_s)

"""Clients of the lever-actors daemon: async (trio), sync, and the CLI's ``generate``.

Layering: bytes on a trio Unix ``SocketStream``; msgpack values; msgpack-RPC
messages (``protocols.rpc``, which documents the protocol); then
:class:`Client`'s methods. :class:`SyncClient` wraps :class:`Client` with a trio
loop in a helper thread. This module also owns the daemon's file conventions
(default socket path, status file and its validation), which the daemon
imports. It must not import ``lever_actors.daemon``.
"""
from __future__ import annotations

import inspect
import json
import logging
import math
import os
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import trio

# The daemon's errors live in lever_actors.errors; they are imported here so that
# `from lever_actors.client import RemoteError` (and the others) keeps working.
from lever_actors.errors import (BadStatusFile, ConnectionLost, DaemonAlreadyRunning,  # noqa: F401
                                 DaemonNotRunning, LeverError, RemoteError)
from protocols import rpc

log = logging.getLogger(__name__)

SOCKET_NAME = "lever.sock"
STATUS_FIELDS = {"pid": int, "socket": str, "protocol": list, "version": str, "started_at": str}
_MAX_RECEIVE_BYTES = 64 << 20
_CLOSE_TIMEOUT_S = 5.0


# --- files: where the daemon lives, and whether it is alive -----------------------

def default_socket_dir() -> Path:
    """``$XDG_RUNTIME_DIR/lever-actors``, else ``<tmp>/lever-actors-<uid>``."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "lever-actors"
    return Path(tempfile.gettempdir()) / f"lever-actors-{os.getuid()}"


def default_socket_path() -> Path:
    return default_socket_dir() / SOCKET_NAME


def status_path_for(socket_path: Path) -> Path:
    """The status file next to a socket: ``lever.sock`` -> ``lever.json``."""
    return Path(socket_path).with_suffix(".json")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_status(path: Path) -> dict:
    """Read and validate a status file field by field.

    Raises:
        DaemonNotRunning: the file does not exist.
        BadStatusFile: unreadable, not JSON, or a field missing or of the wrong type.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DaemonNotRunning(f"no daemon status file at {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadStatusFile(f"cannot read status file {path}: {exc}") from None
    try:
        data = json.loads(text)
    except ValueError:
        raise BadStatusFile(f"invalid status file {path}: not JSON") from None
    if not isinstance(data, dict):
        raise BadStatusFile(f"invalid status file {path}: not a JSON object")
    for name, kind in STATUS_FIELDS.items():
        if name not in data:
            raise BadStatusFile(f"invalid status file {path}: no {name} field")
        value = data[name]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise BadStatusFile(f"invalid status file {path}: {name} is not a {kind.__name__}")
    if data["pid"] <= 0:
        raise BadStatusFile(f"invalid status file {path}: pid {data['pid']} is not positive")
    protocol = data["protocol"]
    if len(protocol) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in protocol):
        raise BadStatusFile(f"invalid status file {path}: protocol is not [major, minor]")
    return data


def check_status(path: Path) -> dict:
    """Like :func:`read_status`, and the pid must be alive.

    Raises:
        DaemonNotRunning: missing file, or "daemon has died" when the pid is gone.
        BadStatusFile: see :func:`read_status`.
    """
    data = read_status(path)
    if not pid_alive(data["pid"]):
        raise DaemonNotRunning(f"daemon has died (pid {data['pid']}); status file {path} is stale")
    return data


def diagnose_not_running(socket_path: Path) -> str:
    """Explain, from the status file, why nothing answers at ``socket_path``."""
    status = status_path_for(socket_path)
    try:
        data = check_status(status)
    except (DaemonNotRunning, BadStatusFile) as exc:
        return (f"no daemon is running at {socket_path}: {exc}; "
                f"start one with `lever-actors serve`")
    return (f"daemon pid {data['pid']} (status file {status}) is alive but does not "
            f"accept connections at {socket_path}")


async def connect_unix(socket_path: Path) -> trio.SocketStream:
    """Connect to the daemon, turning "nobody there" into :class:`DaemonNotRunning`."""
    try:
        return await trio.open_unix_socket(os.fspath(socket_path))
    except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
        raise DaemonNotRunning(diagnose_not_running(Path(socket_path))) from None
    except OSError as exc:
        raise DaemonNotRunning(f"cannot connect to {socket_path}: {exc}") from None


# --- the async client ---------------------------------------------------------------

@dataclass(frozen=True)
class Chunk:
    """One ``token`` notification: new text and the token ids that produced it."""

    text: str
    token_ids: list[int]


@dataclass
class GenerateResult:
    request_id: int
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int | None = None
    stats: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)

    @classmethod
    def from_wire(cls, result: dict) -> GenerateResult:
        return cls(request_id=result["request_id"], text=result["text"],
                   token_ids=list(result["token_ids"]), finish_reason=result["finish_reason"],
                   prompt_tokens=result.get("prompt_tokens"), stats=dict(result.get("stats") or {}),
                   timings=dict(result.get("timings") or {}))


class _Pending:
    __slots__ = ("event", "error", "result")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.error: BaseException | None = None
        self.result: Any = None


class GenerateStream:
    """Chunks of one generate request, then ``result`` (a :class:`GenerateResult`).

    Iterate with ``async for``; iteration ends when the final response arrives
    and raises :class:`RemoteError` if the request failed. Leaving early
    (``aclose`` or the ``async with`` block) cancels the request.
    """

    def __init__(self, client: Client, request_id: int):
        self.request_id = request_id
        self.result: GenerateResult | None = None
        self._client = client
        # Unbounded on purpose: one task reads every reply of the connection, so a stream its
        # caller does not read must not make it wait (every other call would wait behind it).
        # The daemon bounds a stream anyway: at most max_tokens chunks and one result.
        self._send, self._recv = trio.open_memory_channel[Any](math.inf)
        self._finished = False

    def _deliver(self, item: Any) -> None:
        try:
            self._send.send_nowait(item)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the consumer left; what it no longer wants is dropped

    def __aiter__(self) -> GenerateStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._finished:
            raise StopAsyncIteration
        try:
            item = await self._recv.receive()
        except trio.EndOfChannel:
            self._finished = True
            raise self._client._lost_error() from None
        if isinstance(item, Chunk):
            return item
        self._finished = True
        self._client._streams.pop(self.request_id, None)
        if isinstance(item, BaseException):
            raise item
        self.result = GenerateResult.from_wire(item)
        raise StopAsyncIteration

    async def cancel(self) -> None:
        """Ask the daemon to cancel; keep iterating to get the rest and the result."""
        await self._client._notify_cancel(self.request_id)

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            self._client._streams.pop(self.request_id, None)
            self._recv.close()
            if not self._client.closed:
                await self._client._notify_cancel(self.request_id)

    async def __aenter__(self) -> GenerateStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def _generate_params(prompt: str | None, messages: list[dict] | None, **options: Any) -> dict:
    params = {k: v for k, v in options.items() if v is not None}
    if prompt is not None:
        params["prompt"] = prompt
    if messages is not None:
        params["messages"] = messages
    if "stop" in params:
        params["stop"] = list(params["stop"])
    return params


class Client:
    """One connection to the daemon. Build it with :func:`open_client`.

    Several tasks may use one client at once; responses are matched by msgid.
    """

    def __init__(self, stream: trio.SocketStream, socket_path: Path):
        self.socket_path = socket_path
        self._stream = stream
        self._send_lock = trio.StrictFIFOLock()
        self._next_msgid = 0
        self._pending: dict[int, _Pending] = {}
        self._streams: dict[int, GenerateStream] = {}
        self._error: BaseException | None = None   # why the connection ended
        self._daemon_error: RemoteError | None = None  # an error sent with msgid nil

    @property
    def closed(self) -> bool:
        return self._error is not None

    def _lost_error(self) -> BaseException:
        return self._error or ConnectionLost(f"connection to {self.socket_path} closed")

    def _new_msgid(self) -> int:
        for _ in range(rpc.MAX_MSGID + 1):
            self._next_msgid = (self._next_msgid + 1) & rpc.MAX_MSGID
            if self._next_msgid not in self._pending and self._next_msgid not in self._streams:
                return self._next_msgid
        raise RuntimeError("no free msgid")  # 2**32 requests in flight: unreachable

    async def _send(self, message: list) -> None:
        if self._error is not None:
            raise self._error
        data = msgpack.packb(message, use_bin_type=True)
        async with self._send_lock:
            try:
                await self._stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self._fail(ConnectionLost(f"connection to {self.socket_path} broke: {exc}"))
                raise self._lost_error() from None
            except BaseException:
                # Interrupted mid-message: the byte stream can no longer be trusted.
                self._fail(ConnectionLost("a send was interrupted; connection closed"))
                await trio.aclose_forcefully(self._stream)
                raise

    async def call(self, method: str, params: dict | None = None) -> Any:
        """Send one request and wait for its result.

        Raises:
            RemoteError: the daemon answered with an error.
            ConnectionLost: the connection ended first.
        """
        msgid = self._new_msgid()
        pending = self._pending[msgid] = _Pending()
        try:
            await self._send(rpc.request_message(msgid, method, params))
            await pending.event.wait()
        finally:
            self._pending.pop(msgid, None)
        if pending.error is not None:
            raise pending.error
        return pending.result

    async def _notify_cancel(self, request_id: int) -> None:
        """Send ``cancel`` without waiting for its response."""
        if self._error is None:
            await self._send(rpc.request_message(self._new_msgid(), "cancel",
                                                 {"request_id": request_id}))

    async def hello(self, **params: Any) -> dict:
        return await self.call("hello", {"client_name": "lever_actors.client", **params})

    async def cancel(self, request_id: int) -> dict:
        return await self.call("cancel", {"request_id": request_id})

    async def stats(self, request_id: int | None = None) -> dict:
        return await self.call("stats", {} if request_id is None else {"request_id": request_id})

    async def health(self) -> dict:
        return await self.call("health")

    async def models(self) -> dict:
        return await self.call("models")

    async def start_stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                           **options: Any) -> GenerateStream:
        """Send a generate request; return its :class:`GenerateStream` (caller must aclose)."""
        msgid = self._new_msgid()
        stream = self._streams[msgid] = GenerateStream(self, msgid)
        try:
            await self._send(rpc.request_message(msgid, "generate",
                                                 _generate_params(prompt, messages, **options)))
        except BaseException:
            self._streams.pop(msgid, None)
            raise
        return stream

    @asynccontextmanager
    async def stream(self, prompt: str | None = None, **options: Any) -> AsyncIterator[GenerateStream]:
        """``async with client.stream(prompt, max_tokens=...) as s: async for chunk in s``."""
        s = await self.start_stream(prompt, **options)
        try:
            yield s
        finally:
            # Shielded so that leaving by cancellation still cancels on the daemon;
            # bounded so that a daemon that stopped reading cannot hold us here.
            with trio.CancelScope(deadline=trio.current_time() + _CLOSE_TIMEOUT_S, shield=True):
                await s.aclose()

    async def generate(self, prompt: str | None = None, *,
                       on_token: Callable[[str, list[int]], Any] | None = None,
                       **options: Any) -> GenerateResult:
        """Generate; call ``on_token(text, token_ids)`` (sync or async) per chunk.

        Options: messages, max_tokens, temperature, top_p, seed, stop, mode, cache_prompt.
        """
        async with self.stream(prompt, **options) as s:
            async for chunk in s:
                if on_token is not None:
                    ret = on_token(chunk.text, chunk.token_ids)
                    if inspect.isawaitable(ret):
                        await ret
        assert s.result is not None
        return s.result

    def _fail(self, error: BaseException) -> None:
        if self._error is not None:
            return
        self._error = self._daemon_error or error
        for pending in self._pending.values():
            pending.error = self._error
            pending.event.set()
        for s in self._streams.values():
            s._send.close()
        self._streams.clear()

    async def _receive_loop(self) -> None:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=_MAX_RECEIVE_BYTES)
        try:
            while True:
                data = await self._stream.receive_some(65536)
                if not data:
                    break
                unpacker.feed(data)
                for message in unpacker:
                    await self._on_message(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ValueError,
                msgpack.UnpackException) as exc:
            self._fail(ConnectionLost(f"connection to {self.socket_path} failed: {exc!r}"))
        self._fail(ConnectionLost(f"daemon at {self.socket_path} closed the connection"))

    async def _on_message(self, message: Any) -> None:
        try:
            parsed = rpc.parse_message(message)
        except rpc.RpcError:
            log.warning("ignoring malformed message from daemon: %.200r", message)
            return
        if isinstance(parsed, rpc.Response):
            error = RemoteError.from_wire(parsed.error) if parsed.error is not None else None
            if parsed.msgid is None and error is not None:
                self._daemon_error = error   # connection-level; the daemon closes next
                return
            if parsed.msgid in self._streams:
                self._streams[parsed.msgid]._deliver(error or parsed.result)
            elif parsed.msgid in self._pending:
                pending = self._pending[parsed.msgid]
                pending.error, pending.result = error, parsed.result
                pending.event.set()
        elif isinstance(parsed, rpc.Notification) and parsed.method == rpc.TOKEN_NOTIFICATION:
            if len(parsed.params) != 3 or parsed.params[0] not in self._streams:
                return
            request_id, text, token_ids = parsed.params
            self._streams[request_id]._deliver(Chunk(text, list(token_ids)))


def _only_exception(group: BaseExceptionGroup) -> BaseException:
    while isinstance(group, BaseExceptionGroup) and len(group.exceptions) == 1:
        group = group.exceptions[0]
    return group


@asynccontextmanager
async def open_client(socket_path: str | os.PathLike | None = None) -> AsyncIterator[Client]:
    """Connect to the daemon at ``socket_path`` (default: :func:`default_socket_path`).

    Raises:
        DaemonNotRunning: nothing answers there; the message explains why.
    """
    path = Path(socket_path) if socket_path is not None else default_socket_path()
    stream = await connect_unix(path)
    client = Client(stream, path)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client._receive_loop)
            try:
                yield client
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise _only_exception(group) from None
    finally:
        client._fail(ConnectionLost("client closed"))
        await trio.aclose_forcefully(stream)


# --- the sync wrapper ---------------------------------------------------------------

class SyncStream:
    """Blocking iterator over a :class:`GenerateStream`; ``result`` is set at the end."""

    def __init__(self, owner: SyncClient, stream: GenerateStream):
        self._owner, self._stream = owner, stream
        self.request_id = stream.request_id

    @property
    def result(self) -> GenerateResult | None:
        return self._stream.result

    def __iter__(self) -> Iterator[Chunk]:
        try:
            while True:
                try:
                    yield self._owner._run(self._stream.__anext__)
                except StopAsyncIteration:
                    return
        finally:
            self.close()

    def cancel(self) -> None:
        self._owner._run(self._stream.cancel)

    def close(self) -> None:
        self._owner._run(self._stream.aclose)


class SyncClient:
    """Blocking client: a :class:`Client` on a trio loop in a helper thread.

    Use as a context manager. Callbacks (``on_token``) run on the helper thread
    while the calling thread waits.
    """

    def __init__(self, socket_path: str | os.PathLike | None = None):
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._thread_main, args=(socket_path,),
                                        name="lever-actors-client", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    def _thread_main(self, socket_path: Any) -> None:
        try:
            trio.run(self._main, socket_path)
        except BaseException as exc:  # reported to the constructor's caller
            self._start_error = exc
        finally:
            self._ready.set()

    async def _main(self, socket_path: Any) -> None:
        self._stop = trio.Event()
        async with open_client(socket_path) as client:
            self._client = client
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()

    def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return trio.from_thread.run(partial(fn, *args, **kwargs), trio_token=self._token)

    def call(self, method: str, params: dict | None = None) -> Any:
        return self._run(self._client.call, method, params)

    def hello(self, **params: Any) -> dict:
        return self._run(self._client.hello, **params)

    def generate(self, prompt: str | None = None, **options: Any) -> GenerateResult:
        return self._run(self._client.generate, prompt, **options)

    def stream(self, prompt: str | None = None, **options: Any) -> SyncStream:
        return SyncStream(self, self._run(self._client.start_stream, prompt, **options))

    def cancel(self, request_id: int) -> dict:
        return self._run(self._client.cancel, request_id)

    def stats(self, request_id: int | None = None) -> dict:
        return self._run(self._client.stats, request_id)

    def health(self) -> dict:
        return self._run(self._client.health)

    def models(self) -> dict:
        return self._run(self._client.models)

    def close(self) -> None:
        if self._thread.is_alive():
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            self._thread.join()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# --- the CLI's `generate` against a running daemon -------------------------------------

def _params_from_args(args: Any) -> dict:
    prompt = getattr(args, "prompt", None)
    prompt_file = getattr(args, "prompt_file", None)
    if prompt_file:
        with open(prompt_file, encoding="utf-8") as f:
            prompt = f.read()
    elif prompt == "-":
        prompt = sys.stdin.read()
    messages = getattr(args, "messages", None)
    if getattr(args, "chat", False) and prompt is not None:
        prompt, messages = None, [{"role": "user", "content": prompt}]
    if prompt is None and messages is None:
        raise LeverError("no prompt: give PROMPT, '-' for standard input, or --prompt-file FILE")
    options = {name: getattr(args, name, None)
               for name in ("max_tokens", "temperature", "top_p", "seed", "stop", "mode")}
    return _generate_params(prompt, messages, **options)


def _socket_from_args(args: Any) -> Path | None:
    socket = getattr(args, "socket", None)
    return None if socket in (None, "auto") else Path(socket)


async def _generate_cli(socket_path: Any, params: dict, as_json: bool) -> GenerateResult:
    t0 = trio.current_time()
    first: list[float] = []

    def show(text: str, token_ids: list[int]) -> None:
        if not first:
            first.append(trio.current_time() - t0)
        if not as_json:
            sys.stdout.write(text)
            sys.stdout.flush()

    async with open_client(socket_path) as client:
        result = await client.generate(on_token=show, **params)
    result.timings["client_first_token_s"] = first[0] if first else None
    result.timings["client_total_s"] = trio.current_time() - t0
    return result


def generate_via_socket(args: Any) -> int:
    """Run ``lever-actors generate`` against a running daemon; return the exit status.

    Reads (each optional): ``args.socket`` (None or "auto": the default path),
    ``args.prompt`` ("-": stdin), ``args.prompt_file``, ``args.chat`` (send
    the prompt as one user message), ``args.messages`` (list of {role,
    content}), ``args.max_tokens``, ``args.temperature``, ``args.top_p``,
    ``args.seed``, ``args.stop`` (list of str), ``args.mode`` (None: the
    daemon's default) and ``args.json``. Prints text as it streams, or with
    ``--json`` one object at the end: text, token_ids, finish_reason,
    prompt_tokens, stats, timings, request_id (the protocol does not return
    prompt token ids) and peak_rss_bytes (the daemon's own, which
    ``--dram-budget`` bounds); without it, a summary line on stderr. Exit
    status: 0 done, 1 no daemon, bad input or request refused, 130
    interrupted.
    """
    as_json = bool(getattr(args, "json", False))
    try:
        params = _params_from_args(args)
        result = trio.run(_generate_cli, _socket_from_args(args), params, as_json)
    except RemoteError as exc:
        print(f"lever-actors: the daemon refused the request: [{exc.code}] {exc.message}",
              file=sys.stderr)
        return 1
    except (LeverError, OSError) as exc:  # DaemonNotRunning says why, e.g. "daemon has died"
        print(f"lever-actors: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    peak = result.stats.get("peak_rss_bytes")  # the daemon's, as a local generate reports its own
    if as_json:
        print(json.dumps({**asdict(result), "peak_rss_bytes": peak}, sort_keys=True))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        memory = "" if peak is None else f", the daemon's peak RSS {peak / 2**20:,.0f} MiB"
        print(f"[{len(result.token_ids)} tokens, finish: {result.finish_reason}{memory}]", file=sys.stderr)
    return 0

"""lever-actors daemon protocol, version 1.0: msgpack-RPC over a Unix socket.

This docstring is the protocol reference. The module also holds the pure
message checks both ends share. It imports only the standard library (no trio,
no msgpack, no lever_actors), so other clients can reuse it.

Transport
=========
``lever-actors serve`` listens on a Unix stream socket (mode 0600). By default
it is ``$XDG_RUNTIME_DIR/lever-actors/lever.sock`` in a private 0700
directory, or ``<tmp>/lever-actors-<uid>/lever.sock`` when XDG_RUNTIME_DIR is
unset; ``--socket PATH`` chooses another. Next to the socket,
``<socket minus suffix>.json`` is the status file:
``{"pid": int, "socket": str, "protocol": [1, 0], "version": str,
"started_at": str (ISO 8601, UTC)}``.

Messages are the published msgpack-RPC ones, packed back to back with no
length prefix (msgpack is self-delimiting)::

    request       [0, msgid, method, params]     client -> daemon
    response      [1, msgid, error, result]      daemon -> client
    notification  [2, method, params]            daemon -> client

* ``msgid`` is an unsigned 32-bit integer the client picks; the response
  carries the same one. Responses may come in any order.
* ``method`` is a string (a bin holding UTF-8 is accepted as well).
* ``params`` is an array holding one map of named parameters, ``[{...}]``.
  ``[]`` means an empty map. Unknown names are an ``invalid_params`` error.
* Exactly one of ``error`` and ``result`` is nil. ``error`` is a map
  ``{"code": str, "message": str, "retryable": bool}``.
* Notifications and responses sent *to* the daemon are ignored (no reply).
* Strings are UTF-8 msgpack str; maps have string keys. Floats may be sent
  as integers.

Limits and the oversize guard
-----------------------------
A message may be at most ``max_message_bytes`` long (default 1 MiB;
``hello`` reports it). The daemon counts the bytes of the message it is
assembling and refuses it as soon as that count passes the limit, before
buffering more: it replies ``frame_too_large`` (msgid nil) and closes the
connection. Bytes that are not msgpack get ``parse_error`` (msgid nil) and the
connection is closed, since the stream cannot be resynchronized. A message
that is still incomplete ``stall_timeout_s`` (default 30 s) after its first
bytes arrived gets ``invalid_request`` (msgid nil) and the connection is
closed, however the bytes trickle in; so is a connection that reads none of
its replies for ``stall_timeout_s``. A well-formed msgpack value that is not a
valid request gets ``invalid_request`` (its msgid when one can be read, else
nil) and the connection stays open. An idle connection is never timed out. At
most ``max_connections`` are served at once; one more gets ``busy`` (msgid
nil) and is closed. End-of-file from the client, or a reset (it closed with
replies unread), counts as a disconnect; a message left incomplete at that
point gets no reply.

Methods
=======
``hello`` {client_name?: str, client_version?: str, protocol?: [int, int]}
    Optional handshake. A different major ``protocol`` is ``invalid_params``.
    Result: ``{"protocol": [1, 0], "server": "lever-actors", "version": str,
    "pid": int, "methods": [str], "capabilities": [str], "models": map,
    "mode": str, "modes": [str], "http": "HOST:PORT" | nil, "limits":
    {"max_message_bytes": int, "queue_depth": int, "max_tokens": int,
    "context_length": int, "max_connections": int, "stall_timeout_s": float}}``.
    ``http`` is where the same daemon serves the OpenAI-compatible HTTP API
    (``protocols/openai_http.py``), nil when it does not. ``context_length``
    is what one request may use, prompt tokens plus ``max_tokens``: the
    pipeline's context less the KV slots a verification pass's tree takes.

``generate`` {prompt?: str, messages?: [{role: str, content: str}],
max_tokens?: int = 128, temperature?: float = 0.0, top_p?: float = 1.0,
seed?: int | nil, stop?: [str] = [], mode?: str | nil, cache_prompt?: bool = true}
    Exactly one of ``prompt`` (non-empty) and ``messages`` (1 to 1024
    entries; ``role`` one of system, user, assistant) is required. Ranges: ``1 <= max_tokens <=
    limits.max_tokens``; ``0 <= temperature <= 2``; ``0 < top_p <= 1``;
    ``0 <= seed < 2**64`` (a sampled request without one gets a fresh
    random seed; greedy ignores it); at most 16 ``stop`` strings of 1 to 256
    characters; ``mode`` one of ``hello``'s ``modes``; or a bare name among
    them followed by ``:PARAM`` for the backend (``flash-chain:8``); or the
    bare name of one of them, which runs that one (``lever`` for a daemon
    whose ``modes`` are ``["lever:32"]``). If the prompt's
    token count plus ``max_tokens`` exceeds ``limits.context_length`` the
    answer is ``context_overflow``. The request is queued FIFO (one
    generation runs at a time); when ``queue_depth`` requests already wait,
    the answer is ``busy``. While it runs the daemon sends notifications::

        [2, "token", [request_id, text, token_ids]]

    where ``request_id`` is the msgid of the generate request, ``text`` is
    the new text and ``token_ids`` the new token ids. Either may be empty
    (text of a character split across tokens is held back until complete),
    never both. The chunks come in order; their concatenation is the final
    text and token list. A stop string ends the text where it begins and the
    token list with the token that completes it, however many tokens the
    backend decoded at once (greedy answers are the same, id for id, in every
    mode). Then the response: ``{"request_id": int, "text": str,
    "token_ids": [int], "finish_reason": "stop" | "length" | "cancelled",
    "prompt_tokens": int, "stats": map, "timings": map}``. ``stats`` holds
    the backend's ``draft_n``, ``draft_n_accepted``, ``mean_accepted``,
    ``passes``, ``flash_bytes_read``, ``flash_bytes_per_token``, ``io_s``,
    ``compute_s``, ``n_tokens``, ``cache_n`` (prompt tokens whose KV rows were
    reused from an earlier request: a conversation's earlier turns, from the
    live rows or the prompt cache's copies), ``prompt_n`` (prompt tokens
    computed), ``ttft_s`` and ``prompt_cache_bytes`` (what the copies hold
    now), and for a sampled request ``seed`` (the one given, or the one drawn
    for a request without one: asking again with it gives the same text) (a
    backend may omit or add keys); to a completed request's stats the daemon
    adds ``peak_rss_bytes``, its own process's peak resident set so far
    (``VmHWM``, what ``--dram-budget`` bounds; absent where ``/proc`` does not
    say). ``cache_prompt: false`` computes the whole prompt; the
    output is the same either way.
    ``timings`` holds ``queue_s``, ``first_token_s`` (nil if none),
    ``generate_s`` and ``total_s``, measured from receipt. A cancelled
    request still gets this response, with ``finish_reason`` "cancelled"
    and the text streamed before the cancel. If the client disconnects,
    its requests are cancelled and nothing more is sent.

``cancel`` {request_id: int}
    Cancels a generate request of this connection (queued or running).
    Result: ``{"request_id": int, "cancelled": bool, "state": str}``;
    ``cancelled`` is false and ``state`` is "done" or "unknown" when there
    was nothing to cancel (not an error: the race is normal).

``stats`` {request_id?: int}
    Without ``request_id``: ``{"daemon": map}`` with ``uptime_s``,
    ``connections_open``, ``connections_total``, ``queue_length``,
    ``queue_depth``, ``running`` (bool), ``requests`` {accepted, completed,
    cancelled, failed, rejected_busy, rejected_invalid},
    ``tokens_generated``, ``protocol_errors``, ``internal_errors``,
    ``backend`` (sums of the additive backend stats, with
    ``flash_bytes_per_token`` and ``mean_accepted`` derived from them),
    ``pool`` (the backend's buffer accounting) and ``peak_rss_bytes`` (as in
    a generate response's stats; nil where ``/proc`` does not say). With a
    ``request_id`` of this connection (in flight or among its last 256
    finished): also ``"request": {request_id, state, prompt_tokens,
    n_tokens, max_tokens, finish_reason, stats, timings}``, ``state`` being
    "queued", "running", "done", "cancelled" or "failed". An unknown id is
    ``invalid_params``.

``health`` {}
    ``{"status": "ok" | "stopping", "pid": int, "uptime_s": float,
    "queue_length": int, "running": bool, "connections_open": int}``.

``models`` {}
    The backend's description: ``{"models": map, "mode": str,
    "modes": [str], "context_length": int, "dram_budget_bytes": int | nil,
    ...}``.

Error codes (stable; adding one is a minor version, renaming a major one)
========================================================================
=================  =========  ==================================================
code               retryable  meaning
=================  =========  ==================================================
parse_error        no         bytes are not msgpack; connection closed
invalid_request    no         not a msgpack-RPC request, duplicate in-flight
                              msgid, or message stalled; see above
method_not_found   no         unknown method
invalid_params     no         a parameter is missing, unknown, of the wrong type
                              or out of range (also a mode parameter the backend
                              rejects); the message names it
frame_too_large    no         message longer than max_message_bytes; closed
busy               yes        the generate queue is full, or too many
                              connections (then the connection is closed)
cancelled          yes        the daemon is shutting down
context_overflow   no         prompt tokens + max_tokens > context_length
internal           no         a daemon or backend failure (logged with a
                              traceback); the daemon keeps serving
io_error           yes        reading the streamed weights failed after retries
                              (the message names the file and region); the
                              daemon keeps serving
model_damaged      no         streamed weights are not the bytes the bundle
                              recorded, or a file (the target's or the draft's)
                              changed under the daemon; every request that
                              reads the damage fails so until it is fixed
=================  =========  ==================================================

Example exchange (msgpack shown as JSON)
========================================
::

    -> [0, 1, "hello", [{"client_name": "demo"}]]
    <- [1, 1, null, {"protocol": [1, 0], "server": "lever-actors", ...}]
    -> [0, 2, "generate", [{"prompt": "def add(a, b):", "max_tokens": 3}]]
    <- [2, "token", [2, "\\n    return", [198, 262]]]
    <- [2, "token", [2, " a", [264]]]
    <- [1, 2, null, {"request_id": 2, "text": "\\n    return a",
                     "token_ids": [198, 262, 264], "finish_reason": "length",
                     "prompt_tokens": 5, "stats": {...}, "timings": {...}}]
    -> [0, 3, "generate", [{"prompt": "x", "max_tokens": 0}]]
    <- [1, 3, {"code": "invalid_params", "retryable": false,
               "message": "max_tokens must be between 1 and 4096, got 0"}, null]
    -> [0, 4, "generate", [{"prompt": "long", "max_tokens": 1000}]]
    <- [2, "token", [4, "def", [750]]]
    -> [0, 5, "cancel", [{"request_id": 4}]]
    <- [1, 5, null, {"request_id": 4, "cancelled": true, "state": "running"}]
    <- [1, 4, null, {"request_id": 4, "text": "def", "token_ids": [750],
                     "finish_reason": "cancelled", ...}]
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

PROTOCOL_VERSION = (1, 0)
REQUEST, RESPONSE, NOTIFICATION = 0, 1, 2
MAX_MSGID = 2**32 - 1
TOKEN_NOTIFICATION = "token"
METHODS = ("hello", "generate", "cancel", "stats", "health", "models")
CAPABILITIES = ("stream", "cancel", "chat", "stats")

DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
DEFAULT_MAX_TOKENS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
MAX_SEED = 2**64 - 1
MAX_TEMPERATURE = 2.0


class ErrorCode(StrEnum):
    """Stable wire values of the ``code`` field of an error map."""

    PARSE_ERROR = "parse_error"
    INVALID_REQUEST = "invalid_request"
    METHOD_NOT_FOUND = "method_not_found"
    INVALID_PARAMS = "invalid_params"
    FRAME_TOO_LARGE = "frame_too_large"
    BUSY = "busy"
    CANCELLED = "cancelled"
    CONTEXT_OVERFLOW = "context_overflow"
    INTERNAL = "internal"
    IO_ERROR = "io_error"
    MODEL_DAMAGED = "model_damaged"


RETRYABLE = frozenset({ErrorCode.BUSY, ErrorCode.CANCELLED, ErrorCode.IO_ERROR})


class RpcError(Exception):
    """A request the daemon refuses; becomes an error response.

    Attributes:
        code: the :class:`ErrorCode`.
        message: human-readable reason naming the offending field.
        msgid: the request's msgid when known, else None (sent as nil).
    """

    def __init__(self, code: ErrorCode, message: str, msgid: int | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.msgid = msgid


def error_value(code: ErrorCode, message: str) -> dict:
    """Build the error map of a response."""
    return {"code": str(code), "message": message, "retryable": code in RETRYABLE}


def error_response(msgid: int | None, code: ErrorCode, message: str) -> list:
    return [RESPONSE, msgid, error_value(code, message), None]


def result_response(msgid: int, result: Any) -> list:
    return [RESPONSE, msgid, None, result]


def request_message(msgid: int, method: str, params: dict | None = None) -> list:
    return [REQUEST, msgid, method, [params or {}]]


def token_notification(request_id: int, text: str, token_ids: list[int]) -> list:
    return [NOTIFICATION, TOKEN_NOTIFICATION, [request_id, text, token_ids]]


@dataclass(frozen=True, slots=True)
class Request:
    msgid: int
    method: str
    params: Any  # the raw params array; see named_params()


@dataclass(frozen=True, slots=True)
class Response:
    msgid: Any
    error: Any
    result: Any


@dataclass(frozen=True, slots=True)
class Notification:
    method: str
    params: Any


def _type_name(value: Any) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str", bytes: "bin",
            list: "array", tuple: "array", dict: "map", type(None): "nil"}.get(
                type(value), type(value).__name__)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _method_name(value: Any, msgid: int | None) -> str:
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise RpcError(ErrorCode.INVALID_REQUEST, "method is not UTF-8", msgid) from None
    if not isinstance(value, str):
        raise RpcError(ErrorCode.INVALID_REQUEST,
                       f"method must be a string, got {_type_name(value)}", msgid)
    return value


def parse_message(obj: Any) -> Request | Response | Notification:
    """Classify one decoded msgpack value as a msgpack-RPC message.

    Raises:
        RpcError: ``invalid_request``, with the msgid when it could be read.
    """
    if not isinstance(obj, (list, tuple)):
        raise RpcError(ErrorCode.INVALID_REQUEST,
                       f"a message must be an array, got {_type_name(obj)}")
    if not obj or not _is_int(obj[0]) or obj[0] not in (REQUEST, RESPONSE, NOTIFICATION):
        kind = obj[0] if obj and _is_int(obj[0]) else _type_name(obj[0]) if obj else "nothing"
        raise RpcError(ErrorCode.INVALID_REQUEST,
                       f"message type must be 0 (request), 1 or 2, got {kind}")
    kind, n = obj[0], len(obj)
    if kind == NOTIFICATION:
        if n != 3 or not isinstance(obj[2], (list, tuple)):
            raise RpcError(ErrorCode.INVALID_REQUEST,
                           "a notification is [2, method, params]")
        return Notification(_method_name(obj[1], None), obj[2])
    if n != 4:
        raise RpcError(ErrorCode.INVALID_REQUEST,
                       f"a {'request' if kind == REQUEST else 'response'} has 4 elements, got {n}")
    if kind == RESPONSE:
        return Response(obj[1], obj[2], obj[3])
    msgid = obj[1]
    if not _is_int(msgid) or not 0 <= msgid <= MAX_MSGID:
        raise RpcError(ErrorCode.INVALID_REQUEST,
                       f"msgid must be an unsigned 32-bit integer, got {msgid!r:.40}")
    method = _method_name(obj[2], msgid)
    if not isinstance(obj[3], (list, tuple)):
        raise RpcError(ErrorCode.INVALID_REQUEST,
                       f"params must be an array, got {_type_name(obj[3])}", msgid)
    return Request(msgid, method, obj[3])


class _Params:
    """Takes named parameters out of one request's map, validating each."""

    def __init__(self, method: str, params: Any, msgid: int):
        self.method, self.msgid = method, msgid
        if len(params) == 0:
            params = [{}]
        if len(params) != 1 or not isinstance(params[0], dict):
            raise self.error(f"{method} takes one map of named parameters, "
                             f"params = [{{...}}]; got {len(params)} positional value(s)")
        self.raw: dict = params[0]
        self.seen: set[str] = set()

    def error(self, message: str) -> RpcError:
        return RpcError(ErrorCode.INVALID_PARAMS, message, self.msgid)

    def get(self, name: str, default: Any = None) -> Any:
        self.seen.add(name)
        return self.raw.get(name, default)

    def integer(self, name: str, default: Any, lo: int, hi: int, *, nil_ok: bool = False) -> Any:
        value = self.get(name, default)
        if value is None and nil_ok:
            return None
        if not _is_int(value):
            raise self.error(f"{name} must be an integer, got {_type_name(value)}")
        if not lo <= value <= hi:
            raise self.error(f"{name} must be between {lo} and {hi}, got {value}")
        return value

    def number(self, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
        value = self.get(name, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.error(f"{name} must be a number, got {_type_name(value)}")
        value = float(value)
        if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
            low = f"greater than {lo}" if lo_open else f"at least {lo}"
            raise self.error(f"{name} must be {low} and at most {hi}, got {value}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise self.error(f"{name} must be true or false, got {_type_name(value)}")
        return value

    def string(self, name: str) -> str | None:
        value = self.get(name)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.error(f"{name} must be a string, got {_type_name(value)}")
        return value

    def done(self) -> None:
        unknown = sorted(repr(k) if not isinstance(k, str) else k for k in self.raw if k not in self.seen)
        if unknown:
            known = ", ".join(sorted(self.seen)) or "none"
            raise self.error(f"unknown parameter(s) for {self.method}: "
                             f"{', '.join(unknown)} (known: {known})")


def check_no_params(request: Request) -> None:
    """Validate ``health``/``models`` style requests, which take no parameters."""
    _Params(request.method, request.params, request.msgid).done()


def check_hello(request: Request) -> dict:
    p = _Params("hello", request.params, request.msgid)
    out = {"client_name": p.string("client_name"), "client_version": p.string("client_version")}
    protocol = p.get("protocol")
    if protocol is not None:
        if (not isinstance(protocol, (list, tuple)) or len(protocol) != 2
                or not all(_is_int(x) for x in protocol)):
            raise p.error("protocol must be [major, minor] integers")
        if protocol[0] != PROTOCOL_VERSION[0]:
            raise p.error(f"protocol major {protocol[0]} is not supported; this daemon "
                          f"speaks {PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}")
    p.done()
    return out


def check_request_id(request: Request, *, required: bool) -> int | None:
    """Validate ``cancel`` ({request_id}) and ``stats`` ({request_id?})."""
    p = _Params(request.method, request.params, request.msgid)
    if required and "request_id" not in p.raw:
        raise p.error(f"{request.method} needs request_id (the msgid of a generate request)")
    value = p.integer("request_id", None, 0, MAX_MSGID, nil_ok=not required)
    p.done()
    return value


CHAT_ROLES = ("system", "user", "assistant")  # what the chat template renders


def _check_messages(p: _Params, value: Any) -> list[dict]:
    if not isinstance(value, (list, tuple)) or not 1 <= len(value) <= MAX_MESSAGES:
        raise p.error(f"messages must be an array of 1 to {MAX_MESSAGES} maps")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise p.error(f"messages[{i}] must be a map with exactly role and content")
        if m["role"] not in CHAT_ROLES:
            raise p.error(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m['role']!r}")
        if not isinstance(m["content"], str):
            raise p.error(f"messages[{i}].content must be a string")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _mode_name(mode: str) -> str:
    """'lever:32+no-prune' -> 'lever': the mode without its parameter and flags."""
    return mode.partition(":")[0].partition("+")[0]


def _daemon_mode(p: _Params, mode: str, modes: tuple[str, ...]) -> str:
    """The mode a generate request runs in: one of ``modes`` exactly; a bare name in ``modes`` with a
    parameter for the backend (``flash-chain:4`` where ``flash-chain`` is offered); or the bare name
    of an offered mode (``lever`` where the daemon runs ``lever:32``), which becomes that mode: a
    client that names the mode without the daemon's parameter asks for the mode it is running."""
    if mode in modes or mode.partition(":")[0] in modes:
        return mode
    if mode == _mode_name(mode):
        for offered in modes:
            if _mode_name(offered) == mode:
                return offered
    raise p.error(f"mode must be one of {', '.join(modes) or '(none)'}, got {mode!r}")


def check_generate(request: Request, *, max_tokens_limit: int, modes: tuple[str, ...]) -> dict:
    """Validate a ``generate`` request.

    Returns:
        the normalized fields of ``lever_actors.backend.GenerateParams``.

    Raises:
        RpcError: ``invalid_params`` naming the first bad parameter.
    """
    p = _Params("generate", request.params, request.msgid)
    prompt = p.string("prompt")
    messages = p.get("messages")
    if (prompt is None) == (messages is None):
        raise p.error("generate needs exactly one of prompt and messages")
    if prompt is not None and not prompt:
        raise p.error("prompt must not be empty")
    if messages is not None:
        messages = _check_messages(p, messages)
    stop = p.get("stop", ())
    if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP_STRINGS:
        raise p.error(f"stop must be an array of at most {MAX_STOP_STRINGS} strings")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
            raise p.error(f"stop[{i}] must be a string of 1 to {MAX_STOP_CHARS} characters")
    mode = p.string("mode")
    if mode is not None:
        mode = _daemon_mode(p, mode, modes)
    out = {
        "prompt": prompt,
        "messages": messages,
        "max_tokens": p.integer("max_tokens", min(DEFAULT_MAX_TOKENS, max_tokens_limit), 1, max_tokens_limit),
        "temperature": p.number("temperature", 0.0, 0.0, MAX_TEMPERATURE),
        "top_p": p.number("top_p", 1.0, 0.0, 1.0, lo_open=True),
        "seed": p.integer("seed", None, 0, MAX_SEED, nil_ok=True),
        "stop": tuple(stop),
        "mode": mode,
        "cache_prompt": p.boolean("cache_prompt", True),
    }
    p.done()
    return out

"""The daemon's HTTP face: the OpenAI completions API as llama.cpp's server speaks it.

Served by ``lever-actors serve --http HOST:PORT`` next to the msgpack-RPC socket (``rpc``), from
the same engine and the same FIFO queue. This module is the wire format only: it checks request
bodies and shapes response bodies, with no I/O. Version: :data:`API_VERSION`.

Endpoints
---------
``POST /v1/completions``       body ``{"prompt": str, ...}``
``POST /v1/chat/completions``  body ``{"messages": [{"role", "content"}, ...], ...}``
    Shared fields: ``model`` (optional; must name the target), ``max_tokens`` (chat also takes
    ``max_completion_tokens``), ``temperature`` (0 = greedy), ``top_p``, ``seed`` (the same seed
    gives the same text in every mode that samples coupled, the default; without one a sampled request draws a
    fresh seed, as OpenAI's API does), ``stop`` (a
    string or up to 16 strings, never part of the output), ``stream``,
    ``stream_options.include_usage``, ``cache_prompt`` (llama.cpp's: default true, reuse the KV
    rows of the prefix shared with the previous request). Without ``stream`` the answer is one
    JSON object::

        {"id", "object": "text_completion" | "chat.completion", "created", "model",
         "choices": [{"index": 0, "text" | "message": {"role": "assistant", "content"},
                      "finish_reason": "stop" | "length", "logprobs": null}],
         "usage": {"prompt_tokens", "completion_tokens", "total_tokens"},
         "timings": {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms",
                     "predicted_per_second", "draft_n", "draft_n_accepted",
                     "cache_n", "passes", "mean_accepted", "flash_bytes_per_token",
                     "seed"}}

    ``timings.seed`` is the seed a sampled request drew from: its own, or the fresh one drawn
    for a request that named none. Sent back as ``seed``, it gives the same text again (null
    for greedy requests).

    With ``stream`` it is server-sent events, ``data: {chunk}\\n\\n`` each, then
    ``data: [DONE]\\n\\n``. Chunks are ``text_completion`` / ``chat.completion.chunk`` objects
    with one choice each; the first chat chunk's delta carries ``role``, text chunks carry
    ``text`` / ``delta.content`` (whole UTF-8 characters, and never text that could still turn
    into a stop string), the last choice chunk carries ``finish_reason`` and ``timings``. With
    ``include_usage`` one more chunk follows with ``"choices": []`` and ``usage``.
``GET /v1/models``   ``{"object": "list", "data": [{"id", "object": "model", "owned_by"}]}``:
    the target first (the servable model), then the draft (listed, not servable: a request
    naming it is a 404 ``model_not_found``).
``GET /health``      200 ``{"status": "ok"}`` when ready, 503 ``{"status": "loading"}`` before.
``GET /metrics``     Prometheus text exposition format.

Errors are ``{"error": {"message", "type", "param", "code"}}`` with status 400 (bad JSON or a bad
or unsupported parameter, named in ``param``; a context overflow gives both token counts), 401
(missing or wrong API key), 404 (unknown route, code ``unknown_route``, or model, ``param``
``model`` and code ``model_not_found`` as OpenAI's API answers), 405, 408 (request not sent in
time), 413 (body over the limit, refused before it is read), 431 (headers too many or too large),
429 with ``Retry-After`` (queue full),
503 (loading or shutting down), 505 (not HTTP/1.x), 500 (the generation failed). ``type`` follows
the status as OpenAI's does: ``invalid_request_error`` for 400, 404, 405, 413, 431 and 505,
``authentication_error`` for 401, ``timeout_error`` for 408, ``rate_limit_error`` for 429 and
``server_error`` for 500 and 503.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from protocols.rpc import MAX_MESSAGES, MAX_SEED, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TEMPERATURE

API_VERSION = (1, 2)  # 1.1: timings.seed; 1.2: a 404 is typed invalid_request_error, as OpenAI types it
#: The OpenAI API's default: sampled. Greedy output (equal to ``lever-actors generate``) needs
#: ``temperature: 0``.
DEFAULT_TEMPERATURE = 1.0

#: Fields that would change the answer in ways this server cannot honour: refused, never ignored.
UNSUPPORTED = ("n", "logprobs", "top_logprobs", "echo", "best_of", "suffix", "logit_bias",
               "tools", "tool_choice", "functions", "function_call", "response_format",
               "presence_penalty", "frequency_penalty", "prediction", "audio", "modalities")
#: Fields accepted and without effect on the output (bookkeeping of the OpenAI API).
INERT = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
_COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
           "cache_prompt")
_NEUTRAL = {"n": 1, "best_of": 1, "echo": False, "logprobs": (None, False), "presence_penalty": 0,
            "frequency_penalty": 0, "logit_bias": ({}, None), "suffix": (None, ""),
            "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
            "response_format": (None, {"type": "text"}), "top_logprobs": (None, 0)}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP ``status``, and the body's ``message``/``type``/``param``/``code``."""

    # as OpenAI's API types them: a 404 (an unknown model, code model_not_found, or route) is an
    # invalid_request_error there, which its clients' error handling expects
    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
             405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
             429: "rate_limit_error", 431: "invalid_request_error", 500: "server_error",
             503: "server_error", 505: "invalid_request_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class CompletionRequest:
    """A checked completions or chat body (exactly one of ``prompt`` and ``messages`` is set)."""

    chat: bool
    prompt: str | None
    messages: list[dict] | None
    model: str
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    cache_prompt: bool = True


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise _bad(name, f"{name} must be a number from {lo} to {hi}, got {json.dumps(value)[:40]}")
    return float(value)


def _integer(body: dict, name: str, default: Any, lo: int, hi: int) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(name, f"{name} must be an integer from {lo} to {hi}, got {json.dumps(value)[:40]}")
    return value


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS:
        raise _bad("stop", f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings")
    for s in stops:
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
            raise _bad("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
    return tuple(stops)


def _content(i: int, value: Any) -> str:
    """A message's content: a string, or a list of text parts (images and audio are refused)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(f"messages[{i}].content", f"only text content parts are supported, got {kind!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content", "content must be a string or a list of text parts")


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_MESSAGES:
        raise _bad("messages", f"messages must be a list of 1 to {MAX_MESSAGES} messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "each message must be an object with role and content")
        role = m.get("role")
        if role not in _ROLES:
            raise _bad(f"messages[{i}].role", f"role must be one of {', '.join(_ROLES)}, got {role!r}"
                       + (" (tool calls are not supported)" if role in ("tool", "function") else ""))
        if m.get("tool_calls"):
            raise _bad(f"messages[{i}].tool_calls", "tool calls are not supported")
        out.append({"role": _ROLES[role], "content": _content(i, m.get("content"))})
    return out


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]  # the API's one-element batch
    if isinstance(value, list):
        raise _bad("prompt", "prompt must be one string (batches and token arrays are not supported)")
    if not isinstance(value, str) or not value:
        raise _bad("prompt", "prompt must be a non-empty string")
    return value


def check_completion(raw: bytes, *, chat: bool, model_ids: tuple[str, ...],
                     max_tokens_limit: int) -> CompletionRequest:
    """Parse and check one completions (``chat=False``) or chat completions body.

    ``model_ids`` are the names ``/v1/models`` lists; the first is the one served, the only one a
    request may name. Without
    ``max_tokens`` the request's ``max_tokens`` is None: as in the OpenAI API, the answer may take
    whatever room the context leaves (the server fills it in once the prompt is counted).

    Raises:
        ApiError: 400 naming the first bad or unsupported parameter; 404 for a model not served.
    """
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, a too-long integer, nesting too deep
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    own = ("messages", "max_completion_tokens") if chat else ("prompt",)
    for name in body:
        if name in UNSUPPORTED:
            if body[name] in _tuple(_NEUTRAL.get(name)):
                continue
            raise ApiError(400, f"{name} is not supported by this server", param=name,
                           code="unsupported_parameter")
        if name not in _COMMON and name not in own and name not in INERT:
            raise ApiError(400, f"unknown parameter {name!r}", param=name, code="unknown_parameter")
    model = body.get("model")
    if model is not None and model != model_ids[0]:
        # the draft is listed, but only proposes tokens: naming it must not quietly get the target
        why = "is the draft model, which only proposes tokens" if model in model_ids else "is not served here"
        raise ApiError(404, f"model {model!r} {why}; this server generates with {model_ids[0]!r} "
                            f"(GET /v1/models lists {', '.join(model_ids)})", param="model", code="model_not_found")
    if chat:
        messages, prompt = _messages(body.get("messages")), None
    else:
        messages, prompt = None, _prompt(body.get("prompt"))
    limit_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise _bad("stream", "stream must be true or false")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise _bad("stream_options", "stream_options may only hold include_usage")
    include_usage = bool((options or {}).get("include_usage", False))
    if include_usage and not stream:
        raise _bad("stream_options", "stream_options is only allowed with stream: true")
    return CompletionRequest(
        chat=chat, prompt=prompt, messages=messages, model=model_ids[0],
        max_tokens=_integer(body, limit_name, None, 1, max_tokens_limit),
        temperature=_number(body, "temperature", DEFAULT_TEMPERATURE, 0.0, MAX_TEMPERATURE),
        top_p=_top_p(body),
        seed=_integer(body, "seed", None, 0, MAX_SEED), stop=_stop(body.get("stop")),
        stream=bool(stream), include_usage=include_usage, cache_prompt=_flag(body, "cache_prompt", True))


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise _bad(name, f"{name} must be true or false")
    return value


def _tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _top_p(body: dict) -> float:
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise _bad("top_p", "top_p must be above 0 (use temperature 0 for greedy output)")
    return top_p


# --- responses ----------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def timings(stats: dict, prompt_n: int, predicted_n: int, prompt_s: float, predicted_s: float) -> dict:
    """llama.cpp's ``timings`` names, then lever's own figures of the request."""
    return {"prompt_n": prompt_n, "prompt_ms": 1e3 * prompt_s,
            "predicted_n": predicted_n, "predicted_ms": 1e3 * predicted_s,
            "predicted_per_second": predicted_n / predicted_s if predicted_s > 0 else None,
            "draft_n": stats.get("draft_n", 0), "draft_n_accepted": stats.get("draft_n_accepted", 0),
            "cache_n": stats.get("cache_n", 0),
            "passes": stats.get("passes", 0), "mean_accepted": stats.get("mean_accepted"),
            "flash_bytes_per_token": stats.get("flash_bytes_per_token"),
            # the seed a sampled request drew from (its own, or a fresh one when it named none): sent
            # back as ``seed``, it gives the same text again; None for greedy requests
            "seed": stats.get("seed")}


def completion(req: CompletionRequest, ident: str, created: int, text: str, finish_reason: str,
               usage_: dict, timings_: dict) -> dict:
    """The whole answer of a request without ``stream``."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if req.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": ident, "object": "chat.completion" if req.chat else "text_completion",
            "created": created, "model": req.model, "choices": [choice], "usage": usage_,
            "timings": timings_}


def chunk(req: CompletionRequest, ident: str, created: int, *, text: str | None = None,
          role: bool = False, finish_reason: str | None = None, timings_: dict | None = None) -> dict:
    """One streamed chunk with one choice (text, the chat role, or the finish)."""
    if req.chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason,
                                  "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
    out = {"id": ident, "object": "chat.completion.chunk" if req.chat else "text_completion",
           "created": created, "model": req.model, "choices": [choice]}
    if timings_ is not None:
        out["timings"] = timings_
    return out


def usage_chunk(req: CompletionRequest, ident: str, created: int, usage_: dict) -> dict:
    return {"id": ident, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": created, "model": req.model, "choices": [], "usage": usage_}


def sse(obj: dict) -> bytes:
    """One server-sent event carrying ``obj``."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def models(model_ids: tuple[str, ...], created: int) -> dict:
    return {"object": "list", "data": [{"id": m, "object": "model", "created": created,
                                        "owned_by": "lever-actors"} for m in model_ids]}

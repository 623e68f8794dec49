"""The seam between the daemon and whatever really generates tokens.

The daemon (``lever_actors.daemon``) drives one object that satisfies
:class:`Backend`. The real engine (draft + flash-streamed target) implements it
elsewhere; ``tests/fake_backend.py`` implements it deterministically for tests.
This module imports no trio and no model runtime: only the types live here.

Contract, in short:

* ``describe()`` is called once, after the models are loaded, and must be cheap
  and free of side effects. Its dict is shown to clients by ``hello``/``models``.
* ``count_prompt_tokens(params)`` runs on the daemon's event loop for every
  ``generate`` request before it is queued, so it must be fast (tokenize only).
* ``generate(params, emit)`` runs one generation. It awaits ``emit(text,
  token_ids)`` for each new chunk, in order; the concatenated ``text`` of all
  chunks must equal the outcome's ``text``, and likewise for ``token_ids``.
  ``text`` must be valid Unicode: hold back the bytes of a character split
  across tokens until it is complete, so a chunk may carry ids and no text,
  or (a final flush) text and no ids.
  It must be cancellation-safe: the daemon cancels it with a trio cancel scope
  when the client cancels or disconnects, and every buffer it took must be
  returned in ``finally`` blocks. ``emit`` may raise ``trio.Cancelled``.
  Exceptions other than cancellation are reported to that client as an
  ``internal`` error (``ContextOverflow`` as ``context_overflow``) and the
  daemon keeps serving.
* ``pool_stats()`` reports buffer accounting so tests can prove nothing leaks.
* Optional: ``async run(*, task_status)``. If the backend has it, the daemon
  starts it with ``nursery.start`` before it listens (and before calling
  ``describe``), and cancels it at shutdown: the place for tasks that live as
  long as the daemon, such as a pipeline of actors.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

#: Values of :attr:`GenerateOutcome.finish_reason`.
FINISH_REASONS = ("stop", "length", "cancelled")

#: Per-request statistics a real backend reports (llama.cpp names where one exists).
STATS_KEYS = (
    "draft_n",                # draft tokens proposed
    "draft_n_accepted",       # draft tokens the target accepted
    "mean_accepted",          # mean accepted length per verification pass
    "passes",                 # target verification passes
    "flash_bytes_read",       # bytes streamed from flash for this request
    "flash_bytes_per_token",  # flash_bytes_read / n_tokens
    "io_s",                   # seconds spent waiting on flash I/O
    "compute_s",              # seconds spent computing
    "n_tokens",               # tokens committed (== len(token_ids))
    "cache_n",                # prompt tokens whose KV rows were reused from the last request
    "prompt_n",               # prompt tokens the prefill computed
    "ttft_s",                 # the prefill: prompt in, first token out
)

Emit = Callable[[str, list[int]], Awaitable[None]]


@dataclass(frozen=True)
class GenerateParams:
    """One validated generation request (exactly one of prompt/messages is set)."""

    prompt: str | None
    messages: list[dict] | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    mode: str | None
    cache_prompt: bool = True  # reuse the KV rows of the prefix shared with the last request


@dataclass
class GenerateOutcome:
    """What :meth:`Backend.generate` returns when it finishes without being cancelled."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    """What the daemon needs from a token generator. See the module docstring."""

    def describe(self) -> dict:
        """Return ``{"models": {...}, "mode": str, "modes": [...],
        "context_length": int, "dram_budget_bytes": int | None, ...}``."""
        ...

    def count_prompt_tokens(self, params: GenerateParams) -> int:
        """Return the number of prompt tokens ``params`` would occupy in the context."""
        ...

    async def generate(self, params: GenerateParams, emit: Emit) -> GenerateOutcome:
        """Generate, awaiting ``emit(text, token_ids)`` per chunk; cancellation-safe."""
        ...

    def pool_stats(self) -> dict:
        """Return buffer accounting, e.g. ``{"buffers_total": n, "buffers_free": n}``."""
        ...

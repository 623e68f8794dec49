"""One error hierarchy for the whole runtime.

Exceptions are types in code; the daemon converts them into msgpack-RPC error
values at its session boundary and nowhere else.
"""
from __future__ import annotations


class LeverError(Exception):
    """Base of every error lever-actors raises on purpose."""


class ConfigError(LeverError):
    """Bad configuration or command-line input (message says what and how to fix)."""


class ModelError(LeverError):
    """A model file or bundle is missing, corrupt or unsupported."""


class UnsupportedModel(ModelError):
    """The GGUF uses an architecture or tensor type this runtime does not implement."""


class ModelIncompatible(ModelError):
    """The draft and target models cannot be paired (vocabularies or special tokens differ)."""


class FlashFault(LeverError):
    """Streamed weights could not be read, or were not the bytes the bundle recorded.

    ``retryable``: an I/O error that persisted through the read retries (the next request may
    succeed); not retryable: the bytes are damaged or the file changed (reconvert or restart).
    """

    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


class BudgetError(LeverError):
    """The DRAM budget cannot hold even the streaming minimum."""


class ContextOverflow(LeverError):
    """Prompt plus requested tokens exceed the context the runtime was started with."""


class DaemonNotRunning(LeverError):
    """No daemon answers at the socket (the message says why, e.g. "daemon has died")."""


class ConnectionLost(DaemonNotRunning):
    """The daemon closed the connection, or it broke, while requests were pending."""


class DaemonAlreadyRunning(LeverError):
    """Another daemon already serves this socket (raised by the daemon at start)."""


class BadStatusFile(LeverError):
    """The status file exists but is not valid (the message names the field)."""


class RemoteError(LeverError):
    """An error response from the daemon: its wire ``code``, ``message`` and ``retryable``."""

    def __init__(self, code: str, message: str, retryable: bool = False):
        super().__init__(f"[{code}] {message}")
        self.code, self.message, self.retryable = code, message, retryable

    @classmethod
    def from_wire(cls, error: object) -> RemoteError:
        """Build one from a response's error map (a malformed one becomes ``internal``)."""
        if isinstance(error, dict):
            return cls(str(error.get("code", "internal")), str(error.get("message", "")),
                       bool(error.get("retryable", False)))
        return cls("internal", f"malformed error value from daemon: {error!r:.200}")


def first_leaf(error: BaseException) -> BaseException:
    """The first error inside trio's (nested) exception groups, or ``error`` itself: an actor's or a
    task's error reaches the command line wrapped by every nursery it passed through."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error

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


class BudgetError(LeverError):
    """The DRAM budget cannot hold even the streaming minimum."""


class ContextOverflow(LeverError):
    """Prompt plus requested tokens exceed the context the runtime was started with."""

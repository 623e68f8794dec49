"""Message base class, registry and the msgpack envelope codec.

Layer: protocols/ (wire schemas). Imports only the standard library, msgpack and numpy; never
trio, onnxruntime or lever_actors.

Wire contract: a message is the msgpack array ``[KIND, VERSION, body]``, ``body`` a map of
field name -> value; nested messages are envelopes too, arrays use ``protocols.ndarray``, enums
travel as their value. Decoding ignores unknown keys, fills missing fields that have defaults,
upgrades older versions through ``upgrade_from_<n>(body) -> body`` static methods on the class,
and refuses newer versions and unknown kinds with a ``ProtocolError`` carrying a stable
``code``. ``encode`` raises ``TypeError`` for a field that does not fit its annotation: a
sender bug, not a protocol event.
"""
from __future__ import annotations

import enum
import re
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, Callable, ClassVar, Union

import msgpack
import numpy as np

from protocols.ndarray import ext_hook, pack_ndarray

PROTOCOL_VERSION = (1, 0)  # (major, minor) of the whole message set, for handshakes
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # default decode cap, the same as the frame cap


class ProtocolError(Exception):
    """Bytes that are not a valid message. ``code`` is stable and travels in error replies."""
    code: ClassVar[str] = "bad_frame"


class BadFrame(ProtocolError):
    """Not msgpack, not an envelope, or a body that does not fit the message's fields."""
    code = "bad_frame"


class FrameTooLarge(ProtocolError):
    """The encoded message is longer than the decoder's ``max_bytes``."""
    code = "frame_too_large"


class UnknownMessage(ProtocolError):
    """A well-formed envelope whose KIND no registered class declares."""
    code = "unknown_message"


class VersionMismatch(ProtocolError):
    """A VERSION newer than this build knows, or an old one with no upgrade path."""
    code = "version_mismatch"


class Message:
    """Base of every message class; its empty ``__slots__`` keeps subclasses ``__dict__``-free.

    Subclasses are ``@register``-ed ``@dataclass(frozen=True, slots=True, kw_only=True)``
    classes with ``KIND`` (dotted lower case, unique) and ``VERSION`` (int >= 1) ClassVars.
    Field annotations may be int, float, bool, str, bytes, None, ``X | None``,
    ``tuple[X, ...]``, fixed ``tuple[X, Y]``, ``np.ndarray``, IntEnum/StrEnum subclasses and
    registered Message subclasses (defined before the class that uses them).
    """

    __slots__ = ()
    KIND: ClassVar[str]
    VERSION: ClassVar[int]


REGISTRY: dict[str, type[Message]] = {}
"""KIND -> class for every message this build can decode."""

_KIND_RE = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+")
_INT_RANGE = (-(2**63), 2**64)  # what msgpack can carry
_PLAIN = (int, float, bool, str, bytes, type(None), np.ndarray)
# A converter checks a value against a field annotation and returns the Python value; the
# registry argument is None when encoding (values are already Python) and set when decoding.
Converter = Callable[[Any, "dict[str, type[Message]] | None"], Any]
_FIELDS: dict[type, tuple[tuple[str, Converter, bool], ...]] = {}  # (name, converter, required)


def _plain(kind: type) -> Converter:
    accepted = (int, float) if kind is float else kind  # ints are fine where floats are declared

    def convert(value, registry):
        # bool is an int subclass; a bool in an int or float field is almost always a bug.
        if not isinstance(value, accepted) or isinstance(value, bool) != (kind is bool):
            raise ValueError(f"expected {kind.__name__}, got {type(value).__name__}")
        if kind is int and not _INT_RANGE[0] <= value < _INT_RANGE[1]:
            raise ValueError(f"int {value} does not fit msgpack")
        return float(value) if kind is float else value
    return convert


def _converter(tp: Any) -> Converter:
    """Build the converter for one annotation; TypeError for unsupported ones."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in _PLAIN:
        return _plain(tp)
    if isinstance(tp, type) and issubclass(tp, (enum.IntEnum, enum.StrEnum)):
        return lambda value, registry: tp(value)  # ValueError for values it does not have
    if isinstance(tp, type) and issubclass(tp, Message):
        return _message_converter(tp)
    if origin is tuple:
        return _tuple_converter(tp, args)
    if origin not in (Union, types.UnionType):
        raise TypeError(f"unsupported message field annotation {tp!r}")
    members = [_converter(a) for a in args]

    def convert_union(value, registry):
        for member in members:
            try:
                return member(value, registry)
            except (ValueError, TypeError, ProtocolError):
                continue
        raise ValueError(f"{value!r} matches none of {tp}")
    return convert_union


def _tuple_converter(tp: Any, args: tuple) -> Converter:
    variadic = args[-1:] == (Ellipsis,)
    items = [_converter(a) for a in (args[:1] if variadic else args)]

    def convert_tuple(value, registry):
        if not isinstance(value, tuple) or not (variadic or len(value) == len(items)):
            raise ValueError(f"expected {tp}, got {type(value).__name__} {value!r:.60}")
        return tuple(items[0 if variadic else i](v, registry) for i, v in enumerate(value))
    return convert_tuple


def _message_converter(cls: type[Message]) -> Converter:
    def convert_message(value, registry):
        if registry is not None:  # decoding: value is an envelope
            value = _from_envelope(value, registry)
        elif isinstance(value, cls):  # encoding: check the nested message's own fields
            _check_fields(value)
        if not isinstance(value, cls):
            raise ValueError(f"expected {cls.__name__}, got {type(value).__name__}")
        return value
    return convert_message


def register(cls: type | None = None, *, registry: dict[str, type[Message]] | None = None):
    """Class decorator adding a message class to ``REGISTRY`` (or ``@register(registry=...)``).

    Place it above ``@dataclass(frozen=True, slots=True, kw_only=True)`` so it sees the final
    slotted class (not from ``__init_subclass__``, which runs for the pre-slots class too).

    Raises:
        TypeError: not a frozen, slotted, keyword-only Message dataclass; unsupported annotation.
        ValueError: KIND malformed or already registered; VERSION not an int >= 1.
    """
    def apply(cls: type) -> type:
        target = REGISTRY if registry is None else registry
        if not (isinstance(cls, type) and issubclass(cls, Message) and is_dataclass(cls)):
            raise TypeError(f"@register needs a Message dataclass, got {cls!r}")
        kind, version = vars(cls).get("KIND"), vars(cls).get("VERSION")
        name = cls.__name__
        params = cls.__dataclass_params__
        if not params.frozen or not all("__slots__" in vars(c) for c in cls.__mro__[:-1]):
            raise TypeError(f"{name}: messages must be frozen and slotted")
        if not all(f.kw_only for f in fields(cls)):
            raise TypeError(f"{name}: messages must be keyword-only")
        if not (isinstance(kind, str) and _KIND_RE.fullmatch(kind)):
            raise ValueError(f"{name}: KIND must be dotted lower case, got {kind!r}")
        if type(version) is not int or version < 1:
            raise ValueError(f"{name}: VERSION must be an int >= 1, got {version!r}")
        if kind in target:
            raise ValueError(f"duplicate KIND {kind!r}: {target[kind].__name__} and {name}")
        hints = typing.get_type_hints(cls)
        _FIELDS[cls] = tuple(
            (f.name, _converter(hints[f.name]),
             f.default is MISSING and f.default_factory is MISSING)
            for f in fields(cls))
        # numpy's elementwise == makes the generated __eq__ ambiguous for array fields.
        cls.__eq__ = _message_eq
        target[kind] = cls
        return cls
    return apply if cls is None else apply(cls)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and bool(np.array_equal(a, b)))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _message_eq(self: Message, other: object) -> bool:
    """Field-wise equality; arrays are equal when dtype, shape and values are (NaN != NaN)."""
    if other.__class__ is not self.__class__:
        return NotImplemented
    return all(_same(getattr(self, n), getattr(other, n)) for n, _, _ in _FIELDS[type(self)])


def _check_fields(msg: Message) -> None:
    spec = _FIELDS.get(type(msg))
    if spec is None:
        raise TypeError(f"{type(msg).__name__} is not a registered message class")
    for name, convert, _ in spec:
        try:
            convert(getattr(msg, name), None)
        except (ValueError, TypeError) as exc:
            raise TypeError(f"{msg.KIND}.{name}: {exc}") from None


def _envelope(msg: Message) -> list:
    return [msg.KIND, msg.VERSION, {n: getattr(msg, n) for n, _, _ in _FIELDS[type(msg)]}]


def _default(obj: Any) -> Any:
    if isinstance(obj, Message):
        return _envelope(obj)
    if isinstance(obj, np.ndarray):
        return pack_ndarray(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}")


def encode(msg: Message) -> bytes:
    """Encode a registered message as ``[KIND, VERSION, body]``; fields in declaration order.

    Raises:
        TypeError: unregistered class, or a field value does not fit its annotation
            (for instance a list in a tuple field or ``np.int64`` in an int field).
    """
    _check_fields(msg)
    return msgpack.packb(_envelope(msg), use_bin_type=True, default=_default)


def decode(data: bytes | bytearray | memoryview, *,
           registry: dict[str, type[Message]] | None = None,
           max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Decode exactly one message (trailing bytes are a ``BadFrame``).

    ``registry`` defaults to ``REGISTRY``; input longer than ``max_bytes`` is refused before
    parsing. Returned arrays are read-only views of the input's copy.

    Raises:
        ProtocolError: FrameTooLarge, BadFrame, UnknownMessage or VersionMismatch. Bad bytes
            never raise anything else.
        TypeError: ``data`` is not bytes-like (a caller bug).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode needs bytes, got {type(data).__name__}")
    if (size := memoryview(data).nbytes) > max_bytes:
        raise FrameTooLarge(f"message of {size} bytes exceeds {max_bytes}")
    try:
        # use_list=False: sequences come back as tuples, matching tuple fields.
        obj = msgpack.unpackb(data, use_list=False, raw=False, strict_map_key=True,
                              ext_hook=ext_hook)
    except (ValueError, msgpack.UnpackException, RecursionError) as exc:
        raise BadFrame(f"not a msgpack message: {exc!r}") from None
    return _from_envelope(obj, REGISTRY if registry is None else registry)


def _from_envelope(obj: Any, registry: dict[str, type[Message]]) -> Message:
    if not (isinstance(obj, tuple) and len(obj) == 3 and isinstance(obj[0], str)
            and type(obj[1]) is int and obj[1] >= 1 and isinstance(obj[2], dict)):
        raise BadFrame("a message must be [KIND: str, VERSION: int >= 1, body: map]")
    kind, version, body = obj
    cls = registry.get(kind)
    if cls is None:
        raise UnknownMessage(f"unknown message kind {kind!r}")
    if version > cls.VERSION:
        raise VersionMismatch(f"{kind} v{version} is newer than the known v{cls.VERSION}")
    body = _upgrade(cls, version, body)
    kwargs = {}
    for name, convert, required in _FIELDS[cls]:
        if name in body:
            try:
                kwargs[name] = convert(body[name], registry)
            except (ValueError, TypeError) as exc:
                raise BadFrame(f"{kind}.{name}: {exc}") from None
        elif required:
            raise BadFrame(f"{kind}: missing required field {name!r}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:  # __post_init__ validation
        raise BadFrame(f"{kind}: {exc}") from None


def _upgrade(cls: type[Message], version: int, body: dict) -> dict:
    """Run ``upgrade_from_<v>`` hooks from ``version`` up to ``cls.VERSION``."""
    for v in range(version, cls.VERSION):
        hook = getattr(cls, f"upgrade_from_{v}", None)
        if hook is None:
            raise VersionMismatch(f"{cls.KIND} v{version} is too old: no upgrade_from_{v}")
        try:
            body = dict(hook(dict(body)))
        except (ValueError, TypeError, LookupError) as exc:
            raise BadFrame(f"{cls.KIND}: upgrade from v{v} failed: {exc!r}") from None
    return body

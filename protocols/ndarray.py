"""numpy arrays on the wire through one msgpack ExtType.

Layer: protocols/ (wire schemas). Imports only the standard library, msgpack and numpy.

Wire contract: an array is ``ExtType(NDARRAY_EXT, payload)`` where ``payload`` is the msgpack
array ``[dtype_str, shape, raw]``:

- ``dtype_str`` is numpy's ``dtype.str`` with an explicit little-endian byte order (``'<f4'``,
  ``'<i8'``; one-byte types carry numpy's ``'|'``: ``'|b1'``, ``'|u1'``). Only the dtypes in
  ``WIRE_DTYPES`` travel: bool, signed and unsigned integers, float16/32/64, complex64/128.
  Object, string, datetime, structured and platform-sized (longdouble) dtypes are refused,
  because their bytes either are pointers or differ between machines.
- ``shape`` is an array of non-negative ints (empty for a 0-d array).
- ``raw`` is the C-order bytes, exactly ``prod(shape) * itemsize`` long.

Decoding returns ``np.frombuffer(raw, dtype).reshape(shape)``: no copy beyond the one msgpack
makes for ``raw``, and the result is read-only. Callers copy if they need to mutate.
Decoding errors are ``ValueError`` here; ``protocols.base`` turns them into ``BadFrame``.
"""
from __future__ import annotations

import math

import msgpack
import numpy as np

NDARRAY_EXT = 1
"""The single msgpack ExtType code for numpy arrays (application range 0..127)."""

WIRE_DTYPES = frozenset({
    "|b1", "|i1", "|u1",
    "<i2", "<i4", "<i8", "<u2", "<u4", "<u8",
    "<f2", "<f4", "<f8", "<c8", "<c16",
})
"""Canonical dtype strings allowed on the wire."""

# numpy 2 allows 64 dimensions; nothing in this project comes close, and a low cap keeps a
# hostile payload from building huge shape tuples.
MAX_NDIM = 32


def wire_dtype(dtype: np.dtype) -> np.dtype:
    """Return the little-endian wire dtype for ``dtype``.

    Raises:
        TypeError: the dtype cannot travel (object, strings, datetimes, structured, longdouble).
    """
    little = np.dtype(dtype).newbyteorder("<")
    if little.str not in WIRE_DTYPES:
        raise TypeError(f"dtype {np.dtype(dtype)!r} cannot be sent; allowed: {sorted(WIRE_DTYPES)}")
    # Rebuild from the string so metadata and alignment flags do not leak into the result.
    return np.dtype(little.str)


def pack_ndarray(arr: np.ndarray) -> msgpack.ExtType:
    """Encode ``arr`` (any layout or byte order) as the ndarray ExtType.

    Non-contiguous and Fortran-ordered inputs are copied to C order; big-endian inputs are
    converted. Subclasses (masked arrays, memmaps) travel as their plain data.

    Raises:
        TypeError: ``arr`` is not an ndarray or its dtype is not in ``WIRE_DTYPES``.
    """
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"expected numpy.ndarray, got {type(arr).__name__}")
    dtype = wire_dtype(arr.dtype)
    raw = np.asarray(arr, dtype=dtype).tobytes(order="C")
    payload = msgpack.packb([dtype.str, list(arr.shape), raw], use_bin_type=True)
    return msgpack.ExtType(NDARRAY_EXT, payload)


def unpack_ndarray(payload: bytes) -> np.ndarray:
    """Decode an ndarray ExtType payload into a read-only array.

    Raises:
        ValueError: the payload is not a well-formed ``[dtype_str, shape, raw]``.
    """
    try:
        obj = msgpack.unpackb(payload, use_list=False, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"ndarray payload is not msgpack: {exc}") from None
    if not (isinstance(obj, tuple) and len(obj) == 3):
        raise ValueError("ndarray payload must be [dtype, shape, raw]")
    dtype_str, shape, raw = obj
    if not isinstance(dtype_str, str) or dtype_str not in WIRE_DTYPES:
        raise ValueError(f"ndarray dtype {dtype_str!r} is not a wire dtype")
    if not (isinstance(shape, tuple) and len(shape) <= MAX_NDIM
            and all(type(d) is int and d >= 0 for d in shape)):
        raise ValueError(f"ndarray shape {shape!r} is not a tuple of non-negative ints")
    if not isinstance(raw, bytes):
        raise ValueError("ndarray raw data must be bin")
    dtype = np.dtype(dtype_str)
    if math.prod(shape) * dtype.itemsize != len(raw):
        raise ValueError(f"ndarray of shape {shape} and dtype {dtype_str} needs "
                         f"{math.prod(shape) * dtype.itemsize} bytes, got {len(raw)}")
    # reshape raises ValueError itself for shapes numpy cannot represent (e.g. (0, 2**62, 2**62)).
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def ext_hook(code: int, data: bytes) -> object:
    """msgpack ``ext_hook``: arrays for ``NDARRAY_EXT``; other codes stay ``ExtType``.

    Unknown codes are left alone rather than rejected so that an unknown field carrying a
    future ext type can still be ignored; a known field holding one fails its type check.
    """
    if code == NDARRAY_EXT:
        return unpack_ndarray(data)
    return msgpack.ExtType(code, data)

"""Buffer handles: how a tensor is named in a message without travelling in it.

The owner ``put``s an array and sends its handle; the reader ``get``s it while
the owner waits for the answer; the owner ``drop``s it afterwards. One owner per
table, and an array is never written after ``put``, so the reader sees a
settled tensor without a copy (DESIGN: tensors never travel, handles do).
"""
from __future__ import annotations

import numpy as np


class HandleTable:
    def __init__(self) -> None:
        self._arrays: dict[int, np.ndarray] = {}
        self._next = 1

    def put(self, array: np.ndarray) -> int:
        handle, self._next = self._next, self._next + 1
        array.flags.writeable = False  # settled: readers may keep views
        self._arrays[handle] = array
        return handle

    def get(self, handle: int) -> np.ndarray:
        try:
            return self._arrays[handle]
        except KeyError:
            raise KeyError(f"buffer handle {handle} is not (or no longer) held") from None

    def drop(self, handle: int) -> None:
        self._arrays.pop(handle, None)

    def __len__(self) -> int:
        return len(self._arrays)

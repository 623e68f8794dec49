"""Honest flash reads: O_DIRECT into page-aligned buffers, or buffered + DONTNEED.

Reading through the page cache while claiming to be flash-backed would be a lie
(17 GB/s instead of ~1.2 GB/s here), so the fallback drops the pages after each
read and reports that it was used.
"""
from __future__ import annotations

import mmap
import os
import time

PAGE = 4096


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous mapping: page aligned, as O_DIRECT requires."""
    return mmap.mmap(-1, max(PAGE, (nbytes + PAGE - 1) // PAGE * PAGE))


class FlashFile:
    def __init__(self, path: str, direct: bool = True) -> None:
        self.path = path
        self.direct = False
        self.fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                self.direct = True
            except OSError:
                self.fd = -1
        if self.fd < 0:
            self.fd = os.open(path, os.O_RDONLY)

    def read_into(self, buf, offset: int, nbytes: int) -> int:
        """Read ``nbytes`` at ``offset`` into the start of ``buf`` (blocking; call from a thread)."""
        view = memoryview(buf)[:nbytes]
        if self.direct:
            try:
                return self._read_all(view, offset)
            except OSError:  # e.g. EINVAL on a file system that accepted the flag but not the I/O
                os.close(self.fd)
                self.fd = os.open(self.path, os.O_RDONLY)
                self.direct = False
        n = self._read_all(view, offset)
        os.posix_fadvise(self.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        return n

    def _read_all(self, view: memoryview, offset: int) -> int:
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"short read of {self.path} at {offset + done}")
            done += n
        return done

    def drop_cache(self) -> None:
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def throttle(nbytes: int, started: float, bandwidth: float | None) -> None:
    """Sleep so that a read of ``nbytes`` begun at ``started`` takes at least nbytes/bandwidth."""
    if bandwidth:
        wait = started + nbytes / bandwidth - time.perf_counter()
        if wait > 0:
            time.sleep(wait)

"""Honest flash reads: O_DIRECT into page-aligned buffers, or buffered + DONTNEED.

Reading through the page cache while claiming to be flash-backed would be a lie
(17 GB/s instead of ~1.2 GB/s here), so the fallback drops the pages after each
read and reports that it was used.
"""
from __future__ import annotations

import errno
import mmap
import os
import threading
import time

from lever_actors.errors import FlashFault

PAGE = 4096
READ_RETRIES = 3  # a failed read is tried this many more times before it fails the request


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Private anonymous mapping: page aligned, as O_DIRECT requires, and backed by transparent huge
    pages where the kernel gives them (``MADV_HUGEPAGE``; a shared mapping never gets them).

    Why huge pages: an O_DIRECT read goes to the device as requests of at most a few hundred
    physically contiguous KiB, so how fast a buffer fills depends on how scattered its 4 KiB pages
    are. Measured here, 28 MiB reads into eight 4 KiB-page buffers of one process ran at 1.0 to
    2.5 GB/s, each buffer at its own rate every time (the first ones, in recycled memory, slowest);
    into huge-page buffers at 3.0-3.4 GB/s. The kernels that read weights from the buffer also
    take fewer TLB misses.
    """
    size = max(PAGE, (nbytes + PAGE - 1) // PAGE * PAGE)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages, still correct
            pass
    return buf


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
        self._size = os.fstat(self.fd).st_size

    def read_into(self, buf, offset: int, nbytes: int, what: str = "region") -> int:
        """Read ``nbytes`` at ``offset`` into the start of ``buf`` (blocking; call from a thread).

        An I/O error or a short read is retried ``READ_RETRIES`` times (a transient fault costs
        a few milliseconds); then it raises a retryable :class:`FlashFault` naming ``what``.
        """
        view = memoryview(buf)[:nbytes]
        for attempt in range(READ_RETRIES + 1):
            try:
                return self._read_once(view, offset, nbytes)
            except OSError as exc:
                if attempt == READ_RETRIES:
                    raise FlashFault(f"reading {what} of {self.path} ({nbytes} bytes at offset {offset}) failed "
                                     f"{READ_RETRIES + 1} times: {exc}", retryable=True) from exc
                time.sleep(0.005 * 2 ** attempt)
        raise AssertionError("unreachable")

    def _read_once(self, view: memoryview, offset: int, nbytes: int) -> int:
        if self.direct:
            try:
                return self._read_all(view, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # a file system that accepted O_DIRECT at open but not for I/O: buffered from now on
                os.close(self.fd)
                self.fd = os.open(self.path, os.O_RDONLY)
                self.direct = False
        n = self._read_all(view, offset)
        os.posix_fadvise(self.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        return n

    def _read_all(self, view: memoryview, offset: int) -> int:
        done = 0
        while done < len(view):
            n = self._pread(view[done:], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"short read of {self.path} at {offset + done}")
            done += n
        return done

    def _pread(self, view: memoryview, offset: int) -> int:
        """The one system call of a read: the seam where tests inject faults."""
        return os.preadv(self.fd, [view], offset)

    def changed(self) -> str | None:
        """Why the path no longer names the file we opened (replaced, truncated), or None."""
        try:
            now = os.stat(self.path)
        except OSError as exc:
            return f"{self.path} is gone: {exc.strerror}"
        mine = os.fstat(self.fd)
        if (now.st_ino, now.st_dev) != (mine.st_ino, mine.st_dev):
            return f"{self.path} was replaced while it was being served"
        if now.st_size != self._size:
            return f"{self.path} changed size ({self._size} -> {now.st_size} bytes) while it was being served"
        return None

    def drop_cache(self) -> None:
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


MIN_READ_RATE = 10**6  # bytes/s: --flash-bandwidth below this emulates no device (a layer would take minutes)
THROTTLE_SLICE_S = 0.05  # a throttled read sleeps in slices this long, checking whether its reader is leaving


def throttle(nbytes: int, started: float, bandwidth: float | None, stop: threading.Event | None = None) -> None:
    """Sleep so that a read of ``nbytes`` begun at ``started`` takes at least nbytes/bandwidth, in
    short slices: once ``stop`` is set (its reader is leaving) the wait ends at once, since leaving
    waits for this thread and no pass needs the read any more."""
    if not bandwidth:
        return
    deadline = started + nbytes / bandwidth
    while (wait := deadline - time.perf_counter()) > 0:
        if stop is not None and stop.is_set():
            return
        time.sleep(min(wait, THROTTLE_SLICE_S))

"""FlashPrefetcher: streams the target's unpinned layers from flash into a bounded buffer pool."""
from __future__ import annotations

import itertools
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass

import trio

from lever_actors.bundle import fast_digest
from lever_actors.errors import FlashFault
from protocols import LayerReady, LayerReleased

PROBE = 4096  # bytes of each of the three pages a read is probed at once its region is verified


@dataclass(frozen=True)
class StreamStage:
    """One streamed unit (a decoder layer, or the LM head as stage ``n_layer``)."""

    stage: int
    file: str
    offset: int
    nbytes: int
    xxh3: str = ""  # the bundle's fast checksum of the region ("" = unchecked)
    name: str = ""    # what the region holds, for error messages ("layer 7")


class FlashPrefetcher:
    """Reads the streamed stages in pass order, forever, as fast as free slots allow.

    Every pass streams the same stages in the same order, so the prefetcher needs
    no per-pass instructions: it cycles through the ring and blocks only on
    buffers. That is what makes the next pass's first layers load while the
    current pass finishes and the next tree is drafted.

    Inputs: ``released_recv`` (LayerReleased: a slot handed back by the verifier).
    Outputs: ``ready_send`` (LayerReady: stage ``layer`` is in pool slot ``slot``).
    Invariants: stages are read in ring order; a slot is in at most one place
    (free list, being read, or lent to the verifier); at most ``len(pool)`` slots
    are lent, so the DRAM used by stream buffers never exceeds the pool.
    Backpressure: a read starts only into a free slot; announcements wait on ``ready_send``.
    Cancellation: a read in progress finishes (threads cannot be interrupted), reads not yet
    started are dropped, then the task exits; the pool is owned by the runtime, which closes it.
    Integrity: the first read of each region in the process is checked against the bundle's
    XXH3-128 (once: about 0.05 s for the 1.5B target, on the flash lane; SHA-256 took 1.1 s); every later read is
    checked at three pages against what the verified read held (microseconds), which catches a
    read that returns zeros or a file rewritten in place; before each ring the files are checked
    for replacement or truncation. A fault never stops the ring: the stage goes out as a
    LayerReady with ``fault`` set, and the verifier fails that pass with it.
    """

    def __init__(self, stages: list[StreamStage], pool, files: dict, ready_send, released_recv,
                 lanes, tracer, bandwidth: float | None = None) -> None:
        self.stages, self.pool, self.files = stages, pool, files
        self.ready_send, self.released_recv = ready_send, released_recv
        self.lanes, self.tracer, self.bandwidth = lanes, tracer, bandwidth
        self.free = list(range(len(pool)))
        self.lent: set[int] = set()
        self.bytes_read = 0
        self.reads = 0
        self.in_flight: deque[tuple[int, StreamStage, int]] = deque()  # (step, stage, slot) submitted, in read order
        self.direct = all(f.direct for f in files.values())
        self.probes: dict[int, int] = {}  # stage -> probe digest of its verified bytes
        self.faults = 0
        self.check_s = 0.0  # time spent checking the bytes read (first XXH3 per region, then probes)
        self.leaving = threading.Event()  # set as the ring stops: an emulated slow read ends its wait

    @property
    def reading(self) -> int:
        """Reads submitted and not yet announced: each holds a lent slot not yet counted in ``reads``."""
        return len(self.in_flight)

    def _read(self, stage: StreamStage, slot: int) -> tuple[float, str, bool]:
        """Read ``stage`` into ``slot`` (on the flash lane's thread): seconds, fault, retryable."""
        from lever_actors.flashio import throttle

        t0 = time.perf_counter()
        f = self.files[stage.file]
        what = stage.name or f"stage {stage.stage}"
        try:
            if stage is self.stages[0]:
                self._check_files()
            f.read_into(self.pool[slot], stage.offset, stage.nbytes, what)
            tc = time.perf_counter()
            try:
                self._check(stage, memoryview(self.pool[slot])[:stage.nbytes], what)
            finally:
                self.check_s += time.perf_counter() - tc
        except FlashFault as exc:
            return 0.0, str(exc), exc.retryable
        throttle(stage.nbytes, t0, self.bandwidth, self.leaving)
        t1 = time.perf_counter()
        self.tracer.add(f"read {stage.stage}", "flash", t0, t1, bytes=stage.nbytes, slot=slot)
        return t1 - t0, "", False

    def _check(self, stage: StreamStage, data: memoryview, what: str) -> None:
        """Verify the region's bytes (fully the first time, then at three pages); raise FlashFault."""
        where = f"{what} ({self.files[stage.file].path} at offset {stage.offset})"
        if stage.stage not in self.probes:
            if stage.xxh3 and fast_digest(data) != stage.xxh3:
                raise FlashFault(f"{where} does not match the bundle's checksum: the bundle is damaged "
                                 f"(run `lever-actors models verify`, then reconvert)", retryable=False)
            self.probes[stage.stage] = _probe(data)
        elif _probe(data) != self.probes[stage.stage]:
            raise FlashFault(f"{where} read back different bytes than when it was verified (zeros or a "
                             f"file changed in place)", retryable=True)

    def _take_back(self, msg: LayerReleased) -> None:
        if msg.slot not in self.lent:
            raise RuntimeError(f"slot {msg.slot} released twice or never lent (layer {msg.layer})")
        self.lent.remove(msg.slot)
        self.free.append(msg.slot)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with self.ready_send, self.released_recv:
            task_status.started()
            if not self.stages:
                async for msg in self.released_recv:  # nothing streams: just wait for shutdown
                    self._take_back(msg)
                return
            # Reads go to the flash lane's own thread the moment a slot is free, and are announced
            # in the order they were read: the next read never waits for the last one's announcement.
            async with self.lanes.serial("flash", len(self.pool)) as reader:
                try:
                    await self._ring(reader)
                finally:  # before the lane's exit waits for its thread: no pass needs the read in progress
                    self.leaving.set()

    async def _ring(self, reader) -> None:
        """Read the stages in ring order as slots come back; announce each read in the order read."""
        async with trio.open_nursery() as nursery:
            ring = ((step, stage) for step in itertools.count() for stage in self.stages)

            def submit_free() -> None:
                while self.free:
                    slot = self.free.pop()
                    self.lent.add(slot)
                    step, stage = next(ring)
                    self.in_flight.append((step, stage, slot))
                    reader.submit(self._read, stage, slot)

            async def take_back_slots() -> None:
                async for msg in self.released_recv:
                    self._take_back(msg)
                    submit_free()

            submit_free()
            nursery.start_soon(take_back_slots)
            async for ok, out in reader.results:
                if not ok:
                    raise out
                io_s, fault, retryable = out
                step, stage, slot = self.in_flight.popleft()
                self.faults += bool(fault)
                self.bytes_read += stage.nbytes
                self.reads += 1
                self.direct = self.direct and self.files[stage.file].direct
                await self.ready_send.send(LayerReady(session_id=0, step=step, epoch=0, layer=stage.stage,
                                                      slot=slot, nbytes=stage.nbytes, io_s=io_s,
                                                      direct_io=self.files[stage.file].direct,
                                                      fault=fault, fault_retryable=retryable))

    def _check_files(self) -> None:
        for f in self.files.values():
            why = f.changed()
            if why:
                raise FlashFault(f"{why}: restart the daemon (or rerun) to load it again", retryable=False)


def _probe(data: memoryview) -> int:
    """A digest of the first, middle and last page of a region's bytes."""
    n = len(data)
    mid = max(0, n // 2 - PROBE // 2)
    return zlib.crc32(data[-PROBE:], zlib.crc32(data[mid:mid + PROBE], zlib.crc32(data[:PROBE])))

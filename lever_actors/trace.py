"""Chrome trace-event spans of every actor (open the JSON in Perfetto or chrome://tracing)."""
from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from contextlib import contextmanager

TRACE_FILE_EVENTS = 1_000_000  # a trace written to a file keeps a whole generation (about 200 MB at most)
LANES = {"flash": 1, "build": 2, "npu": 3, "cpu": 4, "accept": 5, "session": 6, "wait": 7}


class Tracer:
    """Collects complete ('X') events; cheap enough to leave on for a whole run.

    The events are a bounded ring (a daemon runs for days inside its DRAM budget: 16384 events,
    about 270 passes, take about 6 MB); ``--trace FILE`` asks for a longer one. What the
    statistics need for a whole generation, each lane's busy time, is kept as a running total
    instead, so it stays exact however many events the ring has forgotten.
    """

    def __init__(self, enabled: bool = True, max_events: int = 1 << 14) -> None:
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.events: deque[tuple] = deque(maxlen=max_events)  # (name, lane, start_s, end_s, args)
        self._busy: dict[str, float] = {}  # per lane: merged busy seconds of the intervals closed so far
        self._open: dict[str, list[float]] = {}  # per lane: the merged interval still growing
        self._lock = threading.Lock()  # spans are recorded from worker threads too

    def add(self, name: str, lane: str, start: float, end: float, **args) -> None:
        if not self.enabled:
            return
        end = max(end, start)
        with self._lock:
            self.events.append((name, lane, start - self.t0, end - self.t0, tuple(args.items()) if args else None))
            cur = self._open.get(lane)
            if cur is None or start > cur[1]:
                if cur is not None:
                    self._busy[lane] = self._busy.get(lane, 0.0) + cur[1] - cur[0]
                self._open[lane] = [start, end]
            else:  # overlaps the interval still open (spans of one lane may come from several threads)
                cur[0], cur[1] = min(cur[0], start), max(cur[1], end)

    @contextmanager
    def span(self, name: str, lane: str, **args):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, lane, start, time.perf_counter(), **args)

    def write(self, path: str) -> None:
        meta = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}}
                for lane, tid in LANES.items()]
        events = []
        for name, lane, s, e, args in self.snapshot():
            ev = {"name": name, "cat": lane, "ph": "X", "pid": 1, "tid": LANES.get(lane, 9),
                  "ts": s * 1e6, "dur": (e - s) * 1e6}
            if args:
                ev["args"] = dict(args)
            events.append(ev)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)

    def snapshot(self) -> list[tuple]:
        """A copy of the events; lanes keep appending from their threads while we read."""
        with self._lock:
            return list(self.events)

    def _merged(self, lanes, since_s: float = 0.0) -> list[tuple[float, float]]:
        iv = sorted((s, e) for _, lane, s, e, _ in self.snapshot() if lane in lanes and s >= since_s)
        out: list[list[float]] = []
        for s, e in iv:
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return [(s, e) for s, e in out]

    def busy(self, lane: str) -> float:
        """Total seconds of spans on ``lane`` so far (overlapping spans counted once): differences
        of two readings give a generation's share."""
        with self._lock:
            cur = self._open.get(lane)
            return self._busy.get(lane, 0.0) + (cur[1] - cur[0] if cur else 0.0)

    def overlap(self, lane: str, others: tuple[str, ...], since_s: float = 0.0) -> float:
        """Fraction of ``lane``'s busy time during which some lane in ``others`` was busy too (over
        the events the ring still holds)."""
        a, b = self._merged((lane,), since_s), self._merged(others, since_s)
        both, j = 0.0, 0
        for s, e in a:
            while j < len(b) and b[j][1] <= s:
                j += 1
            k = j
            while k < len(b) and b[k][0] < e:
                both += min(e, b[k][1]) - max(s, b[k][0])
                k += 1
        total = sum(e - s for s, e in a)
        return both / total if total > 0 else 1.0

    def now_s(self) -> float:
        return time.perf_counter() - self.t0

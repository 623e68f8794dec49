"""Chrome trace-event spans of every actor (open the JSON in Perfetto or chrome://tracing)."""
from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from contextlib import contextmanager

LANES = {"flash": 1, "build": 2, "npu": 3, "cpu": 4, "accept": 5, "session": 6, "wait": 7}


class Tracer:
    """Collects complete ('X') events; cheap enough to leave on for a whole run."""

    def __init__(self, enabled: bool = True, max_events: int = 500_000) -> None:
        self.enabled = enabled
        self.t0 = time.perf_counter()
        # bounded, so a long-running daemon keeps the recent past instead of growing forever
        self.events: deque[dict] = deque(maxlen=max_events)
        self._lock = threading.Lock()  # spans are recorded from worker threads too

    def add(self, name: str, lane: str, start: float, end: float, **args) -> None:
        if not self.enabled:
            return
        ev = {"name": name, "cat": lane, "ph": "X", "pid": 1, "tid": LANES.get(lane, 9),
              "ts": (start - self.t0) * 1e6, "dur": max(end - start, 0.0) * 1e6}
        if args:
            ev["args"] = args
        with self._lock:
            self.events.append(ev)

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
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": meta + self.snapshot(), "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)

    def snapshot(self) -> list[dict]:
        """A copy of the events; lanes keep appending from their threads while we read."""
        with self._lock:
            return list(self.events)

    def _merged(self, lanes, since: float = 0.0) -> list[tuple[float, float]]:
        iv = sorted((e["ts"], e["ts"] + e["dur"]) for e in self.snapshot() if e["cat"] in lanes and e["ts"] >= since)
        out: list[list[float]] = []
        for s, e in iv:
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return [(s, e) for s, e in out]

    def busy(self, lane: str, since_s: float = 0.0) -> float:
        """Total seconds of spans on ``lane`` (overlapping spans counted once)."""
        return sum(e - s for s, e in self._merged((lane,), since_s * 1e6)) / 1e6

    def overlap(self, lane: str, others: tuple[str, ...], since_s: float = 0.0) -> float:
        """Fraction of ``lane``'s busy time during which some lane in ``others`` was busy too."""
        a, b = self._merged((lane,), since_s * 1e6), self._merged(others, since_s * 1e6)
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

"""Chrome trace-event spans of every actor (open the JSON in Perfetto or chrome://tracing)."""
from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager

LANES = {"flash": 1, "build": 2, "npu": 3, "cpu": 4, "accept": 5, "session": 6}


class Tracer:
    """Collects complete ('X') events; cheap enough to leave on for a whole run."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.events: list[dict] = []
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
            json.dump({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)

    def busy(self, lane: str) -> float:
        """Total seconds of spans on ``lane`` (overlapping spans counted once)."""
        iv = sorted((e["ts"], e["ts"] + e["dur"]) for e in self.events if e["cat"] == lane)
        total, cur_s, cur_e = 0.0, None, None
        for s, e in iv:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            total += cur_e - cur_s
        return total / 1e6

"""tools/pass_breakdown.py: a pass's time beyond its reads, from trace events."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.pass_breakdown import passes, summary

TOOL = Path(__file__).resolve().parents[1] / "tools" / "pass_breakdown.py"


def span(name: str, ts_ms: float, dur_ms: float, **args) -> dict:
    return {"ph": "X", "name": name, "ts": ts_ms * 1e3, "dur": dur_ms * 1e3, "args": args}


def trace() -> list[dict]:
    """A prefill (0-100 ms), then two decode passes from 100 and 400 ms and a third from 650 ms."""
    ev = [span("prefill pass", 0, 99), span("layer 0", 1, 5), span("lm head 0", 90, 2, rows=1)]
    ev += [span("verify pass", 99.5, 290), span("layer 0", 100, 5), span("read 1", 100, 100), span("read 2", 200, 100),
           span("lm head 0", 300, 20, rows=9), span("lm head 1", 320, 20, rows=9), span("draft wait", 345, 50)]
    ev += [span("verify pass", 399.5, 240), span("layer 0", 400, 5), span("read 1", 400, 200),
           span("lm head 0", 610, 25, rows=6), span("draft wait", 640, 5)]
    ev += [span("verify pass", 649.5, 100), span("layer 0", 650, 5)]  # no successor: left out
    return ev


def test_decode_passes_run_from_their_first_layer_to_the_next_pass_s():
    rows = passes(trace())
    assert rows == [
        {"pass_ms": 300.0, "reads_ms": 200.0, "head_ms": 40.0, "head_rows": 9, "wait_ms": 50.0},
        {"pass_ms": 250.0, "reads_ms": 200.0, "head_ms": 25.0, "head_rows": 6, "wait_ms": 5.0},
    ]
    s = summary(rows, long_wait_ms=40)
    assert s["passes"] == 2 and s["long_waits"] == 1
    assert s["read_idle_share"] == pytest.approx(1 - 400 / 550)
    assert s["long_wait_share"] == pytest.approx(50 / 550) and s["short_wait_share"] == pytest.approx(5 / 550)
    assert s["head_share"] == pytest.approx(65 / 550) and s["head_rows"] == pytest.approx(7.5)
    assert summary([], 40) == {"passes": 0}


def test_the_tool_reads_trace_files_and_refuses_what_is_not_one(tmp_path):
    good = tmp_path / "t.json"
    good.write_text(json.dumps({"traceEvents": trace()}))
    out = subprocess.run([sys.executable, str(TOOL), str(good)], capture_output=True, text=True)
    assert out.returncode == 0 and "2 passes, 275 ms a pass" in out.stdout and "1 long" in out.stdout
    for i, text in enumerate(["[1, 2]", "{", json.dumps({"traceEvents": [1]}),
                              json.dumps({"traceEvents": [{"ph": "X", "name": "layer 0"}]})]):
        bad = tmp_path / f"bad{i}.json"
        bad.write_text(text)
        out = subprocess.run([sys.executable, str(TOOL), str(bad)], capture_output=True, text=True)
        assert out.returncode != 0 and "not a trace written by --trace" in out.stderr, text
    out = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "missing.json")], capture_output=True, text=True)
    assert out.returncode != 0 and "not a trace written by --trace" in out.stderr

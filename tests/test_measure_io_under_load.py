"""tools/measure_io_under_load.py: the read loop wraps around its file, and a load never outlives its measurement."""
import os

import pytest

from tools.measure_io_under_load import read_rate, with_load


def test_read_rate_wraps_around_the_file(tmp_path):
    path = tmp_path / "flash.bin"
    path.write_bytes(os.urandom(3 * 8192 + 100))  # a tail shorter than a request is never read
    rate, _ = read_rate(str(path), 7 * 8192, 8192)  # more than the file: the reads wrap around
    assert rate > 0
    with pytest.raises(ValueError, match="smaller than one request"):
        read_rate(str(path), 8192, 64 * 8192)


def test_a_load_runs_beside_the_measurement_and_is_gone_after_it():
    seen = []

    def measure():
        kids = [p for p in os.listdir("/proc") if p.isdigit() and _parent(p) == os.getpid()]
        seen.extend(kids)
        return "measured"

    assert with_load("spin", 1, measure) == "measured"
    assert len(seen) == 1
    assert not os.path.exists(f"/proc/{seen[0]}") or _state(seen[0]) == "Z"


def test_an_unknown_load_is_refused():
    with pytest.raises(KeyError):
        with_load("sleep", 1, lambda: None)


def _parent(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _state(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"

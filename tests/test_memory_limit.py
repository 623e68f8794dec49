"""``--dram-budget`` bounds the whole process, as the kernel counts it, inside real memory cgroups.

``generate`` and ``serve`` run inside a cgroup whose hard limit equals the budget (never
OOM-killed) and inside one at 1.25x the budget, where the process's peak resident set as the
kernel keeps it (``VmHWM``, which ``generate --json`` reports and the test reads from a daemon's
``/proc/PID/status``) must stay within the budget: a hard limit alone cannot
show an overrun, since the kernel reclaims before it kills. The roomy group's own peak
(``memory.peak``) is no such measure: it also counts the page cache the run's file reads leave
behind, which fills whatever room the group has (the real pair: 695 MiB of process memory and
up to 90 MiB of cache, a group peak of 768-788 MiB at 768). On the tiny pair always, on the real
pair when its wheels are installed. Skipped, with the reason, where no memory cgroup can be
created. These runs do not take the suite's models-only budgets (``LEVER_TEST_RUNTIME_BYTES``):
the runtime measures its own share.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from lever_actors.memory import MemoryCgroup, _own_cgroup_paths, cgroup_limit, peak_rss

_names = itertools.count()
ENV = {k: v for k, v in os.environ.items() if k != "LEVER_TEST_RUNTIME_BYTES"}
CLI = [sys.executable, "-m", "lever_actors"]


def cgroup(limit: int) -> MemoryCgroup:
    try:
        return MemoryCgroup(f"lever-test-{os.getpid()}-{next(_names)}", limit)
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup here: {e}")


def minimum_budget(target: Path, draft: Path, mode: str) -> int:
    """The smallest whole-process budget the planner accepts, from its own refusal."""
    p = subprocess.run(CLI + ["generate", "x", "--target", str(target), "--draft", str(draft), "--mode", mode,
                              "--dram-budget", "1", "--max-tokens", "1"], env=ENV, capture_output=True, text=True)
    m = re.search(r"at least ([\d,.]+) MiB", p.stderr)
    assert p.returncode != 0 and m, p.stderr
    assert "runtime" in p.stderr  # the refusal counts the runtime's own share
    return int(float(m.group(1).replace(",", "")) * 2**20) + 2**20


@dataclass
class Run:
    returncode: int
    stderr: str
    peak_rss: int  # bytes, the process's VmHWM as it reported it (0 if it failed)


def run_generate(cg: MemoryCgroup, target, draft, mode: str, budget: int, tokens: int = 24) -> Run:
    p = subprocess.run(CLI + ["generate", "def add(a, b):", "--target", str(target), "--draft", str(draft),
                              "--mode", mode, "--dram-budget", str(budget), "--max-tokens", str(tokens), "--json"],
                       env=ENV, capture_output=True, text=True, preexec_fn=cg.preexec, timeout=600)
    return Run(p.returncode, p.stderr, json.loads(p.stdout)["peak_rss_bytes"] if p.returncode == 0 else 0)


def serve_three(cg: MemoryCgroup, target, draft, mode: str, budget: int, tmp: Path) -> tuple[list[str], int]:
    """A daemon inside ``cg`` answers three requests in a row; returns their texts and the daemon's
    peak resident set in bytes."""
    from lever_actors.client import SyncClient

    sock = tmp / f"d{next(_names)}.sock"
    log = open(tmp / "daemon.log", "w")
    proc = subprocess.Popen(CLI + ["serve", "--socket", str(sock), "--target", str(target), "--draft", str(draft),
                                   "--mode", mode, "--dram-budget", str(budget)],
                            env=ENV, stdin=subprocess.DEVNULL, stdout=log, stderr=log, preexec_fn=cg.preexec)
    try:
        deadline = time.monotonic() + 300
        while not (sock.exists() and sock.with_suffix(".json").exists()):
            assert proc.poll() is None, (tmp / "daemon.log").read_text()
            assert time.monotonic() < deadline, "daemon did not start"
            time.sleep(0.1)
        texts = []
        with SyncClient(sock) as client:
            for i in range(3):
                texts.append(client.generate(prompt=f"def f{i}(x):", max_tokens=16).text)
        assert proc.poll() is None, (tmp / "daemon.log").read_text()
        return texts, peak_rss(proc.pid)  # the daemon is still running: its own high-water mark
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


@pytest.fixture(scope="module")
def tiny_budget(tiny_bundles) -> int:
    return minimum_budget(*tiny_bundles, "lever:8") + 8 * 2**20


def test_generate_is_never_oom_killed_at_a_limit_equal_to_its_budget(tiny_bundles, tiny_budget):
    with cgroup(tiny_budget) as cg:
        p = run_generate(cg, *tiny_bundles, "lever:8", tiny_budget)
        assert p.returncode == 0, p.stderr
        assert cg.oom_kills == 0


def test_generate_peak_stays_within_its_budget(tiny_bundles, tiny_budget):
    with cgroup(int(tiny_budget * 1.25)) as cg:
        p = run_generate(cg, *tiny_bundles, "lever:8", tiny_budget)
        assert p.returncode == 0, p.stderr
        assert 0 < p.peak_rss <= tiny_budget, (p.peak_rss, cg.peak, tiny_budget)


def test_serve_answers_three_requests_inside_its_budget(tiny_bundles, tiny_budget, tmp_path):
    with cgroup(int(tiny_budget * 1.25)) as cg:
        texts, peak = serve_three(cg, *tiny_bundles, "flash-chain:3", tiny_budget, tmp_path)
        assert len(texts) == 3 and all(isinstance(t, str) for t in texts)
        assert 0 < peak <= tiny_budget and cg.oom_kills == 0, (peak, cg.peak, tiny_budget)


def test_auto_budget_reads_the_cgroup_limit(tiny_bundles, tiny_budget):
    """``--dram-budget auto`` inside a cgroup plans with that cgroup's limit, and says so."""
    with cgroup(tiny_budget) as cg:
        p = subprocess.run(CLI + ["generate", "def add(a, b):", "--target", str(tiny_bundles[0]), "--draft",
                                  str(tiny_bundles[1]), "--mode", "lever:8", "--dram-budget", "auto",
                                  "--max-tokens", "8", "--json"],
                           env=ENV, capture_output=True, text=True, preexec_fn=cg.preexec, timeout=600)
        assert p.returncode == 0, p.stderr
        assert cg.oom_kills == 0
    import json

    stats = json.loads(p.stdout)["stats"]
    assert stats["budget_source"].startswith("auto: cgroup v")
    assert f"of {tiny_budget / 2**20:,.0f} MiB" in stats["budget"]  # planned with the cgroup's limit


def test_peak_rss_is_a_process_high_water_mark_since_its_exec():
    """``peak_rss`` reads the kernel's high-water mark of a process since its exec: it counts what
    the process touched even after it let go, and a child forked from a large parent and exec'd
    starts from its own pages (``wait4``'s ``ru_maxrss`` would keep the parent's, from before the exec)."""
    touch = "b = bytearray(96 * 2**20); b[::4096] = b'x' * len(b[::4096]); del b; "

    def child_peak(code: str = "") -> int:
        out = subprocess.run([sys.executable, "-c", "from lever_actors import memory; "  # imported before the code runs
                              f"{code}print(memory.peak_rss())"],
                             capture_output=True, text=True, check=True, preexec_fn=lambda: None)  # forked
        return int(out.stdout)

    ballast = bytearray(256 * 2**20)
    ballast[::4096] = b"x" * len(ballast[::4096])  # this process, touched: far larger than a child
    small, large = child_peak(), child_peak(touch)
    assert peak_rss() > 256 * 2**20 > small > 0
    assert large >= small + 90 * 2**20  # the freed buffer still counts: a peak, not the current size
    del ballast
    # after a setup step (the first run's conversion) the mark starts again from the present size,
    # and the setup's own peak is kept to be reported apart
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("/proc/self/clear_refs cannot be written here: the mark cannot be restarted")
    out = subprocess.run([sys.executable, "-c", "from lever_actors import memory; " + touch
                          + "memory.reset_peak_rss(); print(memory.setup_peak_rss(), memory.peak_rss())"],
                         capture_output=True, text=True, check=True)
    setup, reset = map(int, out.stdout.split())
    assert setup >= small + 90 * 2**20 and 0 < reset < small + 32 * 2**20


def test_cgroup_paths_and_limits_are_read_for_both_versions(tmp_path):
    assert _own_cgroup_paths("12:memory:/a/b\n0::/c\n") == ("/c", "/a/b")
    (tmp_path / "memory" / "a" / "b").mkdir(parents=True)
    (tmp_path / "memory" / "a" / "memory.limit_in_bytes").write_text("1000\n")
    (tmp_path / "memory" / "a" / "b" / "memory.limit_in_bytes").write_text(str(1 << 62))  # v1's "no limit"
    assert cgroup_limit(tmp_path, "12:memory:/a/b\n") == (1000, f"cgroup v1 {tmp_path}/memory/a/memory.limit_in_bytes")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "memory.max").write_text("max\n")
    assert cgroup_limit(tmp_path, "0::/c\n") is None
    (tmp_path / "c" / "memory.max").write_text("5000\n")
    assert cgroup_limit(tmp_path, "0::/c\n")[0] == 5000


def test_the_real_pair_runs_inside_768_mib(real_bundles, tmp_path):
    """The standard setting as the OS counts it: ``lever`` at 768 MiB, generate and serve."""
    budget = 768 * 2**20
    with cgroup(budget) as cg:
        p = run_generate(cg, *real_bundles, "lever", budget, tokens=16)
        assert p.returncode == 0, p.stderr
        assert cg.oom_kills == 0
    with cgroup(int(budget * 1.25)) as cg:
        texts, peak = serve_three(cg, *real_bundles, "lever", budget, tmp_path)
        assert len(texts) == 3
        assert 0 < peak <= budget and cg.oom_kills == 0, (peak, cg.peak, budget)


def test_bench_measures_the_runtime_once_before_any_pipeline_loads(tiny_bundles, tiny_budget, tmp_path):
    """resident-ar loads the whole target first; the flash modes after it are still planned as if
    alone (their runtime share is the process before any model, not after resident-ar's)."""
    import json

    out = tmp_path / "b.json"
    p = subprocess.run(CLI + ["bench", "--target", str(tiny_bundles[0]), "--draft", str(tiny_bundles[1]),
                              "--modes", "resident-ar,flash-ar,lever:8", "--dram-budget", str(tiny_budget),
                              "--humaneval", "0:1", "--max-tokens", "4", "--warmup", "0", "--json", str(out)],
                       env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    plans = {m: r["plan"]["budget"] for m, r in json.loads(out.read_text())["modes"].items()}
    runtime = {m: re.search(r"runtime ([\d.,]+ MiB)", b).group(1) for m, b in plans.items() if m != "resident-ar"}
    assert len(set(runtime.values())) == 1, runtime


def test_bench_counts_the_tokenizer_in_the_runtime_as_generate_and_serve_do(tiny_bundles, monkeypatch):
    """generate and serve load the tokenizer (48 MiB for the real pair) before the runtime's RSS is
    measured; bench once measured it first, so it planned every flash mode with that much more than a
    real process has."""
    import types

    import trio

    from lever_actors import bench, memory
    from lever_actors.engine import EngineConfig

    calls, real_tokenizer = [], bench.load_tokenizer

    class Measured(Exception):
        pass

    def tokenizer(path):
        calls.append("tokenizer")
        return real_tokenizer(path)

    def baseline():
        calls.append("runtime")
        raise Measured

    monkeypatch.setattr(bench, "load_tokenizer", tokenizer)
    monkeypatch.setattr(memory, "runtime_baseline", baseline)
    args = types.SimpleNamespace(target=str(tiny_bundles[0]), draft=str(tiny_bundles[1]), max_tokens=4,
                                 dram_budget=None, flash_bandwidth=None)
    with pytest.raises(Measured):
        trio.run(bench._bench, {"lever": EngineConfig().with_mode("lever:8")}, [], None, args)
    assert calls == ["tokenizer", "runtime"]


IMPORTED_AT_BASELINE = """
import sys
from lever_actors import memory
real = memory.runtime_baseline
def baseline():
    print("onnxruntime at baseline:", "onnxruntime" in sys.modules, file=sys.stderr)
    return real()
memory.runtime_baseline = baseline
from lever_actors.cli import main
code = main(sys.argv[1:])
print("onnxruntime at exit:", "onnxruntime" in sys.modules, file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.parametrize("ort_draft", [False, True])
def test_onnxruntime_is_loaded_only_for_ort_bundles_and_then_counted(tiny_bundles, tiny_ort_draft, tiny_budget,
                                                                      ort_draft):
    """Native bundles never run an ORT session, so its ~20 MiB of imports stay out of the process
    (they go to pinned layers); an ORT-layout draft needs it, and it is imported before the runtime's
    baseline is measured, so the budget counts it."""
    draft = tiny_ort_draft if ort_draft else tiny_bundles[1]
    p = subprocess.run([sys.executable, "-c", IMPORTED_AT_BASELINE, "generate", "def f(", "--target",
                        str(tiny_bundles[0]), "--draft", str(draft), "--mode", "lever:8", "--dram-budget",
                        str(tiny_budget + 64 * 2**20), "--max-tokens", "4"], env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert f"onnxruntime at baseline: {ort_draft}" in p.stderr, p.stderr
    assert f"onnxruntime at exit: {ort_draft}" in p.stderr, p.stderr

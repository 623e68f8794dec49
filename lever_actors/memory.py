"""The process as the OS counts it: resident memory, the enclosing cgroup's limit, giving memory back.

``--dram-budget`` bounds the whole process, so the planner counts what the
runtime takes for itself (interpreter, numpy, onnxruntime, the tokenizer: the
baseline, measured once at start-up before any model loads) and keeps headroom
for transient allocations. ``--dram-budget auto`` takes the enclosing cgroup's
limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), or a stated share of
MemAvailable where there is none.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
AUTO_SHARE = 0.5  # of MemAvailable, when no cgroup limit encloses the process
UNLIMITED_V1 = 1 << 60  # v1 reports "no limit" as a huge page-aligned number
# Transient allocations beyond the planned line items (numpy temporaries of a pass, msgpack
# frames, the tokenizer's work, the allocator's own slack). It was 64 MiB while the drafter's
# activations were left to it; with those planned (runtime.draft_activation_bytes, 24 MiB at a
# 1024-token context), the real pair's peak under a 768 MiB budget stayed 32 MiB below the budget
# sampled and 64 MiB greedy (docs/memory-cap-dec04d.json): 40 MiB keeps that margin and more. With
# the activation lines counting what the native kernels hold (7.9 MiB for the drafter), the peaks
# stayed 49-64 MiB below 768 MiB (docs/memory-cap-768-600-dec07b.json).
HEADROOM = 40 * 2**20

_baseline: int | None = None


def process_rss() -> int:
    """Resident set size of this process in bytes (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def runtime_baseline() -> int:
    """The runtime's own memory: this process's RSS the first time it is asked (before models load).

    ``LEVER_TEST_RUNTIME_BYTES`` replaces the measurement; the test suite sets it to 0 so that
    its tiny budgets count the tiny models alone (the memory-limit tests run without it).
    """
    global _baseline
    if _baseline is None:
        forced = os.environ.get("LEVER_TEST_RUNTIME_BYTES")
        if forced is not None:
            _baseline = int(forced)
        else:
            release_memory()
            _baseline = process_rss()
    return _baseline


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, looked up once (``find_library`` runs a subprocess), or None."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


def release_memory() -> None:
    """Hand freed heap back to the OS (glibc keeps freed arenas otherwise)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _own_cgroup_paths(proc_cgroup: str) -> tuple[str | None, str | None]:
    """(v2 path, v1 memory-controller path) of this process from ``/proc/self/cgroup`` text."""
    v2 = v1 = None
    for line in proc_cgroup.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def cgroup_limit(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> tuple[int, str] | None:
    """(bytes, where it came from) of the tightest memory limit enclosing this process, or None."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    v2, v1 = _own_cgroup_paths(proc_cgroup)
    found: list[tuple[int, str]] = []
    if v1 is not None:  # v1: the group and its ancestors each may cap
        base = root / "memory"
        for p in _ancestors(base, v1):
            value = _read_int(p / "memory.limit_in_bytes")
            if value is not None and value < UNLIMITED_V1:
                found.append((value, f"cgroup v1 {p / 'memory.limit_in_bytes'}"))
    if v2 is not None:
        for p in _ancestors(root, v2):
            value = _read_int(p / "memory.max")
            if value is not None:
                found.append((value, f"cgroup v2 {p / 'memory.max'}"))
    return min(found) if found else None


def _ancestors(base: Path, path: str) -> list[Path]:
    parts = [p for p in path.split("/") if p]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2 "max" means no limit


def mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def auto_budget() -> tuple[int, str]:
    """``--dram-budget auto``: the enclosing cgroup's limit, else a share of MemAvailable."""
    limit = cgroup_limit()
    if limit is not None:
        return limit
    avail = mem_available()
    if avail is None:
        from lever_actors.errors import ConfigError

        raise ConfigError("--dram-budget auto: no cgroup memory limit and no MemAvailable in /proc/meminfo; "
                          "give a size such as 768MiB")
    return int(avail * AUTO_SHARE), f"{AUTO_SHARE:.0%} of MemAvailable ({avail / 2**20:,.0f} MiB)"


def peak_rss(pid: int | str = "self") -> int:
    """Peak resident set size of a process in bytes (``VmHWM`` of ``/proc/PID/status``).

    Counted for the process's own memory since its last exec: anonymous pages and the file pages it
    maps, without the page cache its cgroup is also charged for. (``wait4``'s ``ru_maxrss`` is no
    substitute: it also keeps the high-water mark from before the exec, which for a child forked
    from a large parent is the parent's.)"""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    raise OSError(f"/proc/{pid}/status has no VmHWM line")


def peak_rss_or_none(pid: int | str = "self") -> int | None:
    """:func:`peak_rss`, or None where ``/proc`` does not say (the caller reports no peak)."""
    try:
        return peak_rss(pid)
    except OSError:
        return None


_setup_peak: int | None = None  # the high-water mark before the last reset_peak_rss


def reset_peak_rss() -> None:
    """Start this process's high-water mark (``VmHWM``) again from its present size (Linux's
    ``clear_refs`` 5; nothing where that is missing), keeping the mark so far for
    ``setup_peak_rss``. Called after a one-time setup step, the models' conversion on a first run,
    which ``--dram-budget`` does not bound (``lever-actors models fetch`` does it ahead): the
    serving process's peak and the setup's are then reported apart."""
    global _setup_peak
    try:
        peak = peak_rss()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return
    _setup_peak = max(_setup_peak or 0, peak)


def setup_peak_rss() -> int | None:
    """The high-water mark a ``reset_peak_rss`` set aside (bytes), or None if there was none."""
    return _setup_peak


class MemoryCgroup:
    """A child memory cgroup with a hard limit, for running a process inside a cap (tests and tools).

    Uses the v1 memory controller where it is mounted (``/sys/fs/cgroup/memory``), else v2
    (``/sys/fs/cgroup`` with ``memory`` in the root's ``cgroup.subtree_control``). ``preexec``
    moves a child into the group before it execs; ``peak`` and ``oom_kills`` read what the kernel
    counted; ``close`` removes the group. Raises OSError with the reason when neither can be made.
    """

    def __init__(self, name: str, limit: int, root: Path = CGROUP_ROOT) -> None:
        self.limit = limit
        v1 = root / "memory"
        if (v1 / "memory.limit_in_bytes").exists():
            self.version, self.path = 1, v1 / name
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            swap = self.path / "memory.memsw.limit_in_bytes"
            if swap.exists():  # no escape into swap either
                swap.write_text(str(limit))
        elif (root / "cgroup.controllers").exists() and "memory" in (root / "cgroup.controllers").read_text().split():
            sub = root / "cgroup.subtree_control"
            if "memory" not in sub.read_text().split():
                sub.write_text("+memory")
            self.version, self.path = 2, root / name
            self.path.mkdir()
            (self.path / "memory.max").write_text(str(limit))
            if (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0")
        else:
            raise OSError("no memory cgroup controller (neither v1 at /sys/fs/cgroup/memory nor v2) can be used")

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def preexec(self) -> None:
        """For ``subprocess.Popen(preexec_fn=...)``: the child joins before it execs."""
        self.add(os.getpid())

    @property
    def peak(self) -> int:
        """The most memory the group was charged (RSS and page cache), in bytes.

        The page cache part is whatever the group's file reads left cached (the interpreter's
        modules, the tokenizer, the draft as it loads), up to the limit: the kernel reclaims it
        before it would kill, so in a roomy group this peak can pass the budget while the process's
        own memory does not. ``peak_rss`` reads the latter."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        return int((self.path / name).read_text().split()[0])

    @property
    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def close(self) -> None:
        procs = self.path / "cgroup.procs"
        if procs.exists() and procs.read_text().split():
            raise OSError(f"{self.path} still holds processes")
        self.path.rmdir()

    def __enter__(self) -> "MemoryCgroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

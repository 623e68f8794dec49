"""lever against llama.cpp's own speculative decoding, both under the same memory cap.

    python tools/peer_llamacpp.py --cap 768MiB --humaneval 100:105 --max-tokens 64 \\
        --json docs/peer-llamacpp-768.json --plot docs/peer-llamacpp-768.png

    python tools/peer_llamacpp.py --cap 1GiB --prompts my.jsonl --max-tokens 64 --json out.json

    # a machine others use: private model copies, runs made again while others keep the CPUs busy
    LEVER_HOME=/tmp/peer-home python tools/peer_llamacpp.py --cap 768MiB --humaneval 100:105 \
        --max-cpu-wait 0.35 --build-dir ~/.cache/lever-actors/llamacpp --json out.json

What runs. For every prompt, in this order (prompt by prompt, so machine noise hits every
setting alike): ``lever-actors generate --mode lever --dram-budget auto``, then llama.cpp's
``llama-speculative`` with ``--spec-draft-n-max`` 8, 16 and 32 (``--draft-max``), then
``llama-completion`` with the target alone (``--no-target-alone`` skips it). All are greedy, use
the same threads (``--threads``, default 2) and the same Qwen2.5-Coder 1.5B/0.5B pair: llama.cpp
reads the GGUF files under ``$LEVER_HOME/gguf``, lever the bundles converted from them under
``$LEVER_HOME/bundles`` (``lever-actors models fetch`` makes both). Held-out HumanEval problems are
80-163 (0-79 are the development set).

Fairness. Each run is its own process in its own fresh memory cgroup (``lever_actors.memory
.MemoryCgroup``) limited to ``--cap``, swap included; lever's ``--dram-budget auto`` reads that
limit. Before every run the model files of both engines are dropped from the page cache
(``POSIX_FADV_DONTNEED``), so no run starts with weights another left behind. llama.cpp runs with
``--no-repack`` (a repacked copy is anonymous memory: under a cap it cannot be dropped and read
again the way the mmapped file can), ``--no-escape`` (a prompt's backslashes stay as written),
``-p`` (``-f`` drops the prompt's final newline), ``--fit off`` and ``-c`` = lever's context (1024:
llama.cpp's default takes the model's 32K context, whose KV cache alone would not fit the cap).

What is measured, per run:
  * decode tokens/s, excluding model load and prompt prefill on both sides. lever: its JSON's
    ``timings.decode_s`` and returned tokens. llama-speculative: the "decoded N tokens in T
    seconds" line; it is run with ``-n max_tokens - 1`` because it stops only once it has *more*
    than ``-n``, which is lever's rule (stop once ``--max-tokens`` are out), and tokens past
    ``--max-tokens`` that its last pass accepted are not counted (lever trims them too).
    llama-completion: its "eval time = X ms / R runs" line, one token per run plus the first,
    which it samples from the prefill (as the other two do, and count).
  * tokens per target pass: the tokens after the first (which every engine samples from the
    prefill's logits) / target passes during decode, so the target alone makes exactly 1.
    lever: ``stats.passes``; llama-completion: its runs.
    llama-speculative prints no pass count; every loop iteration emits its accepted draft tokens
    plus one target token and, except the last, ends in one target pass, and the first samples
    from the prefill, so passes = n_predict - n_accept - 1 (checked against its debug log, which
    prints one "draft 0: [...]" line per pass).
  * bytes read from storage per token: the process's ``read_bytes`` in ``/proc/PID/io`` (what it
    made the kernel fetch from the block device, mmap faults and O_DIRECT reads alike) over its
    whole life (load and prefill included) divided by its tokens. It is read at the moment of
    exit: ``waitid(WEXITED | WNOWAIT)`` waits for the exit but leaves the process a zombie, whose
    ``/proc/PID/io`` holds the final totals of all its threads, and only then is it reaped. lever's
    own decode-only count (``stats.flash_bytes_read``) is kept beside it.
  * CPU contention: the share of the run's wall time in which some runnable task on the machine
    waited for a CPU (``/proc/pressure/cpu``, "some"). The engine's own threads count too, but on a
    shared machine a high value says others were busy. llama.cpp's threads meet at a barrier after
    every op, so it slows down far more than its share when a core is taken (measured here: about
    4 tokens/s alone, 0.3-0.8 beside a process holding one of the two cores; lever 6 -> 4).
  * peak memory: the cgroup's ``memory.max_usage_in_bytes`` (v1) or ``memory.peak`` (v2), which
    counts page cache as well as anonymous memory (llama.cpp's mmapped weights are page cache);
    OOM kills from ``memory.oom_control`` / ``memory.events``; the exit code.

Shared machines. A page another process holds (cached for itself, or mapped) is charged to that
process's cgroup, survives the eviction and is not read again: a run then looks faster than the cap
allows. A clean run that read less than the target's weights once is therefore marked ``warm`` and
left out of the figures; on a machine where others use the same model files, point ``LEVER_HOME``
at a private copy of ``gguf/`` and ``bundles/``. llama.cpp's logger writes from a thread that exit
does not wait for, so a clean exit can lose the closing report; such a run is made again
(``attempts`` counts the tries, ``--attempts`` caps them). So is, with ``--max-cpu-wait F``, a run
during which some task waited for a CPU for more than the share F of its time (the CPU contention
above; lever's own lanes alone make 20-26% on two cores, llama.cpp alone 4-8%); a run that never meets it keeps its last attempt and says how busy the machine was.

A setting's figures pool its successful runs: tokens/s = total tokens / total decode seconds,
tokens/pass = total tokens after the first / total passes, bytes/token = total bytes read / total
tokens, CPU wait = its share of their summed wall time; peak is the largest and OOM kills the sum
over all its runs.

Output JSON (rewritten after every prompt, so a crash keeps the finished ones)::

    {"cap": "768MiB", "cap_bytes": int, "max_tokens": int, "threads": int, "context": int,
     "max_cpu_wait": float | null,
     "prompts": {"source": "humaneval 100:105" | "FILE.jsonl", "ids": [int, ...]},
     "models": {"target_gguf": path, "draft_gguf": path, "target_bundle": path, "draft_bundle": path},
     "llamacpp_build": {"dir": path, "llama_cpp_python": "0.3.36"},
     "lever_source": {"package": path, "commit": sha | null, "modified": [tracked files edited] | null},
     "complete": bool,                    # false while prompts are still to come
     "lever": SETTING,
     "llamacpp": {"settings": {"draft-max-8": SETTING, ...},
                  "best": SETTING + {"setting": "draft-max-K"},   # highest tokens/s of them
                  "target_alone": SETTING | null},
     "ratio": float | null,               # lever.tokens_per_s / llamacpp.best.tokens_per_s
     "ratio_vs_target_alone": float | null,
     "runs": [RUN, ...]}
    SETTING = {"runs", "failed", "warm", "tokens", "decode_s", "tokens_per_s", "passes", "tokens_per_pass",
               "read_bytes", "read_bytes_per_token", "peak_bytes", "oom_kills", "cpu_pressure"}
    RUN = {"prompt", "setting", "exit_code", "timed_out", "oom_kills", "peak_bytes", "read_bytes",
           "wall_s", "cpu_pressure", "tokens", "decode_s", "tokens_per_s", "passes", "tokens_per_pass",
           "read_bytes_per_token", "prompt_tokens", "warm", "attempts", "detail": {engine-specific counters},
           "error": last lines of stderr (failed runs only)}

Build. The llama.cpp binaries come from the llama.cpp that the pinned llama-cpp-python 0.3.36
sdist vendors (``pip download --no-binary :all:``), configured with CMake and compiled once into
``--build-dir`` (default ``$LEVER_HOME/llamacpp``; ``DIR/llama_cpp_python-0.3.36`` holds the
source, ``DIR/build/bin`` the binaries). Existing binaries are reused. Compiling takes several
minutes on two cores and needs cmake and a C/C++ compiler (ninja is used when present).

Needs root (or a delegated cgroup) to create memory cgroups, and matplotlib for ``--plot``.
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA_CPP_PYTHON = "0.3.36"
BINARIES = ("llama-speculative", "llama-completion")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_NATIVE=ON")
TARGET_ALONE = "target-alone"
ERROR_TAIL = 1500  # characters of a failed run's stderr kept in the JSON


class PeerError(Exception):
    """A problem the user can fix (missing tool, file, model, permission): printed without a traceback."""


# -- building llama.cpp -----------------------------------------------------------------------------


def binary_paths(build_dir: Path) -> dict[str, Path]:
    return {name: build_dir / "build" / "bin" / name for name in BINARIES}


def ensure_build(build_dir: Path) -> dict[str, Path]:
    """The llama.cpp binaries in ``build_dir``, compiled first if any is missing (resumes a partial build)."""
    bins = binary_paths(build_dir)
    if all(p.is_file() for p in bins.values()):
        return bins
    cmake = shutil.which("cmake")
    has_cc = any(shutil.which(c) for c in ("cc", "gcc", "clang"))
    has_cxx = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
    if cmake is None or not (has_cc and has_cxx):
        raise PeerError("building llama.cpp needs cmake and a C/C++ compiler, e.g. "
                        "apt-get install cmake build-essential (or pass --build-dir with a finished build)")
    source = unpack_sdist(build_dir) / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        raise PeerError(f"{source} holds no CMakeLists.txt: the sdist does not vendor llama.cpp as expected")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    say(f"configuring llama.cpp from {source}")
    run_build_step([cmake, "-S", str(source), "-B", str(build_dir / "build"), *generator, *CMAKE_FLAGS])
    say(f"compiling {', '.join(BINARIES)} on {os.cpu_count()} cores (several minutes; output follows)")
    run_build_step([cmake, "--build", str(build_dir / "build"), "--target", *BINARIES, "-j", str(os.cpu_count() or 1)])
    missing = [str(p) for p in bins.values() if not p.is_file()]
    if missing:
        raise PeerError(f"the build finished but left no {', '.join(missing)}")
    return bins


def unpack_sdist(build_dir: Path) -> Path:
    """``build_dir/llama_cpp_python-VERSION``, downloaded with pip and extracted if not there yet."""
    tree = build_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    if (tree / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        return tree
    sdist_dir = build_dir / "sdist"
    archive = sdist_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not archive.is_file():
        say(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist into {sdist_dir}")
        run_build_step([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(sdist_dir)])
    if not archive.is_file():
        raise PeerError(f"pip left no {archive}")
    say(f"extracting {archive.name}")
    with tarfile.open(archive) as tar:
        # the "data" filter refuses members that would land outside build_dir (Python >= 3.11.4)
        tar.extractall(build_dir, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return tree


def run_build_step(cmd: list[str]) -> None:
    """Run one build command with its output on stderr (the progress the user watches)."""
    rc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr).returncode
    if rc != 0:
        raise PeerError(f"build step failed (exit {rc}): {' '.join(cmd)}")


# -- one capped run ---------------------------------------------------------------------------------


@dataclass
class Measured:
    """What the kernel and the process said about one run."""

    exit_code: int
    timed_out: bool
    peak_bytes: int
    oom_kills: int
    read_bytes: int | None
    wall_s: float
    cpu_pressure: float | None
    stdout: str
    stderr: str


_group_names = itertools.count()


def new_cgroup(cap: int):
    """A fresh memory cgroup limited to ``cap``; PeerError with the kernel's reason if none can be made."""
    from lever_actors.memory import MemoryCgroup

    try:
        return MemoryCgroup(f"peer-llamacpp-{os.getpid()}-{next(_group_names)}", cap)
    except OSError as e:
        raise PeerError(f"cannot create a memory cgroup ({e}); this tool needs root or a delegated cgroup, "
                        "with the v1 memory controller at /sys/fs/cgroup/memory or cgroup v2") from None


def run_capped(cmd: list[str], cap: int, timeout: float, env: dict[str, str] | None = None) -> Measured:
    """Run ``cmd`` alone in a new cgroup limited to ``cap``; a run past ``timeout`` seconds is killed."""
    cg = new_cgroup(cap)
    try:
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            stall0, t0 = cpu_stall_us(), time.perf_counter()
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                    preexec_fn=cg.preexec)
            fired = threading.Event()
            killer = threading.Timer(timeout, lambda: (fired.set(), proc.kill()))
            killer.start()
            try:
                read_bytes = read_bytes_at_exit(proc.pid)
                rc = proc.wait()
            except BaseException:  # e.g. Ctrl-C: leave no process behind in the group
                proc.kill()
                proc.wait()
                raise
            finally:
                killer.cancel()
            wall, stall1 = time.perf_counter() - t0, cpu_stall_us()
            pressure = (stall1 - stall0) / 1e6 / wall if stall0 is not None and stall1 is not None else None
            out.seek(0)
            err.seek(0)
            return Measured(rc, fired.is_set(), cg.peak, cg.oom_kills, read_bytes, wall, pressure,
                            out.read(), err.read())
    finally:
        close_cgroup(cg)


def read_bytes_at_exit(pid: int) -> int | None:
    """Block until ``pid`` exits, leaving it unreaped, and return its ``read_bytes`` total.

    A zombie's ``/proc/PID/io`` holds the summed counters of all its threads as they stood at exit,
    so this is the exact final figure, with no polling interval to lose reads in.
    """
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    try:
        return parse_proc_io(Path(f"/proc/{pid}/io").read_text())["read_bytes"]
    except (OSError, KeyError):
        return None


def parse_proc_io(text: str) -> dict[str, int]:
    """``/proc/PID/io`` text -> {"rchar": ..., "read_bytes": ..., ...}."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if value.strip().isdigit():
            out[key.strip()] = int(value)
    return out


def cpu_stall_us() -> int | None:
    """Microseconds since boot in which some runnable task waited for a CPU, or None without PSI."""
    try:
        return parse_psi_total(Path("/proc/pressure/cpu").read_text())
    except OSError:
        return None


def parse_psi_total(text: str) -> int | None:
    """The "some" line's ``total=`` of a ``/proc/pressure/*`` file."""
    for line in text.splitlines():
        kind, *fields = line.split()
        if kind == "some":
            return int(dict(f.split("=", 1) for f in fields)["total"])
    return None


def close_cgroup(cg) -> None:
    """Remove the group; the kernel may list a just-reaped process for a moment, so retry briefly."""
    for _ in range(50):
        try:
            cg.close()
            return
        except OSError:
            time.sleep(0.1)
    say(f"warning: could not remove {cg.path}")


def evict(paths: list[Path]) -> None:
    """Drop ``paths`` from the page cache, so that the next run reads its weights from storage."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- the engines: commands and what their output says -----------------------------------------------


@dataclass(frozen=True)
class Job:
    """Everything one run needs besides its setting."""

    prompt: str
    prompt_file: Path  # the same text, for lever's --prompt-file
    max_tokens: int
    threads: int
    context: int
    target_gguf: Path
    draft_gguf: Path


def lever_cmd(job: Job) -> list[str]:
    return [sys.executable, "-m", "lever_actors", "generate", "--prompt-file", str(job.prompt_file),
            "--mode", "lever", "--dram-budget", "auto", "--max-tokens", str(job.max_tokens),
            "--threads", str(job.threads), "--context", str(job.context), "--json"]


def llama_common(job: Job) -> list[str]:
    return ["-p", job.prompt, "--temp", "0", "-s", "0", "-t", str(job.threads), "-c", str(job.context),
            "--no-repack", "--no-escape", "--fit", "off"]


def speculative_cmd(binary: Path, job: Job, draft_max: int) -> list[str]:
    # -n one short: llama-speculative stops once it has more than -n tokens (see the module docstring)
    return [str(binary), "-m", str(job.target_gguf), "-md", str(job.draft_gguf), "-td", str(job.threads),
            "--spec-draft-n-max", str(draft_max), "-n", str(max(job.max_tokens - 1, 0)), *llama_common(job)]


def completion_cmd(binary: Path, job: Job) -> list[str]:
    return [str(binary), "-m", str(job.target_gguf), "-n", str(job.max_tokens), "-no-cnv", *llama_common(job)]


def _grab(pattern: str, text: str, what: str) -> re.Match:
    m = re.search(pattern, text, re.MULTILINE)
    if m is None:
        raise ValueError(f"no {what} line in the output")
    return m


def parse_lever(stdout: str, max_tokens: int) -> dict:
    """Figures of ``lever-actors generate --json`` output."""
    obj = json.loads(stdout.strip().splitlines()[-1])
    stats, timings = obj["stats"], obj["timings"]
    tokens = min(len(obj["token_ids"]), max_tokens)
    return {"tokens": tokens, "decode_s": timings["decode_s"], "passes": stats["passes"],
            "prompt_tokens": len(obj["prompt_token_ids"]),
            "detail": {"flash_bytes_read": stats.get("flash_bytes_read"), "draft_n": stats.get("draft_n"),
                       "draft_n_accepted": stats.get("draft_n_accepted"), "mode": obj.get("mode"),
                       "finish_reason": obj.get("finish_reason"), "load_s": timings.get("load_s"),
                       "prefill_s": timings.get("prefill_s")}}


def parse_speculative(stderr: str, max_tokens: int) -> dict:
    """Figures of ``llama-speculative``'s closing report (stderr)."""
    dec = _grab(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", stderr, "'decoded N tokens'")
    enc = _grab(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", stderr, "'encoded N tokens'")
    count = {k: int(_grab(rf"\b{k}\s*=\s*(\d+)", stderr, k).group(1)) for k in ("n_predict", "n_drafted", "n_accept")}
    return {"tokens": min(int(dec.group(1)), max_tokens), "decode_s": float(dec.group(2)),
            "passes": count["n_predict"] - count["n_accept"] - 1, "prompt_tokens": int(enc.group(1)),
            "detail": {**count, "prefill_s": float(enc.group(2))}}


def parse_completion(stderr: str, max_tokens: int) -> dict:
    """Figures of ``llama-completion``'s perf report (stderr): single-token decode runs and their time."""
    ev = _grab(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", stderr, "'eval time = X ms / R runs'")
    pe = _grab(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", stderr, "'prompt eval time'")
    runs = int(ev.group(2))
    # the first token is sampled from the prefill's logits, as in the other two engines' counts
    return {"tokens": min(runs + 1, max_tokens), "decode_s": float(ev.group(1)) / 1e3, "passes": runs,
            "prompt_tokens": int(pe.group(2)), "detail": {"prefill_s": float(pe.group(1)) / 1e3}}


def make_record(prompt_id: int, setting: str, m: Measured, parse, stream: str, max_tokens: int) -> dict:
    """One run's JSON record: the kernel's figures, and the engine's (``parse`` of its ``stream``,
    "stdout" or "stderr") when it exited cleanly."""
    rec = {"prompt": prompt_id, "setting": setting, "exit_code": m.exit_code, "timed_out": m.timed_out,
           "oom_kills": m.oom_kills, "peak_bytes": m.peak_bytes, "read_bytes": m.read_bytes,
           "wall_s": round(m.wall_s, 3), "cpu_pressure": m.cpu_pressure, "tokens": 0, "decode_s": None,
           "tokens_per_s": None, "passes": None,
           "tokens_per_pass": None, "read_bytes_per_token": None, "prompt_tokens": None, "warm": False,
           "attempts": 1, "detail": {}}
    if m.exit_code == 0:
        try:
            rec.update(parse(getattr(m, stream), max_tokens))
        except (ValueError, KeyError, IndexError) as e:  # json.JSONDecodeError is a ValueError
            rec["error"] = f"unreadable output: {e}\n" + m.stderr[-ERROR_TAIL:]
            return rec
        t = rec["tokens"]
        rec["tokens_per_s"] = t / rec["decode_s"] if rec["decode_s"] else None
        rec["tokens_per_pass"] = (t - 1) / rec["passes"] if rec["passes"] else None
        rec["read_bytes_per_token"] = m.read_bytes / t if t and m.read_bytes is not None else None
    else:
        rec["error"] = m.stderr[-ERROR_TAIL:]
    return rec


# -- the report -------------------------------------------------------------------------------------


def clean(rec: dict) -> bool:
    """The run exited normally and its figures could be read."""
    return rec["exit_code"] == 0 and rec["tokens"] > 0 and bool(rec["decode_s"]) and "error" not in rec


def ok(rec: dict) -> bool:
    """A clean run that read its weights from storage: one that counts."""
    return clean(rec) and not rec["warm"]


def summarize(records: list[dict]) -> dict | None:
    """A setting's pooled figures over its runs (see the module docstring), or None without runs."""
    if not records:
        return None
    good = [r for r in records if ok(r)]
    tokens = sum(r["tokens"] for r in good)
    decode_s = sum(r["decode_s"] for r in good)
    passes = sum(r["passes"] or 0 for r in good)
    read = sum(r["read_bytes"] or 0 for r in good)
    warm = sum(1 for r in records if r["warm"])
    timed = [(r["cpu_pressure"], r["wall_s"]) for r in good if r["cpu_pressure"] is not None]
    return {"runs": len(records), "failed": len(records) - len(good) - warm, "warm": warm, "tokens": tokens,
            "decode_s": decode_s,
            "tokens_per_s": tokens / decode_s if decode_s else None, "passes": passes,
            "tokens_per_pass": (tokens - len(good)) / passes if passes else None, "read_bytes": read,
            "read_bytes_per_token": read / tokens if tokens else None,
            "peak_bytes": max(r["peak_bytes"] for r in records), "oom_kills": sum(r["oom_kills"] for r in records),
            "cpu_pressure": sum(p * w for p, w in timed) / sum(w for _, w in timed) if timed else None}


def _ratio(a: dict | None, b: dict | None) -> float | None:
    if not a or not b or not a["tokens_per_s"] or not b["tokens_per_s"]:
        return None
    return a["tokens_per_s"] / b["tokens_per_s"]


def build_report(meta: dict, runs: list[dict], spec_settings: list[str], complete: bool) -> dict:
    """The JSON document: ``meta`` (cap, prompts, models, ...) plus the aggregates of ``runs``."""
    def of(setting):
        return summarize([r for r in runs if r["setting"] == setting])

    settings = {s: of(s) for s in spec_settings}
    ranked = [(s, v) for s, v in settings.items() if v and v["tokens_per_s"]]
    best = None
    if ranked:
        name, agg = max(ranked, key=lambda sv: sv[1]["tokens_per_s"])
        best = {"setting": name, **agg}
    lever, alone = of("lever"), of(TARGET_ALONE)
    return {**meta, "complete": complete, "lever": lever,
            "llamacpp": {"settings": settings, "best": best, "target_alone": alone},
            "ratio": _ratio(lever, best), "ratio_vs_target_alone": _ratio(lever, alone), "runs": runs}


def write_json(path: Path, doc: dict) -> None:
    """Replace ``path`` atomically, so an interrupted write never leaves half a file."""
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def _num(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(doc: dict) -> str:
    """The aggregates as a plain-text table."""
    rows = [("lever", doc["lever"])] + list(doc["llamacpp"]["settings"].items())
    if doc["llamacpp"]["target_alone"]:
        rows.append((TARGET_ALONE, doc["llamacpp"]["target_alone"]))
    lines = [f"cap {doc['cap']}, {doc['prompts']['source']}, {doc['max_tokens']} tokens, {doc['threads']} threads",
             f"{'setting':14} {'tok/s':>7} {'tok/pass':>8} {'read/tok':>10} {'peak':>10} {'oom':>4} {'failed':>6} "
             f"{'warm':>4} {'cpu wait':>8}"]
    for name, s in rows:
        if s is None:
            continue
        lines.append(f"{name:14} {_num(s['tokens_per_s']):>7} {_num(s['tokens_per_pass']):>8} "
                     f"{_mib(s['read_bytes_per_token']):>10} {_mib(s['peak_bytes']):>10} {s['oom_kills']:>4} "
                     f"{s['failed']:>6} {s['warm']:>4} {_num(s['cpu_pressure'], '{:.0%}'):>8}")
    best = doc["llamacpp"]["best"]
    if best:
        lines.append(f"lever / llama.cpp best ({best['setting']}): {_num(doc['ratio'])}x")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    """Bars per setting: decode tokens/s, tokens per target pass, MiB read from storage per token, peak MiB,
    and the CPU contention the runs met (which slows llama.cpp most; see the module docstring)."""
    import matplotlib  # checked for before the runs

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [("lever", doc["lever"])] + list(doc["llamacpp"]["settings"].items())
    if doc["llamacpp"]["target_alone"]:
        rows.append((TARGET_ALONE, doc["llamacpp"]["target_alone"]))
    rows = [(n, s) for n, s in rows if s and s["tokens_per_s"]]
    names = [n.replace("draft-max-", "llama.cpp K=").replace(TARGET_ALONE, "llama.cpp\ntarget alone")
             for n, _ in rows]
    colors = ["#2ca02c"] + ["#1f77b4"] * (len(rows) - 1)
    cap_mib = doc["cap_bytes"] / 2**20
    panels = (("decode tokens/s", lambda s: s["tokens_per_s"], "{:.2f}", None),
              ("tokens per target pass", lambda s: s["tokens_per_pass"] or 0, "{:.2f}", None),
              ("MiB read per token", lambda s: (s["read_bytes_per_token"] or 0) / 2**20, "{:,.0f}", None),
              ("peak memory, MiB (line: cap)", lambda s: s["peak_bytes"] / 2**20, "{:,.0f}", cap_mib),
              ("CPU wait, % of run time (contention)", lambda s: 100 * (s["cpu_pressure"] or 0), "{:.0f}", None))
    fig, axes = plt.subplots(1, len(panels), figsize=(19, 4))
    for ax, (label, value, fmt, line) in zip(axes, panels):
        values = [value(s) for _, s in rows]
        ax.bar(range(len(rows)), values, color=colors)
        for i, v in enumerate(values):
            ax.text(i, v, fmt.format(v), ha="center", va="bottom", fontsize=8)
        if line is not None:
            ax.axhline(line, color="#d62728", linewidth=1)
        ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
    fig.suptitle(f"lever vs llama.cpp under a {doc['cap']} cgroup cap: {doc['prompts']['source']}, "
                 f"{doc['max_tokens']} tokens, {doc['threads']} threads, greedy", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# -- driving ----------------------------------------------------------------------------------------


def say(msg: str) -> None:
    print(f"peer_llamacpp: {msg}", file=sys.stderr, flush=True)


def describe_run(rec: dict) -> str:
    if rec["warm"]:
        return (f"WARM, left out: read {_mib(rec['read_bytes'])}, less than the target's weights "
                "(another process holds them in the page cache?)")
    if not ok(rec):
        if rec["timed_out"]:
            why = "timed out"
        elif rec["oom_kills"]:
            why = f"OOM-killed x{rec['oom_kills']}"
        else:
            why = f"exit {rec['exit_code']}" if rec["exit_code"] else "unreadable output"
        return f"FAILED ({why}), peak {_mib(rec['peak_bytes'])}"
    return (f"{rec['tokens']} tokens, {rec['tokens_per_s']:.2f} tok/s, {_num(rec['tokens_per_pass'])} tok/pass, "
            f"read {_mib(rec['read_bytes'])}, peak {_mib(rec['peak_bytes'])}, wall {rec['wall_s']:.0f} s, "
            f"cpu wait {_num(rec['cpu_pressure'], '{:.0%}')}")


def load_prompts(args) -> tuple[str, list[tuple[int, str]]]:
    """(description, [(id, text), ...]) from --humaneval or --prompts, with lever's own loaders."""
    from lever_actors.bench import file_prompts, humaneval_prompts

    if args.prompts:
        if not Path(args.prompts).is_file():
            raise PeerError(f"--prompts: no such file {args.prompts}")
        return args.prompts, file_prompts(args.prompts)
    return f"humaneval {args.humaneval}", humaneval_prompts(args.humaneval)


def model_files() -> tuple[dict[str, Path], list[Path]]:
    """({target_gguf, draft_gguf, target_bundle, draft_bundle}, every file either engine reads)."""
    from lever_actors.models import DEFAULT_PAIR, bundle_path, gguf_path

    paths = {}
    for role in ("target", "draft"):
        paths[f"{role}_gguf"] = gguf_path(DEFAULT_PAIR[role])
        paths[f"{role}_bundle"] = bundle_path(DEFAULT_PAIR[role])
    missing = [str(p) for k, p in paths.items()
               if not (p.is_file() if k.endswith("gguf") else (p / "manifest.json").is_file())]
    if missing:
        raise PeerError(f"missing {', '.join(missing)}: run `lever-actors models fetch` first")
    files = [paths["target_gguf"], paths["draft_gguf"]]
    files += sorted(f for k in ("target_bundle", "draft_bundle") for f in paths[k].iterdir() if f.is_file())
    return paths, files


def lever_source(env: dict[str, str], outputs: tuple[Path, ...] = ()) -> dict:
    """Which lever code the runs import: its package directory and, in a git checkout, the commit and
    the tracked files modified there, leaving out ``outputs`` (this run's own JSON and plot, which it
    rewrites as it goes). A checkout others are editing can change under a long run, so the report
    says what ran (and the run warns when it changed between start and end)."""
    probe = subprocess.run([sys.executable, "-c", "import lever_actors; print(lever_actors.__file__)"],
                           env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        raise PeerError(f"lever_actors does not import: {probe.stderr.strip()[-ERROR_TAIL:]}")
    package = Path(probe.stdout.strip()).parent

    def git(*argv):
        return subprocess.run(["git", "-C", str(package.parent), *argv], capture_output=True, text=True)

    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        return {"package": str(package), "commit": None, "modified": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    ours = {Path(p).resolve() for p in outputs}
    modified = [line[3:] for line in status.stdout.splitlines()]
    return {"package": str(package), "commit": head.stdout.strip(),
            "modified": [m for m in modified if (package.parent / m).resolve() not in ours]}


def clean_env() -> dict[str, str]:
    """The environment of every run: without the test suite's budget override or llama.cpp's LLAMA_ARG_* flags."""
    return {k: v for k, v in os.environ.items() if k != "LEVER_TEST_RUNTIME_BYTES" and not k.startswith("LLAMA_ARG_")}


@dataclass(frozen=True)
class Setting:
    """One engine configuration: its command for a prompt, and which output of it says the figures."""

    name: str
    cmd: list[str]
    parse: Callable[[str, int], dict]
    stream: str  # "stdout" or "stderr"


def plan_settings(job: Job, bins: dict[str, Path], draft_max: list[int], target_alone: bool) -> list[Setting]:
    """The settings one prompt runs through, in order: lever, llama.cpp per draft length, the target alone."""
    plan = [Setting("lever", lever_cmd(job), parse_lever, "stdout")]
    plan += [Setting(f"draft-max-{k}", speculative_cmd(bins["llama-speculative"], job, k), parse_speculative,
                     "stderr") for k in draft_max]
    if target_alone:
        plan.append(Setting(TARGET_ALONE, completion_cmd(bins["llama-completion"], job), parse_completion, "stderr"))
    return plan


@dataclass(frozen=True)
class Conditions:
    """What every run shares: the cap, the files evicted before it, its environment, when to run it again."""

    cap: int
    timeout: float
    evict_files: list[Path]
    env: dict[str, str]
    attempts: int
    max_cpu_wait: float | None


def run_setting(prompt_id: int, setting: Setting, job: Job, cond: Conditions) -> dict:
    """One setting on one prompt from a cold page cache, made again (up to ``cond.attempts`` in all) while
    ``retry_reason`` finds one; the last attempt's record, which counts them."""
    for attempt in range(1, cond.attempts + 1):
        rec = dict(run_cold(prompt_id, setting, job, cond), attempts=attempt)
        why = retry_reason(rec, cond.max_cpu_wait)
        if why is None or attempt == cond.attempts:
            return rec
        say(f"prompt {prompt_id} {setting.name}: {why}; once more")
    raise AssertionError("unreachable: attempts >= 1")


def retry_reason(rec: dict, max_cpu_wait: float | None) -> str | None:
    """Why a run should be made again: llama.cpp lost its closing report (see the module docstring), or
    the machine was busier than ``--max-cpu-wait`` allows."""
    if rec["exit_code"] == 0 and "error" in rec:
        return "exited cleanly without its closing report"
    if max_cpu_wait is not None and rec["cpu_pressure"] is not None and rec["cpu_pressure"] > max_cpu_wait:
        return f"CPU wait {rec['cpu_pressure']:.0%} above --max-cpu-wait {max_cpu_wait:.0%}"
    return None


def run_cold(prompt_id: int, setting: Setting, job: Job, cond: Conditions) -> dict:
    evict(cond.evict_files)
    m = run_capped(setting.cmd, cond.cap, cond.timeout, cond.env)
    rec = make_record(prompt_id, setting.name, m, setting.parse, setting.stream, job.max_tokens)
    # every engine reads at least the target's weights once from a cold start
    rec["warm"] = clean(rec) and m.read_bytes is not None and m.read_bytes < job.target_gguf.stat().st_size
    return rec


def run_prompt(prompt_id: int, job: Job, bins: dict[str, Path], args, cond: Conditions) -> list[dict]:
    """Every setting on one prompt, in order; returns their records."""
    records = []
    for setting in plan_settings(job, bins, args.draft_max, args.target_alone):
        rec = run_setting(prompt_id, setting, job, cond)
        say(f"prompt {prompt_id} {setting.name}: {describe_run(rec)}")
        records.append(rec)
    return records


def parse_draft_max(text: str) -> list[int]:
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated draft lengths such as 8,16,32, got {text!r}") from None
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"draft lengths must be >= 1, got {text!r}")
    return ks


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"want a whole number >= 1, got {text!r}")
    return v


def fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"want a share between 0 and 1 such as 0.35, got {text!r}")
    return v


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from lever_actors.models import lever_home

    ap = argparse.ArgumentParser(prog="peer_llamacpp.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap", required=True,
                    help="memory cap of every run, e.g. 768MiB or 1GiB (cgroup limit, swap included)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--humaneval", metavar="A:B", help="HumanEval problems A..B-1 (held out: 80-163)")
    src.add_argument("--prompts", metavar="FILE.jsonl", help='prompts, one {"prompt": ...} per line')
    ap.add_argument("--max-tokens", type=positive_int, metavar="N", default=64, help="tokens per prompt (default 64)")
    ap.add_argument("--json", required=True, type=Path, metavar="OUT",
                    help="write the report here (after every prompt)")
    ap.add_argument("--plot", type=Path, metavar="PNG",
                    help="also draw the aggregates as a bar chart (needs matplotlib)")
    ap.add_argument("--build-dir", type=Path, metavar="DIR", default=lever_home() / "llamacpp",
                    help="where llama.cpp is (or gets) built (default: $LEVER_HOME/llamacpp)")
    ap.add_argument("--draft-max", type=parse_draft_max, default=[8, 16, 32], metavar="K,K,...",
                    help="llama-speculative --spec-draft-n-max values to run (default 8,16,32)")
    ap.add_argument("--target-alone", action=argparse.BooleanOptionalAction, default=True,
                    help="also run llama-completion with the target alone (default on)")
    ap.add_argument("--threads", type=positive_int, metavar="N", default=2, help="threads of every engine (default 2)")
    ap.add_argument("--context", type=positive_int, metavar="N", default=1024,
                    help="KV cache slots of every engine (default 1024, lever's)")
    ap.add_argument("--timeout", type=float, metavar="S", default=1800,
                    help="seconds before a run is killed (default 1800)")
    ap.add_argument("--max-cpu-wait", type=fraction, metavar="F",
                    help="make a run again when some task waited for a CPU during more than the share F of "
                         "its time, e.g. 0.35 (default: never; see CPU contention above)")
    ap.add_argument("--attempts", type=positive_int, metavar="N", default=3,
                    help="tries per run at most, for lost reports and --max-cpu-wait (default 3)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from lever_actors.engine import parse_size
    from lever_actors.errors import ConfigError

    args = parse_args(argv)
    try:
        cap = parse_size(args.cap)
        if cap is None:
            raise PeerError("--cap must be a size such as 768MiB: the comparison is about a memory cap")
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise PeerError("--plot needs matplotlib: pip install matplotlib (or 'lever-actors[plots]')")
        source, prompts = load_prompts(args)
        paths, evict_files = model_files()
        close_cgroup(new_cgroup(cap))  # fail now, not after a long build, when cgroups cannot be made
        bins = ensure_build(args.build_dir)
        cond = Conditions(cap, args.timeout, evict_files, clean_env(), args.attempts, args.max_cpu_wait)
        return measure(args, cond, source, prompts, paths, bins)
    except (PeerError, ConfigError) as e:
        print(f"peer_llamacpp: error: {e}", file=sys.stderr)
        return 2


def measure(args, cond: Conditions, source: str, prompts, paths: dict[str, Path], bins: dict[str, Path]) -> int:
    """Run every prompt, rewriting the JSON after each; then the table and the plot."""
    outputs = tuple(p for p in (args.json, args.plot) if p)
    meta = {"cap": args.cap, "cap_bytes": cond.cap, "max_tokens": args.max_tokens, "threads": args.threads,
            "context": args.context, "max_cpu_wait": args.max_cpu_wait,
            "prompts": {"source": source, "ids": [i for i, _ in prompts]},
            "models": {k: str(v) for k, v in paths.items()},
            "llamacpp_build": {"dir": str(args.build_dir), "llama_cpp_python": LLAMA_CPP_PYTHON},
            "lever_source": lever_source(cond.env, outputs)}
    spec_settings = [f"draft-max-{k}" for k in args.draft_max]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, (pid, text) in enumerate(prompts):
            prompt_file = Path(tmp) / f"prompt-{pid}.txt"
            prompt_file.write_text(text, encoding="utf-8")
            job = Job(text, prompt_file, args.max_tokens, args.threads, args.context,
                      paths["target_gguf"], paths["draft_gguf"])
            runs += run_prompt(pid, job, bins, args, cond)
            doc = build_report(meta, runs, spec_settings, complete=n == len(prompts) - 1)
            write_json(args.json, doc)
    if lever_source(cond.env, outputs) != meta["lever_source"]:
        say(f"warning: lever's source changed during the runs (at the start: {meta['lever_source']})")
    print(table(doc))
    if args.plot:
        plot(doc, args.plot)
        say(f"wrote {args.plot}")
    say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

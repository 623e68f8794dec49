"""The on-disk bundle: manifest, resident part and flash file.

Layout of a bundle directory::

    manifest.json    format version, dims, tokenizer, every array's byte range and checksums
                     (per region: SHA-256 for `models verify`, XXH3-128 for the checks on
                     the load and streaming paths, about 20x faster)
    tokenizer.json   the tokenizers-library tokenizer (plus its spec in the manifest)
    resident.bin     the LM head in vocabulary slices (each with the final norm), 4 KiB
                     aligned: pinned in DRAM, or streamed like layers when the budget is small
    flash.bin        embedding rows (GGUF-native blocks, read a row at a time), then one
                     region per decoder layer, 4 KiB aligned, holding the layer's arrays
                     in exactly the layout the computation consumes (no repacking per pass)

The manifest's ``layout`` says which computation: ``native`` (GGUF block bytes
for lever_actors.kernels; what streams) or ``ort`` (MatMulNBits initializers).

A bundle is only valid once ``manifest.json`` exists: conversion writes into a
temporary directory and renames it at the end.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from lever_actors.errors import ModelError
from lever_actors.shapes import Dims, MatSpec

FORMAT = "lever-bundle"
# 2: LM head in vocabulary slices ("head_chunks"); 3: "layout" (native | ort); 4: "xxh3" per region
FORMAT_VERSION = 4


def fast_digest(data) -> str:
    """The checksum of the hot paths (a region's first read in a process, resident loads): XXH3-128,
    tens of GB/s where SHA-256 makes about 1 GB/s here, which a fresh process paid on its first pass."""
    return xxhash.xxh3_128_hexdigest(data)
ALIGN = 4096  # flash regions: O_DIRECT needs page-aligned offsets and lengths
ARRAY_ALIGN = 64  # arrays inside a region: cache-line aligned views


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class ArrayRef:
    """A named array at ``offset`` inside its region."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def view(self, buf) -> np.ndarray:
        return np.frombuffer(buf, dtype=self.dtype, count=int(np.prod(self.shape)), offset=self.offset).reshape(self.shape)

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset}

    @classmethod
    def from_json(cls, d: dict) -> "ArrayRef":
        return cls(d["name"], d["dtype"], tuple(d["shape"]), int(d["offset"]))


@dataclass(frozen=True)
class Region:
    """A contiguous byte range of a bundle file holding several arrays."""

    file: str
    offset: int
    nbytes: int  # padded length (multiple of ALIGN for flash regions)
    sha256: str
    arrays: tuple[ArrayRef, ...]
    mats: dict = field(default_factory=dict)  # matrix name -> MatSpec fields
    xxh3: str = ""  # fast_digest of the bytes

    def mat_specs(self) -> dict[str, MatSpec]:
        return {k: MatSpec(**v) for k, v in self.mats.items()}

    def views(self, buf) -> dict[str, np.ndarray]:
        return {a.name: a.view(buf) for a in self.arrays}

    def to_json(self) -> dict:
        return {
            "file": self.file, "offset": self.offset, "nbytes": self.nbytes, "sha256": self.sha256,
            "xxh3": self.xxh3, "arrays": [a.to_json() for a in self.arrays], "mats": self.mats,
        }

    @classmethod
    def from_json(cls, d: dict) -> "Region":
        return cls(d["file"], int(d["offset"]), int(d["nbytes"]), d["sha256"],
                   tuple(ArrayRef.from_json(a) for a in d["arrays"]), d.get("mats", {}), d.get("xxh3", ""))


class RegionWriter:
    """Appends aligned regions of arrays to one file, hashing each region."""

    def __init__(self, path: Path, name: str) -> None:
        self.name = name
        self.f = open(path, "wb")
        self.pos = 0

    def write(self, arrays: dict[str, np.ndarray], mats: dict | None = None) -> Region:
        start = self.pos
        h, fast = hashlib.sha256(), xxhash.xxh3_128()
        refs = []
        off = 0
        chunks = []
        for name, arr in arrays.items():
            arr = np.ascontiguousarray(arr)
            pad = align_up(off, ARRAY_ALIGN) - off
            if pad:
                chunks.append(b"\0" * pad)
                off += pad
            refs.append(ArrayRef(name, arr.dtype.str, tuple(arr.shape), off))
            chunks.append(memoryview(arr).cast("B"))
            off += arr.nbytes
        total = align_up(off)
        chunks.append(b"\0" * (total - off))
        for c in chunks:
            h.update(c)
            fast.update(c)
            self.f.write(c)
        self.pos += total
        return Region(self.name, start, total, h.hexdigest(), tuple(refs), mats or {}, fast.hexdigest())

    def write_raw(self, data: np.ndarray) -> tuple[int, int, str]:
        """Raw bytes at an aligned offset: (offset, padded length, sha256, xxh3)."""
        start = self.pos
        b = memoryview(np.ascontiguousarray(data)).cast("B")
        total = align_up(len(b))
        h, fast = hashlib.sha256(b), xxhash.xxh3_128(b)
        pad = b"\0" * (total - len(b))
        h.update(pad)
        fast.update(pad)
        self.f.write(b)
        self.f.write(pad)
        self.pos += total
        return start, total, h.hexdigest(), fast.hexdigest()

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


@dataclass(frozen=True)
class Bundle:
    """A loaded manifest: everything needed to plan reads and build graphs."""

    path: Path
    manifest: dict

    @property
    def dims(self) -> dict:
        return self.manifest["dims"]

    @property
    def n_layer(self) -> int:
        return int(self.dims["n_layer"])

    @property
    def layers(self) -> list[Region]:
        return [Region.from_json(r) for r in self.manifest["layers"]]

    @property
    def head_chunks(self) -> list[Region]:
        return [Region.from_json(r) for r in self.manifest["head_chunks"]]

    def head_bytes(self) -> int:
        return sum(r.nbytes for r in self.head_chunks)

    @property
    def layout(self) -> str:
        return self.manifest["layout"]

    @property
    def embedding(self) -> dict:
        return self.manifest["embedding"]

    def file(self, name: str) -> Path:
        return self.path / name

    def graph_dims(self, context: int) -> Dims:
        d = self.dims
        return Dims(d["hidden"], d["ffn"], d["n_head"], d["n_kv_head"], d["head_dim"],
                    float(d["rms_eps"]), d["rope_style"], context)

    def layer_bytes(self) -> list[int]:
        return [r.nbytes for r in self.layers]


def load_bundle(path: str | os.PathLike) -> Bundle:
    p = Path(path)
    mf = p / "manifest.json"
    if not mf.is_file():
        raise ModelError(f"{p} is not a lever-actors bundle (no manifest.json); create one with `lever-actors convert GGUF {p}`")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{mf} is corrupt: {e}") from e
    if manifest.get("format") != FORMAT:
        raise ModelError(f"{mf} is not a lever-actors manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ModelError(
            f"{p} has bundle format {manifest.get('format_version')}, this lever-actors reads {FORMAT_VERSION}; "
            "convert the GGUF again"
        )
    regions = manifest["layers"] + manifest["head_chunks"]
    for name in {r["file"] for r in regions}:
        if not (p / name).is_file():
            raise ModelError(f"bundle {p} is missing {name}")
        need = max(int(r["offset"]) + int(r["nbytes"]) for r in regions if r["file"] == name)
        size = (p / name).stat().st_size
        if size < need:  # truncated: refused before anything is computed from it
            raise ModelError(f"{p / name} is truncated: {size} bytes, the manifest needs {need}; convert the GGUF again")
    return Bundle(p, manifest)


def read_region(bundle: Bundle, region: Region, verify: bool = True) -> bytearray:
    """Read a region into DRAM (buffered; for resident parts loaded once at start), checked
    against the manifest's XXH3 (once per load, so a damaged byte is never computed on)."""
    buf = bytearray(region.nbytes)
    with open(bundle.file(region.file), "rb") as f:
        f.seek(region.offset)
        n = f.readinto(buf)
        # the copy is ours now: drop the page-cache pages it came through, which a memory cgroup
        # would otherwise charge to this process on top of the copy
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), region.offset, region.nbytes, os.POSIX_FADV_DONTNEED)
    if n != region.nbytes:
        raise ModelError(f"{bundle.file(region.file)} is truncated at offset {region.offset}")
    if verify and fast_digest(buf) != region.xxh3:
        held = region.arrays[0].name if region.arrays else "raw bytes"
        raise ModelError(f"checksum mismatch in {bundle.file(region.file)} at offset {region.offset} (the region "
                         f"holding {held}): the bundle is damaged; run `lever-actors models verify`, then reconvert")
    return buf


def span_digest(fd: int, offset: int, nbytes: int, what: str, chunk: int = 4 << 20) -> str:
    """:func:`fast_digest` of ``nbytes`` at ``offset`` of the open file ``fd``, read a chunk at a time:
    for a span that never sits in DRAM whole (the embedding table, read a row at a time). Its
    page-cache pages are dropped behind it, as :func:`read_region` drops its own."""
    h, buf = xxhash.xxh3_128(), bytearray(min(chunk, max(nbytes, 1)))
    view, pos, end = memoryview(buf), offset, offset + nbytes
    while pos < end:
        n = os.preadv(fd, [view[:min(len(buf), end - pos)]], pos)
        if n <= 0:
            raise ModelError(f"{what} is truncated at offset {pos} ({end - pos} of its {nbytes} bytes missing); "
                             "convert the GGUF again")
        h.update(view[:n])
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, pos, n, os.POSIX_FADV_DONTNEED)
        pos += n
    return h.hexdigest()


def verify_bundle(bundle: Bundle, progress=None) -> list[str]:
    """Check every region's bytes against the manifest's SHA-256 (the embedding table, each layer,
    each LM head slice); returns one line per bad region, empty when the bundle is intact."""
    regions = [("embedding", bundle.embedding["file"], bundle.embedding["offset"], bundle.embedding["nbytes"],
                bundle.embedding["sha256"])]
    regions += [(f"layer {i}", r.file, r.offset, r.nbytes, r.sha256) for i, r in enumerate(bundle.layers)]
    regions += [(f"LM head slice {c}", r.file, r.offset, r.nbytes, r.sha256) for c, r in enumerate(bundle.head_chunks)]
    bad = []
    for k, (name, file, offset, nbytes, sha) in enumerate(regions):
        if progress:
            progress(k, len(regions), name)
        h, left = hashlib.sha256(), nbytes
        with open(bundle.file(file), "rb") as f:
            f.seek(offset)
            while left:
                chunk = f.read(min(left, 1 << 22))
                if not chunk:
                    break
                h.update(chunk)
                left -= len(chunk)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), offset, nbytes, os.POSIX_FADV_DONTNEED)
        if left:
            bad.append(f"{name}: {bundle.file(file)} ends {left} bytes short of its {nbytes} at offset {offset}")
        elif h.hexdigest() != sha:
            bad.append(f"{name}: checksum mismatch in {bundle.file(file)} at offset {offset} ({nbytes} bytes)")
    return bad

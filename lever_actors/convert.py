"""``lever-actors convert GGUF OUT``: turn a GGUF file into a bundle.

Supports the llama and qwen2 architectures and the tensor types listed in
:mod:`lever_actors.quant`. Anything else is a clear :class:`UnsupportedModel`
naming it.

Two layer layouts (``--layout``): ``native`` keeps the GGUF block bytes that
:mod:`lever_actors.kernels` computes from directly (the streamed target: flash
bytes equal the GGUF bytes and a layer is usable the moment it is read), ``ort``
maps blocks onto MatMulNBits initializers (resident models whose row lengths
are not multiples of 256, like the 0.5B draft's 896). ``auto`` picks native
whenever every matrix allows it. The bundle is written into ``OUT.partial-<pid>`` and renamed to ``OUT``
only when complete, so a killed conversion never leaves a bundle that loads.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

from lever_actors.bundle import FORMAT, FORMAT_VERSION, RegionWriter
from lever_actors.errors import ModelError, UnsupportedModel
from lever_actors.quant import (BLOCK_LAYOUT, SUPPORTED_TYPES, map_weight, native_row_multiple, native_weight,
                                tensor_nbytes)

ARCHITECTURES = ("qwen2", "llama")
ROPE_STYLE = {"qwen2": "neox", "llama": "norm"}


def _field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise ModelError(f"GGUF is missing the metadata field {key!r}")
        return default
    return f.contents()


def read_dims(reader: GGUFReader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModel(f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    dims = {
        "arch": arch,
        "n_layer": int(_field(reader, f"{arch}.block_count")),
        "hidden": hidden,
        "ffn": int(_field(reader, f"{arch}.feed_forward_length")),
        "n_head": n_head,
        "n_kv_head": int(_field(reader, f"{arch}.attention.head_count_kv", n_head)),
        "head_dim": hidden // n_head,
        "rope_base": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rms_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_style": ROPE_STYLE[arch],
        "train_context": int(_field(reader, f"{arch}.context_length", 4096)),
    }
    dims["head_dim"] = int(_field(reader, f"{arch}.attention.key_length", dims["head_dim"]))
    return dims


class _Tensors:
    def __init__(self, reader: GGUFReader) -> None:
        self.by_name = {t.name: t for t in reader.tensors}
        for t in reader.tensors:
            if t.tensor_type not in BLOCK_LAYOUT:
                raise UnsupportedModel(
                    f"tensor {t.name} has unsupported type {t.tensor_type.name}; supported: {', '.join(SUPPORTED_TYPES)}"
                )

    def get(self, name: str):
        t = self.by_name.get(name)
        if t is None:
            raise ModelError(f"GGUF is missing tensor {name!r}")
        return t

    def has(self, name: str) -> bool:
        return name in self.by_name

    def raw(self, name: str) -> np.ndarray:
        return np.asarray(self.get(name).data).view(np.uint8).reshape(-1)

    def vector(self, name: str) -> np.ndarray:
        t = self.get(name)
        if t.tensor_type == QT.F32:
            return np.asarray(t.data, dtype=np.float32).reshape(-1).copy()
        if t.tensor_type == QT.F16:
            return np.asarray(t.data).view(np.float16).astype(np.float32).reshape(-1)
        raise UnsupportedModel(f"vector tensor {name} has unsupported type {t.tensor_type.name}")

    def matrix(self, name: str):
        t = self.get(name)
        k, n = int(t.shape[0]), int(t.shape[1])
        return map_weight(self.raw(name), t.tensor_type, k, n)

    def native(self, name: str) -> tuple[str, np.ndarray]:
        t = self.get(name)
        return native_weight(self.raw(name), t.tensor_type, int(t.shape[0]), int(t.shape[1]))

    def native_capable(self) -> bool:
        """Can every matrix take the native layout (rows of whole blocks and activation groups)?"""
        return all(int(t.shape[0]) % native_row_multiple(t.tensor_type) == 0 for n, t in self.by_name.items()
                   if len(t.shape) == 2 and n != "token_embd.weight")


def _write_head(out: RegionWriter, n: int, row_bytes: int, layer_bytes: int, slice_arrays) -> list:
    """The LM head in vocabulary slices about one layer in size, each with its own final norm.

    A slice is a self-contained unit (norm + rows of the head), so a budget too small
    to pin the whole head can stream it slice by slice through the layer buffers.
    Each logit column depends only on its own row, so slicing changes no number.
    ``slice_arrays(lo, hi)`` gives the arrays and matrix spec of rows ``lo..hi-1``.
    """
    rows = max(256, (layer_bytes // max(row_bytes, 1)) // 256 * 256)
    return [out.write(*slice_arrays(lo, min(lo + rows, n))) for lo in range(0, n, rows)]


def _native_head_slices(qtype: str, data: np.ndarray, k: int, norm: np.ndarray):
    def slice_arrays(lo: int, hi: int):
        mats = {"output": {"kind": "native", "qtype": qtype, "k": k, "n": hi - lo}}
        return {"output_norm": norm, "output.data": data[lo:hi]}, mats
    return slice_arrays


def _ort_head_slices(w, norm: np.ndarray):
    def slice_arrays(lo: int, hi: int):
        arrays = {"output_norm": norm}
        if w.kind == "f32":
            arrays["output.dense"] = w.dense[:, lo:hi]
        else:
            arrays["output.packed"], arrays["output.scales"] = w.packed[lo:hi], w.scales[lo:hi]
            if w.corr is not None:
                arrays["output.corr"] = w.corr[:, lo:hi]
        mats = {"output": {"kind": w.kind, "k": w.k, "n": hi - lo, "block": w.block, "has_corr": w.corr is not None}}
        return arrays, mats
    return slice_arrays


def vocab_digest(spec: dict) -> str:
    """Hash of what must match between a draft and its target: token texts, types and merges."""
    h = hashlib.sha256()
    for part in (spec["tokens"], spec["token_types"], spec["merges"], [spec["bos_id"], spec["eos_id"]]):
        h.update(json.dumps(part, ensure_ascii=False).encode())
    return h.hexdigest()


MATS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _layer_arrays(ts: _Tensors, i: int, dims: dict, layout: str) -> tuple[dict, dict]:
    p = f"blk.{i}."
    arrays: dict[str, np.ndarray] = {}
    mats: dict[str, dict] = {}
    kv = dims["n_kv_head"] * dims["head_dim"]
    for m in MATS:
        if layout == "native":
            t = ts.get(p + m + ".weight")
            qtype, data = ts.native(p + m + ".weight")
            mats[m] = {"kind": "native", "qtype": qtype, "k": int(t.shape[0]), "n": int(t.shape[1])}
            arrays[f"{m}.data"] = data
            continue
        w = ts.matrix(p + m + ".weight")
        mats[m] = {"kind": w.kind, "k": w.k, "n": w.n, "block": w.block, "has_corr": w.corr is not None}
        for key, arr in w.arrays().items():
            arrays[f"{m}.{key}"] = arr
    arrays["attn_norm"] = ts.vector(p + "attn_norm.weight")
    arrays["ffn_norm"] = ts.vector(p + "ffn_norm.weight")
    for m, width in (("attn_q", dims["hidden"]), ("attn_k", kv), ("attn_v", kv)):
        name = p + m + ".bias"
        arrays[m + ".bias"] = ts.vector(name) if ts.has(name) else np.zeros(width, np.float32)
    return arrays, mats


LAYOUTS = ("auto", "native", "ort")


def convert(gguf_path: str | os.PathLike, out: str | os.PathLike, *, progress: Callable[[str], None] | None = None,
            source_sha256: str | None = None, layout: str = "auto") -> Path:
    """Convert ``gguf_path`` into the bundle directory ``out``; returns ``out``."""
    if layout not in LAYOUTS:
        raise ModelError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    from lever_actors.tokenizer import TextTokenizer, tokenizer_spec_from_gguf

    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    src, dst = Path(gguf_path), Path(out)
    if not src.is_file():
        raise ModelError(f"no such GGUF file: {src}")
    if dst.exists():
        raise ModelError(f"{dst} already exists; remove it first or choose another output path")
    try:
        reader = GGUFReader(str(src))
    except Exception as e:  # gguf raises ValueError/struct errors for non-GGUF input
        raise ModelError(f"{src} is not a readable GGUF file: {e}") from e
    dims = read_dims(reader)
    ts = _Tensors(reader)
    if layout == "auto":
        layout = "native" if ts.native_capable() else "ort"
    tmp = dst.with_name(dst.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    need = src.stat().st_size + (64 << 20)  # the bundle is the GGUF's bytes, re-laid out, plus padding
    try:
        tmp.mkdir(parents=True)
        free = shutil.disk_usage(tmp).free
    except OSError as e:
        raise ModelError(f"cannot create {tmp}: {e.strerror}; choose an output path you can write") from e
    if free < need:
        tmp.rmdir()
        raise ModelError(f"converting {src.name} needs about {need / 2**20:,.0f} MiB under {dst.parent}, "
                         f"which has {free / 2**20:,.0f} MiB free; free space or choose another output path")
    t0 = time.time()
    try:
        spec = tokenizer_spec_from_gguf(reader)
        tok = TextTokenizer.from_spec(spec)
        tok.save(tmp / "tokenizer.json")
        emb = ts.get("token_embd.weight")
        vocab = int(emb.shape[1])
        dims["vocab_size"] = vocab
        flash = RegionWriter(tmp / "flash.bin", "flash.bin")
        off, nbytes, sha, fast = flash.write_raw(ts.raw("token_embd.weight"))
        embedding = {
            "file": "flash.bin", "offset": off, "nbytes": nbytes, "sha256": sha, "xxh3": fast, "type": emb.tensor_type.name,
            "rows": vocab, "k": dims["hidden"], "row_bytes": tensor_nbytes(emb.tensor_type, dims["hidden"]),
        }
        layers = []
        for i in range(dims["n_layer"]):
            arrays, mats = _layer_arrays(ts, i, dims, layout)
            layers.append(flash.write(arrays, mats).to_json())
            say(f"convert {src.name}: layer {i + 1}/{dims['n_layer']}, {layout} layout ({time.time() - t0:.0f} s)")
        flash.close()
        resident = RegionWriter(tmp / "resident.bin", "resident.bin")
        head_name = "output.weight" if ts.has("output.weight") else "token_embd.weight"
        biggest = max(layers, key=lambda r: r["nbytes"])["nbytes"]
        norm = ts.vector("output_norm.weight")
        if layout == "native":
            qtype, data = ts.native(head_name)
            n, per_row = data.shape[0], data.nbytes // data.shape[0]
            slices = _native_head_slices(qtype, data, int(ts.get(head_name).shape[0]), norm)
        else:
            w = ts.matrix(head_name)
            n, per_row = w.n, sum(a.nbytes for a in w.arrays().values()) // w.n
            slices = _ort_head_slices(w, norm)
        head = [r.to_json() for r in _write_head(resident, n, per_row, biggest, slices)]
        resident.close()
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "layout": layout,
            "source": {"gguf": src.name, "bytes": src.stat().st_size, "sha256": source_sha256,
                       "name": str(_field(reader, "general.name", "unknown"))},
            "dims": dims,
            "tokenizer": {"file": "tokenizer.json", "vocab_sha256": vocab_digest(spec),
                          "spec": {k: v for k, v in spec.items() if k not in ("tokens", "token_types", "merges")}},
            "embedding": embedding, "layers": layers, "head_chunks": head,
            "gguf_layer_bytes": [sum(int(t.n_bytes) for n, t in ts.by_name.items() if n.startswith(f"blk.{i}."))
                                 for i in range(dims["n_layer"])],
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, dst)  # the bundle appears complete or not at all
    except OSError as e:  # disk full, permissions, I/O: nothing half-written stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelError(f"converting {src.name} into {dst} failed: {e.strerror or e} "
                         f"({getattr(e, 'filename', None) or tmp}); nothing was left behind") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"convert {src.name}: done in {time.time() - t0:.0f} s -> {dst}")
    return dst

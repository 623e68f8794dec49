"""The draft's LM head over a calibrated vocabulary subset plus the request's own prompt tokens.

The full head of the 0.5B draft is 145 MB of Q8_0 rows, 37% of the bytes a draft
step reads. Code uses a small part of the 151,936-token vocabulary, so the
drafter scores only the tokens that cover target-generated code (calibrated by
``tools/calibrate_draft_vocab.py`` on development text) and the tokens of the
prompt at hand (names the calibration never saw).

Lossless by construction: the draft only proposes and the target decides every
token. For sampled speculation the draft's distribution is the softmax over the
subset (zero elsewhere), and the drafter samples from exactly that distribution,
which is all speculative sampling needs to stay exact.

A subset logit is bit-identical to the full head's logit of the same token: the
head's matmul splits output rows and never reduces across them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from lever_actors import kernels
from lever_actors.bundle import Bundle, read_region

BUNDLE_FILE = "draft_vocab.npz"  # stored beside the draft bundle's manifest
SHIPPED_DIR = Path(__file__).with_name("draft_vocab")  # calibrations shipped with the code, by GGUF digest
MAX_EXTRA = 4096  # prompt tokens outside the subset scored per request (a prompt has far fewer distinct ones)


def save_subset(path: Path, ids: np.ndarray, vocab_size: int, meta: dict) -> None:
    """Write ``ids`` as a bitmap over the vocabulary (19 KB for Qwen's) plus the calibration's figures."""
    mask = np.zeros(vocab_size, bool)
    mask[np.asarray(ids, np.int64)] = True
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, bits=np.packbits(mask), vocab_size=np.int64(vocab_size),
                            meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    os.replace(tmp, path)


def load_subset(path: Path) -> tuple[np.ndarray, dict]:
    """(sorted int32 token ids, calibration figures) of a stored subset."""
    with np.load(path) as z:
        n = int(z["vocab_size"])
        ids = np.flatnonzero(np.unpackbits(z["bits"])[:n]).astype(np.int32)
        meta = json.loads(z["meta"].tobytes().decode())
    return ids, meta


def shipped_path(bundle: Bundle) -> Path:
    digest = (bundle.manifest.get("source") or {}).get("sha256") or "unknown"
    return SHIPPED_DIR / f"{digest[:16]}.npz"


def subset_for(bundle: Bundle) -> tuple[np.ndarray, dict, Path] | None:
    """The calibrated subset of this draft: the bundle's own, else the one shipped for its GGUF."""
    for path in (Path(bundle.path) / BUNDLE_FILE, shipped_path(bundle)):
        if path.is_file():
            ids, meta = load_subset(path)
            if len(ids) and ids[-1] < bundle.dims["vocab_size"]:
                return ids, meta, path
    return None


class FullHead:
    """The model's own head over the whole vocabulary (the ablation, and ORT-layout drafts)."""

    ids = None

    def __init__(self, model) -> None:
        self.m = model

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return self.m.logits(hidden)

    def set_prompt(self, tokens) -> None:
        pass


class SubsetHead:
    """Final norm + the head rows of a token subset: logits ``[M, len(ids)]`` over ``ids``.

    ``ids`` is the calibrated subset followed by the current prompt's tokens outside it
    (:meth:`set_prompt`); those few rows are read from the bundle file per request, so
    the full head never occupies DRAM. ``requantize``: the rows become Q4_0 as lever's draft layers
    do (``kernels.requantized_q4_0``; 18 bytes per 32 weights against the stored Q8_0's 34), in AMX
    tile strips where ``tiles``.
    """

    def __init__(self, bundle: Bundle, subset: np.ndarray, lane, requantize: bool = False, tiles: bool = False) -> None:
        chunks = bundle.head_chunks
        specs = [c.mats["output"] for c in chunks]
        self.qtype, self.k = specs[0]["qtype"], specs[0]["k"]
        if any(s["kind"] != "native" or s["qtype"] != self.qtype for s in specs):
            raise ValueError("a subset head needs a native-layout head of one weight type")
        self.lane, self.eps = lane, float(bundle.dims["rms_eps"])
        self.vocab = bundle.dims["vocab_size"]
        self.base_ids = np.unique(np.asarray(subset, np.int32))
        self.row_bytes = kernels.row_bytes(self.qtype, self.k)  # as stored in the bundle file
        self.requantize = requantize and self.qtype in kernels.REQUANTIZABLE
        self.tiles = tiles and self.requantize and kernels.tiles_take(lane.precision)
        self.dram_row_bytes = kernels.row_bytes("Q4_0", self.k) if self.requantize else self.row_bytes
        starts = np.cumsum([0] + [s["n"] for s in specs])
        # where each token's row lives in the file, for the prompt's extra rows
        self._row_at = []  # (first token, file path, byte offset of the chunk's first row)
        rows = np.empty((len(self.base_ids), self.row_bytes), np.uint8)
        for c, region in enumerate(chunks):
            buf = read_region(bundle, region)
            v = region.views(buf)
            if c == 0:
                self.norm = np.array(v["output_norm"], np.float32)
            lo, hi = starts[c], starts[c + 1]
            sel = (self.base_ids >= lo) & (self.base_ids < hi)
            rows[sel] = v["output.data"][self.base_ids[sel] - lo]
            ref = next(a for a in region.arrays if a.name == "output.data")
            self._row_at.append((int(lo), str(bundle.file(region.file)), region.offset + ref.offset))
            del buf, v
        self.base = self._matrix(rows, self.tiles)
        del rows
        self.extra = None
        self.ids = self.base_ids
        self.extra_bytes_read = 0

    @property
    def nbytes(self) -> int:
        """DRAM the head holds at most: the subset's rows and the largest prompt extra."""
        return self.columns * self.dram_row_bytes + self.norm.nbytes

    @property
    def columns(self) -> int:
        """Logits a row of :meth:`logits` holds at most: the subset and the largest prompt extra."""
        return len(self.base_ids) + min(MAX_EXTRA, self.vocab - len(self.base_ids))

    def _matrix(self, rows: np.ndarray, tiles: bool = False) -> kernels.NativeMatrix:
        """Head rows as stored, as the kernels take them (requantized and repacked: arrays of their own).
        The prompt's extra rows are never tiled: their arithmetic must not hang on how many there are."""
        m = kernels.NativeMatrix(self.qtype, self.k, len(rows), rows)
        return kernels.for_draft_cpu(kernels.requantized_q4_0(m), tiles) if self.requantize else m

    def set_prompt(self, tokens) -> None:
        """Score the prompt's tokens too (those outside the subset), until the next prompt."""
        t = np.unique(np.asarray(list(tokens), np.int32))
        t = t[(t >= 0) & (t < self.vocab)]
        extra = np.setdiff1d(t, self.base_ids)[:MAX_EXTRA]
        if not len(extra):
            self.extra, self.ids = None, self.base_ids
            return
        rows = np.empty((len(extra), self.row_bytes), np.uint8)
        firsts = np.asarray([r[0] for r in self._row_at])
        fds: dict[str, int] = {}
        try:
            for i, tok in enumerate(extra):
                lo, path, off = self._row_at[int(np.searchsorted(firsts, tok, side="right")) - 1]
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, os.O_RDONLY)
                if os.preadv(fd, [rows[i]], off + (int(tok) - lo) * self.row_bytes) != self.row_bytes:
                    raise OSError(f"short read of head row {tok} in {path}")
        finally:
            for fd in fds.values():
                os.close(fd)
        self.extra_bytes_read += rows.nbytes
        self.extra = self._matrix(rows)
        self.ids = np.concatenate([self.base_ids, extra])

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        hn = kernels.rmsnorm(np.ascontiguousarray(hidden, np.float32), self.norm, self.eps)
        a = kernels.quantize_rows(hn) if self.lane.precision == "int8" else hn
        out = kernels.matmul(self.base, a, self.lane.threads)
        if self.extra is None:
            return out
        return np.concatenate([out, kernels.matmul(self.extra, a, self.lane.threads)], axis=1)


def coverage(ids: np.ndarray, tokens) -> float:
    """Share of ``tokens`` (a flat sequence of ids) that the subset ``ids`` contains."""
    t = np.asarray(list(tokens), np.int64)
    return float(np.isin(t, ids).mean()) if t.size else 1.0

"""A transformer run layer by layer.

The pieces here know nothing about speculation or actors: a KV cache of fixed
``context`` slots, embedding rows read from the flash file, rotary tables, the
layers and the LM head. A layer is built from its buffer in one of two ways,
following the bundle's layout:

* ``native``: :class:`NativeLayer` wraps views of the buffer (no copy) and runs
  in :mod:`lever_actors.kernels` (matmuls from the GGUF blocks, attention over
  each row's own key order). This is how the target streams.
* ``ort``: one ONNX Runtime session per layer with MatMulNBits initializers
  (resident models only, e.g. the draft).
"""
from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType as QT

from lever_actors.bundle import Bundle, Region, read_region, span_digest
from lever_actors import kernels
from lever_actors.errors import FlashFault, ModelError
from lever_actors.flashio import READ_RETRIES
from lever_actors.ortrt import LaneConfig, make_session
from lever_actors.quant import dequantize_rows
from lever_actors.shapes import NEG

# rows per layer call while a model digests a prompt (the verifier's prefill, the drafter's feed):
# it bounds their activations, and the DRAM plan counts exactly this many (runtime.activation_bytes)
FEED_CHUNK = 64


def kv_dtype(layout: str, precision: str):
    """The KV rows' format: fp16 for the native kernels at int8 activations (half the bytes, as
    llama.cpp keeps them; each row is rounded once when written and widened exactly when read, so
    the numerics stay batch- and tree-invariant), fp32 for the fp32 reference numerics and for
    ONNX Runtime layer graphs (their past_k/past_v inputs are fp32)."""
    return np.float16 if layout == "native" and precision == "int8" else np.float32


class Stopped(Exception):
    """A forward call stopped between two layers because its caller asked it to."""


class KVCache:
    """K/V of every layer in ``context`` slots: ``[n_layer, KVH, C, D]`` each.

    Slots ``0..length-1`` hold the committed sequence in order; slots above are
    scratch for tokens under verification (tree nodes) until they are committed.

    ``tokens`` names the token of every committed slot when each commit said which (None once
    one did not). A row's K/V depend only on the tokens up to it, so the rows of a prefix the
    next sequence shares can serve it unchanged (:meth:`reusable`): that is prompt caching.
    """

    def __init__(self, n_layer: int, n_kv_head: int, context: int, head_dim: int, dtype=np.float32) -> None:
        self.k = np.zeros((n_layer, n_kv_head, context, head_dim), dtype)
        self.v = np.zeros_like(self.k)
        self.context = context
        self.length = 0
        self.tokens: list[int] | None = []

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, slots: np.ndarray, k_new: np.ndarray, v_new: np.ndarray) -> None:
        self.k[layer][:, slots, :] = k_new
        self.v[layer][:, slots, :] = v_new

    def commit(self, slots: list[int] | np.ndarray, tokens=None, scratch=()) -> None:
        """Keep the rows in ``slots`` (in order) as the next committed positions; ``tokens`` are
        their token ids (without them the cache no longer knows its sequence: no reuse).

        ``scratch`` rows (in order) move to the slots right after them and stay scratch: the
        part of a draft tree that lies below the newly committed tokens survives the commit.
        """
        slots = np.asarray(slots, dtype=np.int64)
        src = np.concatenate([slots, np.asarray(scratch, dtype=np.int64)])
        dst = np.arange(self.length, self.length + len(src))
        if len(dst) and dst[-1] >= self.context:
            raise ValueError(f"KV commit past the context ({self.context} slots)")
        if not np.array_equal(src, dst):  # fancy indexing copies the sources before any is overwritten
            self.k[:, :, dst, :] = self.k[:, :, src, :]
            self.v[:, :, dst, :] = self.v[:, :, src, :]
        self.length += len(slots)
        if tokens is None or self.tokens is None or len(tokens) != len(slots):
            self.tokens = None
        else:
            self.tokens.extend(int(t) for t in tokens)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)
        if self.length == 0:
            self.tokens = []
        elif self.tokens is not None:
            del self.tokens[self.length:]

    def reusable(self, prompt) -> int:
        """How many leading rows serve ``prompt``: the common prefix, short of its last token
        (whose logits the new request needs, so it is always computed)."""
        if self.tokens is None:
            return 0
        return common_prefix(self.tokens, list(prompt)[:-1])


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n


def rope_tables(positions: np.ndarray, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin ``[N, head_dim/2]`` of each position, computed in float as ggml computes them."""
    return kernels.rope_tables(positions, head_dim // 2, base)


def attention_layout(context: int, past: int, visible: list[list[int]]) -> dict[str, np.ndarray]:
    """Mask and column order of a pass: every row sees slots ``< past`` and its ``visible`` slots.

    ``visible[r]`` lists row ``r``'s own earlier tokens in position order, ending
    with its own slot. ``perm[r]`` puts those columns right after the prefix (the
    rest follow in slot order) and ``mask`` is 0 exactly on the first
    ``past + len(visible[r])`` columns, so the softmax of every row has the layout
    of a plain autoregressive step (see graphs.build_layer).
    """
    n = len(visible)
    perm = np.empty((n, context), np.int64)
    mask = np.full((n, context), NEG, np.float32)
    prefix = np.arange(past)
    for r, vis in enumerate(visible):
        vis = np.asarray(vis, np.int64)
        if len(vis) and (vis.min() < past or vis.max() >= context):
            raise ValueError(f"row {r}: visible slots must lie in [{past}, {context})")
        rest = np.ones(context, bool)
        rest[:past] = False
        rest[vis] = False
        perm[r] = np.concatenate([prefix, vis, np.flatnonzero(rest)])
        mask[r, : past + len(vis)] = 0.0
    return {"mask": mask, "perm": perm, "lengths": np.asarray([past + len(v) for v in visible], np.int64)}


def causal_layout(context: int, past: int, n: int) -> dict[str, np.ndarray]:
    """Layout of ``n`` consecutive tokens at slots ``past..past+n-1`` (prefill, chains, AR).

    Every row reads the slots in plain order, so ``perm`` is one row broadcast (no memory per
    row: a long prompt's layouts would otherwise take ``12 * context`` bytes a token) and the
    mask follows from ``lengths`` (:func:`dense_layout` spells both out for ONNX Runtime).
    """
    if past < 0 or past + n > context:
        raise ValueError(f"slots {past}..{past + n - 1} do not fit a cache of {context}")
    perm = np.broadcast_to(np.arange(context, dtype=np.int64), (n, context))
    return {"perm": perm, "lengths": np.arange(past + 1, past + n + 1, dtype=np.int64)}


def dense_layout(layout: dict[str, np.ndarray], context: int) -> dict[str, np.ndarray]:
    """``layout`` with a row of ``perm`` and a ``mask`` per row, as the ONNX layer graphs take them."""
    lengths = layout["lengths"]
    mask = np.where(np.arange(context)[None, :] < lengths[:, None], np.float32(0), np.float32(NEG))
    return {**layout, "perm": np.ascontiguousarray(layout["perm"]), "mask": mask.astype(np.float32)}


def read_raw_rows(fd: int, offset: int, row_bytes: int, n_rows: int, ids) -> np.ndarray:
    """The bytes ``[len(ids), row_bytes]`` of rows ``ids`` of a matrix stored at ``offset`` of ``fd``."""
    raw = np.empty((len(ids), row_bytes), np.uint8)
    for i, t in enumerate(ids):
        if not 0 <= int(t) < n_rows:
            raise ValueError(f"token id {t} outside the vocabulary of {n_rows}")
        if os.preadv(fd, [raw[i]], offset + int(t) * row_bytes) != row_bytes:
            raise OSError(f"short read of row {t}")
    return raw


def dequantize_raw_rows(raw: np.ndarray, qtype: QT, k: int) -> np.ndarray:
    """Float32 ``[len(raw), k]`` from GGUF-block row bytes."""
    if qtype.name in kernels.TYPES:
        return kernels.dequantize(qtype.name, raw, k)
    return dequantize_rows(raw, qtype, k)


def read_rows(fd: int, offset: int, row_bytes: int, n_rows: int, qtype: QT, k: int, ids) -> np.ndarray:
    """Float32 ``[len(ids), k]``: rows ``ids`` of a GGUF-block matrix stored at ``offset`` of ``fd``."""
    return dequantize_raw_rows(read_raw_rows(fd, offset, row_bytes, n_rows, ids), qtype, k)


class EmbeddingTable:
    """Token embedding rows read from the flash file on demand (GGUF-native blocks).

    The table (hundreds of MB) never occupies DRAM: each pass reads the few rows
    it needs and dequantizes them exactly.

    Its bytes are checked like every other region's before anything is computed from them: the
    whole table against the manifest's XXH3 when it opens, so a damaged bundle is refused at load
    as a damaged pinned layer is (40-70 ms for the 1.5B target's 131 MB, read a chunk at a time);
    then each row's CRC-32 as first read is kept and every later read of that row must match it,
    as the stream's probes check the layers it reads again (a row is only ever a few hundred
    bytes read on demand, so keeping a digest per row is cheaper than rehashing the table).
    """

    def __init__(self, bundle: Bundle) -> None:
        e = bundle.embedding
        self.qtype = QT[e["type"]]
        self.offset, self.row_bytes, self.k, self.rows = e["offset"], e["row_bytes"], e["k"], e["rows"]
        self.path = bundle.file(e["file"])
        self.fd = os.open(self.path, os.O_RDONLY)
        self.bytes_read = 0
        try:
            # through the descriptor the rows are read from: a file put in its place after the check
            # is never read
            if e.get("xxh3") and span_digest(self.fd, e["offset"], e["nbytes"],
                                             f"the embedding table of {self.path}") != e["xxh3"]:
                raise ModelError(f"embedding: checksum mismatch in {self.path} at offset {e['offset']} (the region "
                                 f"holding the embedding table): the bundle is damaged; run `lever-actors models "
                                 f"verify`, then reconvert")
        except BaseException:
            os.close(self.fd)
            raise
        # zero-filled by the OS: only the pages of rows actually read become resident
        self.row_crc = np.zeros(self.rows, np.uint32)
        self.row_seen = np.zeros(self.rows, bool)

    def lookup(self, tokens) -> np.ndarray:
        raw = read_raw_rows(self.fd, self.offset, self.row_bytes, self.rows, tokens)
        self.bytes_read += len(tokens) * self.row_bytes
        for i, t in enumerate(tokens):
            self._check_row(int(t), raw[i])
        return dequantize_raw_rows(raw, self.qtype, self.k)

    def _check_row(self, t: int, row: np.ndarray) -> None:
        """Row ``t`` must read back as it did the first time (a CRC-32, about a microsecond a row).
        A mismatch is read again (a transient bad read passes); one that persists means the file
        changed under the process: a FlashFault, never rows computed on."""
        crc = zlib.crc32(row)
        if not self.row_seen[t]:
            self.row_seen[t], self.row_crc[t] = True, crc
            return
        for _ in range(READ_RETRIES):
            if crc == self.row_crc[t]:
                return
            row[:] = read_raw_rows(self.fd, self.offset, self.row_bytes, self.rows, [t])[0]
            crc = zlib.crc32(row)
        if crc != self.row_crc[t]:
            raise FlashFault(f"embedding row {t} ({self.path} at offset {self.offset + t * self.row_bytes}) read "
                             f"back different bytes than when it was first read, {READ_RETRIES + 1} times: the "
                             f"file changed in place (restart, or rerun, to verify it again)", retryable=False)

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class LayerGraphs:
    """Serialized layer graphs, one per distinct tensor-kind signature (layers share them)."""

    bundle: Bundle
    context: int
    accuracy: int
    cache: dict = field(default_factory=dict)

    def for_layer(self, region: Region) -> bytes:
        key = tuple(sorted((k, tuple(sorted(v.items()))) for k, v in region.mats.items()))
        if key not in self.cache:
            from lever_actors.graphs import build_layer  # onnx, only for the ORT layout

            self.cache[key] = build_layer(self.bundle.graph_dims(self.context), region.mat_specs(), self.accuracy)
        return self.cache[key]


class NativeLayer:
    """One decoder layer computed from views of its buffer (which must outlive it).

    Row-wise norm, activation quantization and SwiGLU, matmuls that split output
    columns (never a reduction) and attention in each row's own key order keep
    every token's result independent of the other tokens of its pass.
    """

    def __init__(self, region: Region, buf, eps: float, resident: bool = False, requantize: bool = False,
                 tiles: bool = False) -> None:
        v = region.views(buf)
        self.mats = {m: kernels.NativeMatrix(spec["qtype"], spec["k"], spec["n"], v[f"{m}.data"])
                     for m, spec in region.mats.items()}
        self.vec = {name: v[name] for name in ("attn_norm", "ffn_norm", "attn_q.bias", "attn_k.bias", "attn_v.bias")}
        if requantize:  # the draft's weights to Q4_0, in arrays of their own: nothing keeps ``buf`` alive
            self.mats = {m: kernels.requantized_q4_0(w) if w.qtype in kernels.REQUANTIZABLE else
                         kernels.NativeMatrix(w.qtype, w.k, w.n, w.data.copy()) for m, w in self.mats.items()}
            self.vec = {name: a.copy() for name, a in self.vec.items()}
        if resident:  # a resident buffer is only ever read by this layer: its blocks may be rearranged
            self.mats = {m: kernels.for_draft_cpu(w, tiles) if requantize else kernels.repacked_for_cpu(w)
                         for m, w in self.mats.items()}
        self.eps = eps

    def forward(self, x: np.ndarray, feeds: dict, cache_k, cache_v, dims: dict, lane: LaneConfig) -> np.ndarray:
        """The layer's output rows; writes the new K/V rows into ``cache_k``/``cache_v`` (this layer's cache)."""
        t = lane.threads
        act = kernels.quantize_rows if lane.precision == "int8" else (lambda a: a)
        mm = self.mats
        nh, kvh, d = dims["n_head"], dims["n_kv_head"], dims["head_dim"]
        a = act(kernels.rmsnorm(x, self.vec["attn_norm"], self.eps))
        q = kernels.matmul(mm["attn_q"], a, t) + self.vec["attn_q.bias"]
        k = kernels.matmul(mm["attn_k"], a, t) + self.vec["attn_k.bias"]
        v = kernels.matmul(mm["attn_v"], a, t) + self.vec["attn_v.bias"]
        q = kernels.rope(q, feeds["cos"], feeds["sin"], nh, dims["rope_style"])
        k = kernels.rope(k, feeds["cos"], feeds["sin"], kvh, dims["rope_style"])
        slots = feeds["kv_index"][0, :, 1]
        cache_k[:, slots, :] = k.reshape(-1, kvh, d).transpose(1, 0, 2)
        cache_v[:, slots, :] = v.reshape(-1, kvh, d).transpose(1, 0, 2)
        attn = kernels.attention(q, cache_k, cache_v, feeds["perm"], feeds["lengths"], nh, 1.0 / np.sqrt(d), t)
        h = x + kernels.matmul(mm["attn_output"], act(attn), t)
        a = act(kernels.rmsnorm(h, self.vec["ffn_norm"], self.eps))
        gate = kernels.matmul(mm["ffn_gate"], a, t)
        up = kernels.matmul(mm["ffn_up"], a, t)
        return h + kernels.matmul(mm["ffn_down"], act(kernels.swiglu(gate, up)), t)


class NativeHead:
    """Final norm + one vocabulary slice of the LM head, from views of its buffer."""

    def __init__(self, region: Region, buf, eps: float) -> None:
        v = region.views(buf)
        spec = region.mats["output"]
        self.w = kernels.NativeMatrix(spec["qtype"], spec["k"], spec["n"], v["output.data"])
        self.norm = v["output_norm"]
        self.eps = eps

    def logits(self, h: np.ndarray, lane: LaneConfig) -> np.ndarray:
        hn = kernels.rmsnorm(np.ascontiguousarray(h, np.float32), self.norm, self.eps)
        return kernels.matmul(self.w, kernels.quantize_rows(hn) if lane.precision == "int8" else hn, lane.threads)


def requantized_bytes(region: Region) -> int:
    """A native layer region's bytes once its requantizable matrices are Q4_0 (``NativeLayer(requantize=True)``)."""
    saved = sum(spec["n"] * (kernels.row_bytes(spec["qtype"], spec["k"]) - kernels.row_bytes("Q4_0", spec["k"]))
                for spec in region.mats.values() if spec["qtype"] in kernels.REQUANTIZABLE)
    return region.nbytes - saved


class Transformer:
    """Embedding + layer sessions + head for one model and one KV cache.

    Layer sessions are either resident (built once) or supplied per pass by the
    caller from streamed buffers (:meth:`layer_session_from_buffer`).
    """

    def __init__(self, bundle: Bundle, context: int, lane: LaneConfig, resident_layers=None, load_head: bool = True,
                 requantize: bool = False, tiles: bool = False) -> None:
        """``requantize``: resident native layers' Q5_0 / Q6_K / Q8_0 matrices become Q4_0 (a draft only:
        the target's arithmetic must stay the GGUF's); ``tiles``: that Q4_0 in AMX tile strips."""
        d = bundle.dims
        self.bundle, self.context, self.lane = bundle, context, lane
        self.requantize = requantize and bundle.layout == "native"
        self.tiles = tiles and self.requantize and kernels.tiles_take(lane.precision)
        self.n_layer, self.hidden, self.head_dim = d["n_layer"], d["hidden"], d["head_dim"]
        self.n_kv_head, self.vocab = d["n_kv_head"], d["vocab_size"]
        self.rope_base = float(d["rope_base"])
        self.eps = float(d["rms_eps"])
        self.native = bundle.layout == "native"
        self.graphs = LayerGraphs(bundle, context, lane.accuracy)
        self.regions = bundle.layers
        self.embedding = EmbeddingTable(bundle)
        self.kv = KVCache(self.n_layer, self.n_kv_head, context, self.head_dim,
                          kv_dtype(bundle.layout, lane.precision))
        self.head_regions = bundle.head_chunks
        self.n_head_chunks = len(self.head_regions)
        self._head_graphs: dict[int, bytes] = {}
        self.head_bytes = bundle.head_bytes()
        self.head_sessions = [self.head_session_from_buffer(c, read_region(bundle, r))
                              for c, r in enumerate(self.head_regions)] if load_head else None
        layers = range(self.n_layer) if resident_layers is None else resident_layers
        self.resident: dict[int, object] = {}  # layer -> NativeLayer or ORT session
        self.resident_bytes = 0
        for i in layers:
            try:
                buf = read_region(bundle, self.regions[i])
            except ModelError as exc:
                raise ModelError(f"layer {i}: {exc}") from None
            self.resident[i] = self.layer_session_from_buffer(i, buf, resident=True)
            self.resident_bytes += requantized_bytes(self.regions[i]) if self.requantize else self.regions[i].nbytes

    def use_threads(self, n: int) -> None:
        """Kernel threads of the calls from now on: native kernels take them per call (ORT sessions
        keep the threads they were made with). A lane lends or borrows an idle core this way."""
        from dataclasses import replace

        if self.lane.threads != n:
            self.lane = replace(self.lane, threads=n)

    def head_session_from_buffer(self, chunk: int, buf) -> object:
        """The computation of one head slice; a native one keeps ``buf`` (no copy)."""
        region = self.head_regions[chunk]
        if self.native:
            return NativeHead(region, buf, self.eps)
        spec = region.mat_specs()["output"]
        if spec.n not in self._head_graphs:
            from lever_actors.graphs import build_head  # onnx, only for the ORT layout

            self._head_graphs[spec.n] = build_head(self.hidden, spec, float(self.bundle.dims["rms_eps"]), self.lane.accuracy)
        return make_session(self._head_graphs[spec.n], region.views(buf), self.lane)

    def layer_session_from_buffer(self, i: int, buf, resident: bool = False) -> object:
        """The computation of layer ``i``: a :class:`NativeLayer` over ``buf`` or an ORT session (copies
        ``buf``); a ``resident`` layer owns ``buf`` for good (its weights may be rearranged in place)."""
        region = self.regions[i]
        if self.native:
            return NativeLayer(region, buf, self.eps, resident, requantize=resident and self.requantize,
                               tiles=self.tiles)
        return make_session(self.graphs.for_layer(region), region.views(buf), self.lane)

    def feeds(self, positions: np.ndarray, slots: np.ndarray, layout: dict) -> dict:
        cos, sin = rope_tables(positions, self.head_dim, self.rope_base)
        n = len(slots)
        idx = np.empty((self.n_kv_head, n, 2), np.int64)
        idx[:, :, 0] = np.arange(self.n_kv_head)[:, None]
        idx[:, :, 1] = slots[None, :]
        return {"cos": cos, "sin": sin, "kv_index": idx, **layout}

    def run_layer(self, i: int, session, x: np.ndarray, feeds: dict, slots: np.ndarray) -> np.ndarray:
        if self.native:
            return session.forward(x, feeds, self.kv.k[i], self.kv.v[i], self.bundle.dims, self.lane)
        ort_feeds = {k: v for k, v in dense_layout(feeds, self.context).items() if k != "lengths"}
        y, k_new, v_new = session.run(None, {"x": x, "past_k": self.kv.k[i], "past_v": self.kv.v[i], **ort_feeds})
        self.kv.write(i, slots, k_new, v_new)
        return y

    def head_logits(self, session, hidden_rows: np.ndarray) -> np.ndarray:
        """Logits of one head slice for ``hidden_rows`` [M, H]."""
        if self.native:
            return session.logits(hidden_rows, self.lane)
        return session.run(None, {"h": np.ascontiguousarray(hidden_rows, np.float32)})[0]

    def logits(self, hidden_rows: np.ndarray) -> np.ndarray:
        return np.concatenate([self.head_logits(s, hidden_rows) for s in self.head_sessions], axis=-1)

    def forward_resident(self, tokens, positions, slots, layout, stop=None) -> np.ndarray:
        """All layers resident: final hidden states ``[N, H]`` of ``tokens``. ``stop`` (a callable) is
        asked before every layer; when it says so the call raises :class:`Stopped`, and the slots'
        KV rows are left written up to some layer (the caller must not trust them)."""
        slots = np.asarray(slots, np.int64)
        x = self.embedding.lookup(tokens)
        feeds = self.feeds(np.asarray(positions), slots, layout)
        for i in range(self.n_layer):
            if stop is not None and stop():
                raise Stopped(f"stopped before layer {i}")
            x = self.run_layer(i, self.resident[i], x, feeds, slots)
        return x

    def prefill(self, tokens: list[int], chunk: int = FEED_CHUNK) -> np.ndarray:
        """Run the prompt through a resident model in chunks; returns the last hidden row."""
        last = None
        for s in range(0, len(tokens), chunk):
            part = tokens[s:s + chunk]
            p0 = self.kv.length
            slots = np.arange(p0, p0 + len(part))
            h = self.forward_resident(part, slots, slots, causal_layout(self.context, p0, len(part)))
            self.kv.commit(slots)
            last = h[-1:]
        return last


def timed(fn, *a, **k):
    t = time.perf_counter()
    out = fn(*a, **k)
    return out, time.perf_counter() - t

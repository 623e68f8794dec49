"""Early-exit pruning: score tree nodes at an intermediate target layer, drop the hopeless ones.

Pure numpy (plus reading LM-head rows from the bundle file), no trio.

The score is a logit lens restricted to a few tokens. After exit layer ``e`` the
hidden row of a node's *parent* ``p`` goes through the final RMSNorm and is
dotted with the LM-head rows of the node's own token and of the draft's other
top tokens after ``p`` (its ``alternatives``)::

    margin(v) = lens(h_p)[tok_v] - max over c in alternatives(p), c != tok_v, of lens(h_p)[c]

A node whose margin is below the calibrated threshold is pruned together with
its subtree: the layers after ``e`` and the LM head compute only the survivors.
Pruning never changes what is committed except by dropping candidates, and
every committed token is still the final layer's argmax, so greedy output stays
exactly the target's. A node whose parent has no alternative besides its own
token keeps a margin of +inf (nothing to compare with).

The threshold comes from ``tools/calibrate_prune.py`` (HumanEval 0-79, a recall
target); :func:`calibration_for` looks it up by the target GGUF's digest.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from lever_actors.bundle import Bundle

CALIBRATION_FILE = Path(__file__).with_name("prune_calibration.json")
ALTERNATIVES = 4  # draft top tokens kept per node as the pruner's competitors


def lens_rows(h: np.ndarray, norm_w: np.ndarray, eps: float) -> np.ndarray:
    """Hidden rows (float64) through the target's final RMS norm: what the LM-head rows are dotted with."""
    return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * norm_w.astype(np.float64)


def lens_margins(hidden: np.ndarray, rows_of: dict[int, int], parents: np.ndarray, tokens: np.ndarray,
                 alternatives: np.ndarray, head_rows, norm_w: np.ndarray, eps: float,
                 nodes: np.ndarray) -> np.ndarray:
    """Margins of ``nodes`` (each with a parent whose hidden row is ``hidden[rows_of[parent]]``).

    ``head_rows(ids)`` returns the float32 LM-head rows ``[len(ids), H]`` of token ids.
    """
    margins = np.full(len(nodes), np.inf)
    if len(nodes) == 0:
        return margins
    par = parents[nodes]
    uniq = np.unique(par)
    h = hidden[[rows_of[int(p)] for p in uniq]].astype(np.float64)
    z = lens_rows(h, norm_w, eps)
    vocab = np.unique(np.concatenate([alternatives[uniq].ravel(), tokens[nodes]]))
    col = {int(t): j for j, t in enumerate(vocab)}
    lens = z @ head_rows(vocab).astype(np.float64).T  # [parents, |vocab|]
    zrow = {int(p): r for r, p in enumerate(uniq)}
    for j, (v, p) in enumerate(zip(nodes, par)):
        r, tok = zrow[int(p)], int(tokens[v])
        rivals = [col[int(c)] for c in alternatives[p] if int(c) != tok]
        if rivals:
            margins[j] = lens[r, col[tok]] - lens[r, rivals].max()
    return margins


def predict_outcome(hidden: np.ndarray, rows_of: dict[int, int], parents: np.ndarray, tokens: np.ndarray,
                    alternatives: np.ndarray, head_rows, norm_w: np.ndarray, eps: float,
                    alive: np.ndarray) -> tuple[tuple[int, ...], int]:
    """The outcome of a pass as the logit lens at an exit layer sees it: (accepted path, next token).

    From the root, each step takes the lens's best token after the current node among the
    tree's (alive) children there and the draft's ``alternatives`` after it; a child's token
    extends the path, any other token is the target's predicted next token and ends the walk.
    At a node the draft never expanded (its alternatives list only its own token) the next
    token is not predicted (-1). Greedy acceptance walks the same way with the final layer's
    argmax over the whole vocabulary, so the lens predicts the commit exactly when, along this
    path, its ranking of these few tokens agrees with the target's.
    """
    kids: dict[int, dict[int, int]] = {}
    for v in range(1, len(parents)):
        if alive[v] and alive[parents[v]]:
            kids.setdefault(int(parents[v]), {})[int(tokens[v])] = v
    path: list[int] = []
    node = 0
    while True:
        children = kids.get(node, {})
        alts = [int(t) for t in alternatives[node]]
        expanded = any(t != int(tokens[node]) for t in alts)
        cands = list(dict.fromkeys(list(children) + (alts if expanded else [])))
        if node not in rows_of or not cands or (not expanded and not children):
            return tuple(path), -1
        z = lens_rows(hidden[rows_of[node]].astype(np.float64), norm_w, eps)
        best = cands[int(np.argmax(head_rows(cands).astype(np.float64) @ z))]
        if best not in children:
            return tuple(path), best if expanded else -1
        path.append(best)
        node = children[best]


def prune_mask(parents: np.ndarray, alive: np.ndarray, margins: dict[int, float], threshold: float | None) -> np.ndarray:
    """Which nodes survive: ancestor-closed, root kept, a margin below ``threshold`` drops a subtree.

    ``alive[i]`` says node i survived earlier exits; ``margins`` maps scored nodes
    to their margin (unscored nodes count as +inf).
    """
    keep = np.array(alive, bool, copy=True)
    keep[0] = True
    for i in range(1, len(parents)):  # parents come first (topological order)
        if not keep[i] or not keep[parents[i]]:
            keep[i] = False
        elif threshold is not None and margins.get(i, np.inf) < threshold:
            keep[i] = False
    return keep


def directly_pruned(parents: np.ndarray, before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """Nodes dropped by their own score (alive before, parent still alive, dropped now)."""
    idx = np.arange(len(parents))
    par_alive = np.concatenate([[True], after[parents[1:]]])
    return idx[before & ~after & par_alive]


def misses(parents: np.ndarray, tokens: np.ndarray, argmax: np.ndarray, path: list[int], pruned) -> int:
    """Pruned nodes the target would have accepted: the parent is on the accepted path and the
    node's token is the target's choice there (exact, since the parent was computed to the end)."""
    on_path = set(int(n) for n in path)
    return sum(1 for v in pruned if int(parents[v]) in on_path and int(tokens[v]) == int(argmax[parents[v]]))


class HeadRows:
    """Float32 rows of the LM head by token id, read from the bundle file, with a bounded cache.

    Only native-layout heads (GGUF blocks per row) can be read a row at a time.
    """

    def __init__(self, bundle: Bundle, cache_rows: int = 2048) -> None:
        from lever_actors.errors import ConfigError

        if bundle.layout != "native":
            raise ConfigError(f"{bundle.path}: pruning reads LM-head rows, which needs the native layout")
        self.chunks = []  # (first token, fd offset of the rows, row bytes, rows, qtype, k)
        lo = 0
        self.fds: dict[str, int] = {}
        for region in bundle.head_chunks:
            spec = region.mats["output"]
            ref = next(a for a in region.arrays if a.name == "output.data")
            fd = self.fds.setdefault(region.file, os.open(bundle.file(region.file), os.O_RDONLY))
            self.chunks.append((lo, fd, region.offset + ref.offset, ref.shape[1], spec["n"], QT[spec["qtype"]],
                                spec["k"]))
            lo += spec["n"]
        self.vocab = lo
        self.norm = _read_norm(bundle, bundle.head_chunks[0])
        self.cache: dict[int, np.ndarray] = {}
        self.cache_rows = cache_rows
        self.bytes_read = 0

    @property
    def cache_bytes(self) -> int:
        return self.cache_rows * len(self.norm) * 4

    def __call__(self, ids) -> np.ndarray:
        from lever_actors.model import read_rows

        out = np.empty((len(ids), len(self.norm)), np.float32)
        for j, t in enumerate(ids):
            t = int(t)
            row = self.cache.get(t)
            if row is None:
                if not 0 <= t < self.vocab:
                    raise ValueError(f"token id {t} outside the vocabulary of {self.vocab}")
                lo, fd, off, row_bytes, n, qtype, k = next(c for c in reversed(self.chunks) if c[0] <= t)
                row = read_rows(fd, off, row_bytes, n, qtype, k, [t - lo])[0]
                self.bytes_read += row_bytes
                if len(self.cache) >= self.cache_rows:
                    self.cache.pop(next(iter(self.cache)))  # oldest first
                self.cache[t] = row
            out[j] = row
        return out

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def _read_norm(bundle: Bundle, region) -> np.ndarray:
    """The final-norm weights stored with a head slice (read alone: the slice is a layer's size)."""
    ref = next(a for a in region.arrays if a.name == "output_norm")
    with open(bundle.file(region.file), "rb") as f:
        f.seek(region.offset + ref.offset)
        return np.frombuffer(f.read(ref.nbytes), ref.dtype).reshape(ref.shape).astype(np.float32)


def calibration_for(bundle: Bundle) -> dict | None:
    """The calibrated exit layer and threshold of this target (by GGUF digest), if any."""
    if not CALIBRATION_FILE.exists():
        return None
    table = json.loads(CALIBRATION_FILE.read_text())
    return table.get(bundle.manifest.get("source", {}).get("sha256", ""))

"""Prompt caching beyond the live sequence: the KV rows of recent sequences, LRU within a byte cap.

Pure numpy, no trio. Each model's KV cache holds one *live* sequence; a new prompt keeps the
rows of the prefix it shares with it (``KVCache.reusable``). With several conversations
interleaved (two chats of one app, two apps on one daemon) the live rows are always the other
conversation's. A :class:`PrefixStore` keeps copies of the sequences a new prompt would
overwrite, and gives a prompt the longest prefix found among the live rows and its copies.

A row's K/V depend only on the tokens up to it, so restored rows are exactly the rows a cold
prefill would compute (the verifier's and drafter's numerics are batch-invariant): the output
is the same whether a prefix came from the store, the live rows or a prefill.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from lever_actors.model import KVCache, common_prefix

MIN_STORED_ROWS = 16  # a sequence shorter than this is cheaper to prefill again than to keep


@dataclass
class StoredPrefix:
    tokens: tuple[int, ...]
    k: np.ndarray  # [n_layer, KVH, n, D]
    v: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def row_bytes(kv: KVCache) -> int:
    """Bytes one sequence position takes in ``kv`` (K and V of every layer)."""
    n_layer, kvh, _, d = kv.k.shape
    return 2 * n_layer * kvh * d * kv.k.itemsize


class PrefixStore:
    """Copies of recent sequences' KV rows for one model, at most ``capacity`` bytes, least recently used first out."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(int(capacity), 0)
        self.entries: OrderedDict[int, StoredPrefix] = OrderedDict()
        self._next = 0
        self.restored = 0  # prompts that took their prefix from a copy (not the live rows)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def resume(self, kv: KVCache, prompt, reuse: bool = True) -> int:
        """Ready ``kv`` for a new sequence starting with ``prompt``; returns how many rows it keeps.

        The live sequence is copied into the store first when the new one would overwrite rows of it.
        With ``reuse``, ``kv`` then holds the longest prefix of ``prompt`` found among the live
        rows and the stored copies (short of its last token, whose logits are needed); without,
        nothing (the prompt is computed whole).
        """
        prompt = list(prompt)
        live = kv.reusable(prompt) if reuse else 0
        best, best_n = None, live
        if reuse:
            for key, e in self.entries.items():
                n = common_prefix(e.tokens, prompt[:-1])
                if n > best_n:
                    best, best_n = key, n
        e = self.entries.get(best)
        if kv.tokens is not None and kv.length - live >= MIN_STORED_ROWS:
            self.store(kv, keep=best)  # never at the cost of ``e``: copied from below, it would outlive its eviction
        if e is None:
            kv.truncate(live)
            return live
        self.entries.move_to_end(best)
        kv.k[:, :, :best_n] = e.k[:, :, :best_n]
        kv.v[:, :, :best_n] = e.v[:, :, :best_n]
        kv.length, kv.tokens = best_n, list(e.tokens[:best_n])
        self.restored += 1
        return best_n

    def store(self, kv: KVCache, keep: int | None = None) -> bool:
        """Copy the live sequence of ``kv`` in (evicting the least recently used, never entry ``keep``);
        False if it cannot fit. The cap holds at every moment, not only between calls."""
        n = kv.length
        tokens = tuple(kv.tokens[:n]) if kv.tokens is not None else None
        need = n * row_bytes(kv)
        kept = self.entries[keep].nbytes if keep in self.entries else 0
        if tokens is None or n < MIN_STORED_ROWS or kept + need > self.capacity:
            return False
        for key, e in list(self.entries.items()):  # a stored prefix of this sequence is superseded by it
            if key != keep and len(e.tokens) <= n and tokens[:len(e.tokens)] == e.tokens:
                del self.entries[key]
            elif len(e.tokens) > n and e.tokens[:n] == tokens:
                self.entries.move_to_end(key)
                return True  # already held, by a longer copy
        while self.nbytes + need > self.capacity:  # ends: ``keep`` and the copy fit together
            del self.entries[next(k for k in self.entries if k != keep)]
        self.entries[self._next] = StoredPrefix(tokens, kv.k[:, :, :n].copy(), kv.v[:, :, :n].copy())
        self._next += 1
        return True

"""What a verification pass keeps of the target's LM head, one vocabulary slice at a time.

The streamed head arrives in slices of the vocabulary. A greedy pass needs only
each row's argmax, so it keeps a running maximum and never holds ``[rows, V]``
logits (151,936 floats a row for Qwen: 20 MB for a 33-node tree, and twice that
while the slices were concatenated). A sampled pass needs the whole rows; they
are written into one preallocated array, not concatenated from the slices.

The running argmax is exactly ``np.argmax`` over the concatenated logits: the
first index of the largest value, a NaN counting as the largest (numpy's rule).
"""
from __future__ import annotations

import numpy as np


class HeadScores:
    """Collects the head's slices, in vocabulary order, for ``rows`` rows of a pass."""

    def __init__(self, rows: int, vocab: int, want_logits: bool) -> None:
        self.vocab, self.filled = vocab, 0
        self.logits = np.empty((rows, vocab), np.float32) if want_logits else None
        self._best = np.full(rows, -np.inf, np.float32)
        self._arg = np.zeros(rows, np.int32)
        self._nan = np.zeros(rows, bool)  # a NaN was seen: the first one wins, as in np.argmax

    def add(self, part: np.ndarray) -> None:
        """The next slice's logits ``[rows, width]``."""
        lo, width = self.filled, part.shape[1]
        if lo + width > self.vocab or part.shape[0] != len(self._arg):
            raise ValueError(f"head slice of shape {part.shape} at column {lo} does not fit "
                             f"{len(self._arg)} rows x {self.vocab}")
        self.filled += width
        if self.logits is not None:
            self.logits[:, lo:lo + width] = part
        if not width:
            return
        arg = np.argmax(part, axis=1)
        best = part[np.arange(len(arg)), arg]
        nan = np.isnan(best)  # np.argmax returns a slice's first NaN when it has one
        take = (best > self._best) & ~self._nan | nan & ~self._nan
        self._best[take] = best[take]
        self._arg[take] = arg[take] + lo
        self._nan |= nan

    @property
    def argmax(self) -> np.ndarray:
        if self.filled != self.vocab:
            raise ValueError(f"the head covered {self.filled} of {self.vocab} vocabulary entries")
        return self._arg.copy()

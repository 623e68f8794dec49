"""Free branches: prompt-lookup (n-gram) continuations merged into the drafted tree.

Pure Python and numpy, no trio. Code repeats itself: names, argument lists and
whole lines of the prompt come back in the output. The most recent earlier
occurrence of the context's last few tokens predicts what follows at no draft
cost. :func:`merge_branch` hangs such a continuation below the root of the
drafted tree, sharing the nodes the draft already proposed, and marks the new
nodes so the planner weighs them with their own calibrated acceptance.
"""
from __future__ import annotations

import numpy as np


def prompt_lookup(context: list[int], max_len: int, min_match: int = 2, max_match: int = 4) -> list[int]:
    """Up to ``max_len`` tokens that followed the most recent earlier occurrence of the longest
    suffix of ``context`` (between ``min_match`` and ``max_match`` tokens long); [] when none recurs."""
    n = len(context)
    if max_len < 1 or n <= min_match:
        return []
    arr = np.asarray(context, np.int64)
    for m in range(min(max_match, n - 1), min_match - 1, -1):
        suffix = arr[n - m:]
        # candidate starts whose m-gram equals the suffix and that end before the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(arr[: n - 1], m)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        hits = hits[hits + m < n]
        if hits.size:
            start = int(hits[-1]) + m  # the most recent occurrence
            return [int(t) for t in arr[start: start + max_len]]
    return []


def merge_branch(tokens: list[int], parents: list[int], branch: list[int]) -> tuple[list[int], list[int], int]:
    """Hang the chain ``branch`` below the root (node 0) of a tree, reusing nodes it shares.

    ``tokens[i - 1]`` is node i's token and ``parents`` numbers the root 0 (parent -1), as in
    the driver's trees. Returns (tokens, parents, first new node id); new nodes come after every
    old one, so the ids stay topological.
    """
    tokens, parents = list(tokens), list(parents)
    first_new = len(parents)
    node = 0
    for tok in branch:
        child = next((i for i in range(1, len(parents)) if parents[i] == node and tokens[i - 1] == tok), None)
        if child is None:
            tokens.append(int(tok))
            parents.append(node)
            child = len(parents) - 1
        node = child
    return tokens, parents, first_new

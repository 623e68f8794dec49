"""Sampling and speculative acceptance: pure functions over small numpy arrays.

Randomness never depends on scheduling: every random decision draws from a
generator derived from ``(seed, step, node)`` (see :func:`rng_for`), so a run is
reproducible however the actors interleave.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def rng_for(seed: int, step: int, node: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, step, node])


def probs_from_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a token is drawn from: softmax(logits / T) restricted to the top-p nucleus."""
    z = logits.astype(np.float64) / params.temperature
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, params.top_p) + 1)]
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return p


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    return int(min(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right"), len(p) - 1))


def next_token(logits: np.ndarray, params: SamplingParams, step: int) -> int:
    if params.greedy:
        return int(np.argmax(logits))
    return sample(probs_from_logits(logits, params), rng_for(params.seed, step))


def children_of(parents: np.ndarray) -> dict[int, list[int]]:
    """node -> its children, in node order (the order siblings are tried in)."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            children.setdefault(int(p), []).append(i)
    return children


def accept_greedy(parents: np.ndarray, tokens: np.ndarray, target_argmax: np.ndarray) -> tuple[list[int], list[int]]:
    """Longest tree path the target agrees with.

    ``parents[i]`` is node ``i``'s parent (-1 for the root, node 0 = last committed
    token), ``tokens[i]`` its token, ``target_argmax[i]`` the target's greedy
    choice after node ``i``. Returns (accepted node ids root first, committed
    tokens): the accepted drafted tokens plus the target's own next token, so at
    least one token is always committed.
    """
    children = children_of(parents)
    path, node = [0], 0
    while True:
        want = int(target_argmax[node])
        nxt = next((c for c in children.get(node, []) if int(tokens[c]) == want), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    committed = [int(tokens[i]) for i in path[1:]] + [int(target_argmax[path[-1]])]
    return path, committed


def accept_sampled(parents: np.ndarray, tokens: np.ndarray, draft_probs: list, target_probs: list,
                   seed: int, step: int) -> tuple[list[int], list[int]]:
    """Tree speculative sampling (recursive rejection over siblings); lossless in distribution.

    ``draft_probs[i]`` is the full draft distribution that node ``i``'s children
    were drawn from (or None for a node without children), ``target_probs[i]`` the
    target distribution after node ``i``. At each node the children are tried in
    order: child ``c`` with token ``x`` is accepted with probability
    ``min(1, q(x)/p(x))``; on rejection ``q <- norm(max(q - p, 0))`` and ``p`` has
    ``x`` removed and is renormalised (sampling without replacement). When no
    child is accepted the token is drawn from the residual ``q``.
    """
    children = children_of(parents)
    path, node = [0], 0
    while True:
        q = np.asarray(target_probs[node], np.float64).copy()
        p = None if draft_probs[node] is None else np.asarray(draft_probs[node], np.float64).copy()
        rng = rng_for(seed, step, node)
        chosen = None
        for c in children.get(node, []):
            x = int(tokens[c])
            if p is None or p[x] <= 0:
                continue
            if rng.random() * p[x] < q[x]:  # accept with prob min(1, q/p)
                chosen = c
                break
            q = np.maximum(q - p, 0.0)
            s = q.sum()
            q = q / s if s > 0 else np.asarray(target_probs[node], np.float64)
            p[x] = 0.0
            ps = p.sum()
            p = p / ps if ps > 0 else None
            if p is None:
                break
        if chosen is None:
            path_tokens = [int(tokens[i]) for i in path[1:]]
            return path, path_tokens + [sample(q, rng)]
        path.append(chosen)
        node = chosen

"""Sampling and speculative acceptance: pure functions over small numpy arrays.

Randomness never depends on scheduling. Coupled sampling (the default) draws the
token at sequence position ``i`` as ``argmax(log p_i + g_i)``, with Gumbel noise
``g_i`` that depends on ``(seed, i)`` alone (:func:`gumbel_noise`): the Gumbel-max
trick, an exact draw from ``p_i``. A seeded run is then one sequence whatever drafts,
trees and schedules produced it, the same as the target sampling alone, and the
draft proposes ``argmax(log q_i + g_i)`` under the same noise: sampled speculation
becomes greedy speculation on perturbed scores. The other sampler (speculative
rejection sampling, ``+no-coupled``) draws from generators derived from
``(seed, step, node)`` (see :func:`rng_for`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    # coupled sampling (Gumbel noise by position, see the module's docstring); False: speculative
    # rejection sampling with draws by (step, node)
    coupled: bool = True

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def argmax_like(self) -> bool:
        """Whether the target's token after a node is a function of the node alone (greedy, or
        coupled sampling), so speculation is accepted as greedy speculation is."""
        return self.greedy or self.coupled


def rng_for(seed: int, step: int, node: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, step, node])


COUPLED_STREAM = 0x6E0153  # keeps the noise's generators apart from rng_for's


NOISE_CACHE_ENTRIES = 8  # noise rows kept (0.6 MB each for this pair; the DRAM budget plans them)


@functools.lru_cache(maxsize=NOISE_CACHE_ENTRIES)  # the drafter and the acceptor ask for the same few positions
def gumbel_noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """Standard Gumbel noise for the token at sequence ``position``: float32 ``[vocab]``, read-only,
    a pure function of ``(seed, position)`` (id ``v``'s value does not depend on ``vocab`` beyond ``v``)."""
    u = np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, position, COUPLED_STREAM]).random(vocab, dtype=np.float32)
    np.maximum(u, np.float32(2.0 ** -25), out=u)  # [0, 1) -> (0, 1): every id finite noise
    g = -np.log(-np.log(u))
    g.flags.writeable = False
    return g


def coupled_scores(logits: np.ndarray, params: SamplingParams, position: int,
                   ids: np.ndarray | None = None, vocab: int = 0) -> np.ndarray:
    """``log p + g`` up to a constant, float64, for the token at sequence ``position``: ``p`` is
    :func:`probs_from_logits` (ids outside the top-p nucleus score -inf), ``g`` the position's
    noise. ``logits`` may cover only the vocabulary ids ``ids`` (a draft's subset head) of a
    vocabulary of ``vocab``."""
    z = logits.astype(np.float64) / params.temperature
    if params.top_p < 1.0:
        z = np.where(probs_from_logits(logits, params) > 0, z, -np.inf)
    g = gumbel_noise(params.seed, position, len(logits) if ids is None else vocab)
    return z + (g if ids is None else g[np.asarray(ids)])


def probs_from_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a token is drawn from: softmax(logits / T) restricted to the top-p nucleus."""
    z = logits.astype(np.float64) / params.temperature
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if params.top_p < 1.0:
        keep = nucleus(p, params.top_p)
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return p


NUCLEUS_FIRST_GUESS = 256  # candidates sorted first; a nucleus is usually far smaller than the vocabulary


def nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """The top-p nucleus of ``p``: ids in order of falling probability (ties by id) until the mass
    reaches ``top_p``, the same ids a stable sort of the whole vocabulary gives. Only the ids at or
    above the m-th largest probability are sorted, m growing fourfold until their mass reaches ``top_p``:
    every id left out is less probable than every id sorted, so the sorted ones are the full order's
    first ids and their running sums the same floats (a full sort of 151,936 ids took ~25 ms a call)."""
    m = NUCLEUS_FIRST_GUESS
    while True:
        if m >= len(p):
            order = np.argsort(-p, kind="stable")
        else:
            cut = np.partition(p, len(p) - m)[len(p) - m]
            cand = np.flatnonzero(p >= cut)
            order = cand[np.argsort(-p[cand], kind="stable")]
        cum = np.cumsum(p[order])
        end = int(np.searchsorted(cum, top_p))
        if end < len(order) or len(order) == len(p):
            return order[: end + 1]
        m *= 4


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    return int(min(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right"), len(p) - 1))


def next_token(logits: np.ndarray, params: SamplingParams, step: int, position: int) -> int:
    """The target's token at sequence ``position`` (the ``step``-th drawn by the rejection sampler)."""
    if params.greedy:
        return int(np.argmax(logits))
    if params.coupled:
        return int(np.argmax(coupled_scores(logits, params, position)))
    return sample(probs_from_logits(logits, params), rng_for(params.seed, step))


def children_of(parents: np.ndarray) -> dict[int, list[int]]:
    """node -> its children, in node order (the order siblings are tried in)."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            children.setdefault(int(p), []).append(i)
    return children


def tree_depths(parents: np.ndarray) -> np.ndarray:
    """Each node's depth below node 0 (int32; parents point to smaller ids)."""
    depths = np.zeros(len(parents), np.int32)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths


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

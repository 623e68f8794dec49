"""Gain/cost tree planning: pick the drafted subtree with the most expected tokens per second.

Pure numpy, no trio. For a candidate tree ``T`` (node 0 = root):

* gain ``G(T) = 1 + sum_v p(v)``, ``p(v)`` the calibrated probability that the path
  root->v is accepted: the product over the path of ``acc(depth, draft-prob bin)``,
  learned online from verified passes (:class:`AcceptanceCalibration`);
* cost ``C(T) = draft_s + pass_fixed_s + compute_per_node_s * |T|``: the part of a
  pass that does not depend on the tree (flash reads and session builds of
  streamed layers, overlapped as the pipeline overlaps them) plus the part that
  grows with the number of verified nodes; every term is measured on the running
  machine and updated after each pass (:class:`CostModel`).

:func:`plan_tree` grows the subtree greedily by best ``p(v)`` (a node is
eligible once its parent is in) while ``G/C`` rises, within node and depth caps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PROB_BINS = np.array([0.0, 0.05, 0.15, 0.3, 0.5, 0.7, 0.85, 0.95, 1.0001])


@dataclass
class AcceptanceCalibration:
    """P(node accepted | parent accepted) per (depth, draft-probability bin), with a Beta prior."""

    max_depth: int = 16
    prior: float = 2.0  # pseudo-observations pulling each cell toward the draft's own probability
    hits: np.ndarray = field(default=None)
    seen: np.ndarray = field(default=None)

    def __post_init__(self) -> None:
        shape = (self.max_depth + 1, len(PROB_BINS) - 1)
        if self.hits is None:
            self.hits = np.zeros(shape)
        if self.seen is None:
            self.seen = np.zeros(shape)

    def _cell(self, depth: np.ndarray, prob: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        d = np.minimum(np.asarray(depth), self.max_depth)
        b = np.clip(np.searchsorted(PROB_BINS, np.asarray(prob), side="right") - 1, 0, len(PROB_BINS) - 2)
        return d, b

    def conditional(self, depth, prob) -> np.ndarray:
        """Calibrated acceptance of each node given that its parent was accepted."""
        d, b = self._cell(depth, prob)
        prob = np.asarray(prob, np.float64)
        return (self.hits[d, b] + self.prior * prob) / (self.seen[d, b] + self.prior)

    def observe(self, depth, prob, accepted) -> None:
        """Record verified nodes whose parent was accepted (only they tell us anything)."""
        d, b = self._cell(depth, prob)
        np.add.at(self.seen, (d, b), 1.0)
        np.add.at(self.hits, (d, b), np.asarray(accepted, np.float64))


@dataclass
class CostModel:
    """Seconds per pass as a function of tree size, from exponential moving averages."""

    pass_fixed_s: float | None = None
    compute_per_node_s: float | None = None
    draft_per_node_s: float | None = None
    alpha: float = 0.3

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def observe(self, n_nodes: int, pass_s: float, compute_s: float, draft_s: float) -> None:
        per_node = compute_s / max(n_nodes, 1)
        self.compute_per_node_s = self._ema(self.compute_per_node_s, per_node)
        self.pass_fixed_s = self._ema(self.pass_fixed_s, max(pass_s - draft_s - per_node * n_nodes, 0.0))
        self.draft_per_node_s = self._ema(self.draft_per_node_s, draft_s / max(n_nodes - 1, 1))

    @property
    def ready(self) -> bool:
        return self.pass_fixed_s is not None

    def cost(self, n_nodes: int) -> float:
        return (self.pass_fixed_s + (self.compute_per_node_s + self.draft_per_node_s) * n_nodes)


def path_probabilities(parents: np.ndarray, cond: np.ndarray) -> np.ndarray:
    """p(v) = product of conditional acceptances along root->v (root = 1, parents[0] = -1)."""
    p = np.ones(len(parents))
    for i in range(1, len(parents)):
        p[i] = p[parents[i]] * cond[i]
    return p


def plan_tree(parents: np.ndarray, path_p: np.ndarray, cost, max_nodes: int, max_depth: int) -> list[int]:
    """Node ids (root first, ancestor-closed, in id order) of the subtree maximizing G/C greedily.

    ``cost(n)`` is the pass time for ``n`` verified nodes. Growth adds the eligible
    node with the largest ``p(v)`` and stops when the ratio would fall.
    """
    parents = np.asarray(parents)
    n = len(parents)
    depth = np.zeros(n, int)
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    chosen, chosen_set = [0], {0}
    gain = 1.0
    ratio = gain / cost(1)
    while len(chosen) < min(max_nodes, n):
        eligible = [i for i in range(1, n) if i not in chosen_set and parents[i] in chosen_set and depth[i] <= max_depth]
        if not eligible:
            break
        best = max(eligible, key=lambda i: (path_p[i], -i))
        new_ratio = (gain + path_p[best]) / cost(len(chosen) + 1)
        if new_ratio < ratio:
            break
        chosen.append(best)
        chosen_set.add(best)
        gain += path_p[best]
        ratio = new_ratio
    return sorted(chosen)


@dataclass
class LeverPolicy:
    """The planner's state across passes: calibration, costs, and the next draft size."""

    calibration: AcceptanceCalibration = field(default_factory=AcceptanceCalibration)
    costs: CostModel = field(default_factory=CostModel)
    max_depth: int = 12
    last_size: int = 0

    def select(self, parents: np.ndarray, draft_probs: np.ndarray, max_nodes: int) -> list[int]:
        """Nodes (root first) of the drafted tree to verify this pass."""
        depth = np.zeros(len(parents), int)
        for i in range(1, len(parents)):
            depth[i] = depth[parents[i]] + 1
        if not self.costs.ready:  # first pass: nothing measured yet, verify what was drafted
            keep = list(range(min(len(parents), max_nodes + 1)))
        else:
            cond = self.calibration.conditional(depth, draft_probs)
            keep = plan_tree(parents, path_probabilities(parents, cond), self.costs.cost, max_nodes + 1,
                             self.max_depth)
        self.last_size = len(keep) - 1
        return keep

    def observe(self, parents, depths, draft_probs, accepted_nodes, pass_s: float, compute_s: float,
                draft_s: float) -> None:
        accepted = set(accepted_nodes) | {0}
        cand = [i for i in range(1, len(parents)) if parents[i] in accepted]
        if cand:
            self.calibration.observe(np.asarray(depths)[cand], np.asarray(draft_probs)[cand],
                                     [i in accepted for i in cand])
        self.costs.observe(len(parents), pass_s, compute_s, draft_s)

    def next_draft_size(self, cap: int) -> int:
        """Draft somewhat more than was worth verifying last time, so the planner has choices."""
        return int(min(cap, max(4, 2 * self.last_size)))

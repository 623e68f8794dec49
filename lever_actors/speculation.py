"""Cross-step speculation bookkeeping, kept out of the driver so its per-pass step reads like the algorithm.

Pure Python and numpy, no trio. While the target verifies pass ``k``, the drafter
already drafts pass ``k+1``'s tree under the likeliest *assumed* outcomes of pass
``k`` (:func:`outcome_hypotheses`: where acceptance stops in its tree, then the
draft's own guess of the target's next token). When the commit arrives,
:meth:`CrossStep.settle` compares the real outcome with the assumptions:

* a **hit** keeps the tree drafted under the outcome that held (:meth:`take_ready`);
* a **miss** drops them all, and the next tree is drafted after the commit.

Either way the next request carries the committed tokens: the drafter finds the
rows it already drafted for them. Every request takes :meth:`settle_fields`
exactly once, so the drafter hears about each commit exactly once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def main_path(drafted: list[int], parents: list[int], probs) -> list[int]:
    """Tokens of the tree's most likely path from the root (node 0): the best-scored child at each step.

    ``parents`` numbers the root 0 (parent -1); ``drafted[i - 1]`` and ``probs[i - 1]`` belong to node ``i``.
    """
    kids: dict[int, list[int]] = {}
    for i in range(1, len(parents)):
        kids.setdefault(parents[i], []).append(i)
    path, node = [], 0
    while node in kids:
        node = max(kids[node], key=lambda i: (probs[i - 1], -i))
        path.append(drafted[node - 1])
    return path


def outcome_hypotheses(parents, drafted: list[int], probs, cond, k: int, min_weight: float = 0.0
                       ) -> list[tuple[tuple[int, ...], tuple[int, ...], float]]:
    """The ``k`` most likely outcomes of verifying a tree, as (path tokens, excluded, weight).

    An outcome is where acceptance stops: at node ``x``, when the target refuses every child of
    ``x`` in the tree (then its next token lies outside them: ``excluded``). With ``cond[i]``
    the chance node i is accepted given its parent was (root first, ``cond[0] = 1``), the chance
    of stopping at ``x`` is ``reach(x) * (1 - sum of cond over x's children)``. The first outcome
    is always the main path accepted whole (cross-step drafting's classic guess); the others
    are the likeliest remaining stops of at least ``min_weight``.
    """
    n = len(parents)
    kids: dict[int, list[int]] = {}
    for i in range(1, n):
        kids.setdefault(parents[i], []).append(i)
    reach = np.ones(n)
    for i in range(1, n):
        reach[i] = reach[parents[i]] * cond[i]
    stop = np.array([reach[x] * max(0.0, 1.0 - sum(cond[c] for c in kids.get(x, []))) for x in range(n)])
    leaf = 0
    while leaf in kids:
        leaf = max(kids[leaf], key=lambda i: (probs[i - 1], -i))

    def path_to(x: int) -> tuple[int, ...]:
        toks = []
        while x > 0:
            toks.append(int(drafted[x - 1]))
            x = parents[x]
        return tuple(toks[::-1])

    out = [(path_to(leaf), (), float(stop[leaf]))]
    for x in sorted(range(n), key=lambda x: (-stop[x], x)):
        if len(out) >= k or stop[x] < min_weight:
            break
        if x != leaf:
            out.append((path_to(x), tuple(int(drafted[c - 1]) for c in kids.get(x, [])), float(stop[x])))
    return out


@dataclass
class CrossStep:
    """What the drafter was told and which outcomes it assumed, across the passes of one generation."""

    unseen: list[int] = field(default_factory=list)  # committed tokens the drafter has not been sent, root last
    in_flight: int = 0  # expansions still to come from the draft request sent beside the pass
    ready: object | None = None  # the next tree, drafted under an outcome that held
    hits: int = 0
    misses: int = 0
    next_token_misses: int = 0  # ... of the misses, those that stopped where assumed but on another next token
    early_hits: int = 0  # hits on an early stop, not the main path accepted whole (multi-outcome)
    runner_up_hits: int = 0  # hits on the main path accepted whole, then the draft's runner-up token
    predicted_hits: int = 0  # hits on a tree the drafter planted for the exit layer's predicted outcome

    def settle_fields(self) -> dict:
        """``committed`` for the next DraftRequest; the drafter is then up to date."""
        fields = {"committed": tuple(self.unseen)}
        self.unseen = []
        return fields

    def assume(self, n: int) -> None:
        """A draft request assuming ``n`` outcomes of the current pass went out."""
        self.in_flight = n

    def settle(self, committed: list[int], expansions) -> bool:
        """The pass committed ``committed``; ``expansions`` are what the drafter drafted meanwhile,
        one per assumed outcome (empty when none was in flight). Returns True on a hit.

        The drafter is always sent the committed tokens: it finds the rows it drafted for them itself.
        """
        self.unseen += committed  # a pass may go by without a draft request (its tree was drafted ahead)
        was, self.in_flight = self.in_flight, 0
        if not was or not expansions:
            return False
        hit = next((e for e in expansions if list(e.assumed) == list(committed)), None)
        if hit is not None:
            self.ready = hit
            self.hits += 1
            self.predicted_hits += hit.hypothesis >= was  # beyond the hypotheses requested: planted
            if 0 < hit.hypothesis < was:  # the main path's (hypothesis 0's) own, or an early stop's
                main = list(expansions[0].assumed)  # empty when the drafter had no room to assume it
                main_path_held = bool(main) and list(hit.assumed[:-1]) == main[:-1]
                self.runner_up_hits += main_path_held
                self.early_hits += not main_path_held
        else:
            self.misses += 1  # its drafting ran beside verification: only the guess is lost
            # where the wait comes from: an outcome nobody assumed, or an assumed stop whose next
            # token (the draft's guess of the target's) was wrong
            self.next_token_misses += any(e.assumed and list(e.assumed[:-1]) == list(committed[:-1])
                                          for e in expansions)
        return hit is not None

    def take_ready(self):
        """The tree drafted ahead under an outcome that held, or None (it is handed out once)."""
        exp, self.ready = self.ready, None
        return exp

    @property
    def hit_rate(self) -> float | None:
        n = self.hits + self.misses
        return self.hits / n if n else None

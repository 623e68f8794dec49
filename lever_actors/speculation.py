"""Cross-step speculation bookkeeping, kept out of the driver so its per-pass step reads like the algorithm.

Pure Python, no trio. While the target verifies pass ``k``, the drafter already
drafts pass ``k+1``'s tree under an *assumed* outcome of pass ``k`` (a path of
its tree accepted, then the draft's own next token). When the commit arrives,
:meth:`CrossStep.settle` compares the real outcome with the assumption:

* a **hit** keeps the tree drafted ahead (:meth:`take_ready`) and tells the
  drafter, on its next request, that its pending assumption is history now;
* a **miss** drops it: the next request carries the tokens the drafter has not
  seen, and the drafter rolls its KV back to the rows they share.

Every request to the drafter takes :meth:`settle_fields` exactly once, so the
drafter hears about each commit and each assumption exactly once.
"""
from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class CrossStep:
    """What the drafter was told and what it assumed, across the passes of one generation."""

    unseen: list[int] = field(default_factory=list)  # committed tokens the drafter has not been sent, root last
    confirmed: bool = False  # the drafter's pending assumption held; it has not been told yet
    assumed: list[int] | None = None  # the outcome assumed by the draft in flight (None: no draft in flight)
    ready: object | None = None  # the next tree, drafted under an assumption that held
    hits: int = 0
    misses: int = 0

    def settle_fields(self) -> dict:
        """``committed`` and ``confirmed`` for the next DraftRequest; the drafter is then up to date."""
        fields = {"committed": tuple(self.unseen), "confirmed": self.confirmed}
        self.unseen, self.confirmed = [], False
        return fields

    def assume(self, outcome: list[int]) -> None:
        """A draft request assuming ``outcome`` (tokens of the current tree) went out."""
        self.assumed = list(outcome)

    def settle(self, committed: list[int], expansion) -> bool:
        """The pass committed ``committed``; ``expansion`` is what the drafter drafted meanwhile
        (None when no cross-step draft was in flight). Returns True on a hit."""
        self.unseen = list(committed)
        if self.assumed is None or expansion is None:
            self.assumed = None
            return False
        hit = list(committed) == self.assumed + [int(expansion.root_token)]
        self.assumed = None
        if hit:
            self.ready, self.confirmed, self.unseen = expansion, True, []
            self.hits += 1
        else:
            self.misses += 1  # its drafting ran beside verification: only the guess is lost
        return hit

    def take_ready(self):
        """The tree drafted ahead under an assumption that held, or None (it is handed out once)."""
        exp, self.ready = self.ready, None
        return exp

    @property
    def hit_rate(self) -> float | None:
        n = self.hits + self.misses
        return self.hits / n if n else None

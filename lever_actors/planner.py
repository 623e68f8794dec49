"""Gain/cost tree planning: pick the drafted subtree with the most expected tokens per second.

Pure numpy, no trio. For a candidate tree ``T`` (node 0 = root):

* gain ``G(T) = 1 + sum_v p(v)``, ``p(v)`` the calibrated probability that the path
  root->v is accepted: the product over the path of ``acc(depth, draft-prob bin)``,
  learned online from verified passes (:class:`AcceptanceCalibration`);
* cost ``C(T) = overlap(reads, c0 + c1*|T|) + rest + draft_wait(|T|)``:
  verification compute grows with the verified nodes and overlaps the pass's
  flash reads, but not perfectly (two stream slots, layers that vary), so a node
  costs a part of its compute however far below the reads it stays; drafting
  costs only what the driver waited for; every term is measured on the running
  machine and updated after each pass (:class:`CostModel`).

:func:`plan_tree` grows the subtree greedily by best ``p(v)`` (a node is
eligible once its parent is in) while ``G/C`` rises, within node and depth caps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lever_actors.sampling import tree_depths


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest static shape (token bucket) holding ``n`` rows; ``n`` itself with no buckets."""
    if not buckets:
        return n
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} tokens exceed the largest token bucket {buckets[-1]}")


def parse_buckets(text: str | None) -> tuple[int, ...]:
    """'1,2,4,8,16,32,64' -> (1, 2, 4, 8, 16, 32, 64); None, '' or 'off' -> () (no padding)."""
    if text is None or text.strip().lower() in ("", "off", "none"):
        return ()
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"token buckets are comma-separated integers like 1,2,4,8,16,32,64, got {text!r}") from None
    if values[0] < 1 or any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"token buckets must be increasing positive integers, got {text!r}")
    return values


SURE_DRAFT_P = 0.9  # a draft node this likely by the draft stands for the best path of a waited-for draft
NGRAM_PRIOR = 0.5  # what an n-gram node is taken to be worth before any has been verified (explores them)
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


OVERLAP_POWER = 4.0  # reads and compute of a pass combine as an L4 norm (see overlap)


def ema(old: float | None, new: float, alpha: float = 0.25) -> float:
    """An exponentially weighted moving average's next value (the first measurement starts it)."""
    return new if old is None else (1 - alpha) * old + alpha * new


def overlap(reads_s: float, compute_s: float) -> float:
    """Time of a pass whose flash reads and layer compute run side by side through two stream
    slots: the larger of the two when the other is small, about 1.19x either when they are equal
    (measured at 768 MiB: reads 0.486 s and compute 0.445 s per pass made 0.56 s; this gives 0.555).
    A max() would call every node free below the reads; lever's trees then grew until each pass
    ran 15% over its reads."""
    if reads_s <= 0 or compute_s <= 0:
        return max(reads_s, compute_s, 0.0)
    return float((reads_s ** OVERLAP_POWER + compute_s ** OVERLAP_POWER) ** (1.0 / OVERLAP_POWER))


@dataclass
class CostModel:
    """Seconds per pass as a function of tree size, learned online.

    ``cost(n) = overlap(floor, c0 + c1*n) + rest + draft_per_node * n``: verification
    compute grows linearly with the verified nodes (``c0 + c1*n``, an exponentially
    weighted least-squares fit over the passes seen) and overlaps the pass's flash
    reads (``floor``, the reads of the streamed layers; :func:`overlap`); ``rest`` is
    what the pass took beyond that (planning, the commit); drafting adds only the part
    the driver waited for (cross-step drafting hides the rest). Without a measure of
    the reads a pass is its own floor, and nodes below it are free.
    """

    alpha: float = 0.25
    floor_s: float | None = None
    rest_s: float = 0.0
    reads_known: bool = False  # the floor is the pass's reads, not the pass itself
    draft_per_node_s: float = 0.0
    buckets: tuple[int, ...] = ()  # with static shapes a pass computes its bucket's rows, not its nodes
    _sums: np.ndarray = field(default_factory=lambda: np.zeros(5))  # weights of 1, n, n^2, c, n*c

    def _ema(self, old: float | None, new: float) -> float:
        return ema(old, new, self.alpha)

    def observe(self, n_nodes: int, pass_s: float, compute_s: float, draft_s: float,
                reads_s: float | None = None) -> None:
        n = float(bucket_for(max(n_nodes, 1), self.buckets))
        self._sums = (1 - self.alpha) * self._sums + self.alpha * np.array([1.0, n, n * n, compute_s, n * compute_s])
        busy = max(pass_s - draft_s, compute_s)  # the pass without the drafting it waited for
        if reads_s is None:
            self.floor_s = self._ema(self.floor_s, busy)
        else:
            self.floor_s = self._ema(self.floor_s if self.reads_known else None, reads_s)
            self.reads_known = True
            self.rest_s = self._ema(self.rest_s, max(busy - overlap(reads_s, compute_s), 0.0))
        self.draft_per_node_s = (1 - self.alpha) * self.draft_per_node_s + self.alpha * draft_s / n

    def seed(self, n_rows: int, io_s: float, compute_s: float) -> None:
        """Start from the prefill pass, before any decode pass is measured: its flash reads are one
        pass's floor and its compute one point of the line (a fresh process then plans its first
        tree instead of verifying everything drafted)."""
        if self.ready or n_rows < 1 or io_s <= 0:
            return
        n = float(n_rows)
        self._sums = self.alpha * np.array([1.0, n, n * n, compute_s, n * compute_s])
        self.floor_s, self.reads_known = io_s, True

    @property
    def ready(self) -> bool:
        return self.floor_s is not None

    def compute_line(self) -> tuple[float, float]:
        """(c0, c1) of compute(n) = c0 + c1*n; the slope is never below the mean cost per node / 4."""
        w, sn, snn, sc, snc = self._sums
        mean_n, mean_c = sn / w, sc / w
        var = snn / w - mean_n * mean_n
        c1 = (snc / w - mean_n * mean_c) / var if var > 1e-9 * max(mean_n * mean_n, 1.0) else mean_c / mean_n
        c1 = max(c1, mean_c / mean_n / 4)
        return mean_c - c1 * mean_n, c1

    @property
    def compute_per_node_s(self) -> float:
        return self.compute_line()[1]

    def cost(self, n_nodes: int) -> float:
        return self.pass_s(n_nodes) + self.draft_per_node_s * n_nodes

    def pass_s(self, n_nodes: int) -> float:
        """The pass alone (reads, compute and the rest) for ``n_nodes`` verified nodes."""
        c0, c1 = self.compute_line()
        rows = bucket_for(n_nodes, self.buckets) if not self.buckets or n_nodes <= self.buckets[-1] else n_nodes
        compute = c0 + c1 * rows
        return overlap(self.floor_s, compute) + self.rest_s if self.reads_known else max(self.floor_s, compute)

    def marginal_node_s(self, n_nodes: int) -> float:
        """What one more verified node adds to a pass of ``n_nodes``: the part of its compute that a pass
        bound by its reads shows (:func:`overlap`), as the planner weighs it."""
        return max(self.pass_s(n_nodes + 1) - self.pass_s(n_nodes), 0.0)


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
    depth = tree_depths(parents)
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
class DraftPace:
    """How deep to draft: the gain/cost rule applied to drafting itself (adaptive depth).

    Learned online: ``level_s`` (one draft call, i.e. one tree level, on the drafting
    lane), ``verify_s`` (a pass without the draft it waited for: the time a draft
    hidden behind it has) and ``rate`` (committed tokens per second of pass time).

    * A draft **hidden** behind the pass (cross-step) costs no wait until it outlasts the
      pass: its depth is capped at what fits, and a level is still drawn only while its
      best path is worth verifying (``p >= rate * compute per node``; the policy also
      checks that bound against the calibrated acceptance, :meth:`LeverPolicy.draft_limits`).
    * A draft the pass **waits for** puts every level on the critical path: the next
      level pays only while its best path probability ``p`` buys more tokens than the
      time costs at the current rate: ``p >= rate * (level_s + compute per node)``.
      When acceptance falls, the rate and the path probabilities fall together and the
      drafts get shorter; when the draft is sharp they get deeper.
    """

    alpha: float = 0.25
    level_s: float | None = None
    hidden_level_s: float | None = None  # a level drafted ahead: several hypotheses' rows per call
    verify_s: float | None = None
    rate: float | None = None

    def _ema(self, old: float | None, new: float) -> float:
        return ema(old, new, self.alpha)

    def observe_draft(self, draft_s: float, calls: int, hidden: bool = False) -> None:
        if calls > 0 and draft_s > 0:
            if hidden:
                self.hidden_level_s = self._ema(self.hidden_level_s, draft_s / calls)
            else:
                self.level_s = self._ema(self.level_s, draft_s / calls)

    def observe_pass(self, committed: int, pass_s: float, waited_s: float) -> None:
        if pass_s > 0:
            self.verify_s = self._ema(self.verify_s, max(pass_s - waited_s, 0.0))
            self.rate = self._ema(self.rate, committed / pass_s)

    @property
    def ready(self) -> bool:
        return None not in (self.level_s, self.verify_s, self.rate)

    def limits(self, hidden: bool, max_depth: int, node_s: float) -> tuple[int, float]:
        """(depth cap, least path probability worth another level) of the next draft."""
        if hidden:  # the speculative request also feeds the assumed paths and their roots: two calls more
            # a draft hidden behind the pass needs only its own level time (the passes may all hit,
            # so that no draft is ever waited for)
            level_s = self.hidden_level_s or self.level_s
            if None in (level_s, self.verify_s):
                return max_depth, 0.0
            depth = int(self.verify_s / level_s) - 2
            return max(1, min(max_depth, depth)), 0.0 if self.rate is None else min(self.rate * node_s, 0.9)
        # before any draft was waited for, a level drafted ahead says what one costs (a little more:
        # it holds several hypotheses' rows)
        level_s = self.level_s or self.hidden_level_s
        if None in (level_s, self.verify_s, self.rate):
            return max_depth, 0.0
        return max_depth, min(self.rate * (level_s + node_s), 0.9)


@dataclass
class LeverPolicy:
    """The planner's state across passes: calibration, costs, and the next draft size."""

    calibration: AcceptanceCalibration = field(default_factory=AcceptanceCalibration)
    costs: CostModel = field(default_factory=CostModel)
    pace: DraftPace = field(default_factory=DraftPace)
    # n-gram (prompt-lookup) nodes: acceptance by depth alone, with its own record
    ngram_calibration: AcceptanceCalibration = field(default_factory=AcceptanceCalibration)
    max_depth: int = 16
    last_size: int = 0
    # +marginal-depth: price a node for the drafter's depth cut at what it adds to the pass (as the
    # planner does), not its whole compute. Deeper drafts ahead then also hold the drafting core longer,
    # which the pass feels where compute nears the reads (768 MiB: 0.92-1.04x; 600 MiB: 1.21x in one run,
    # 0.98x in another; README)
    marginal_depth: bool = False
    # drafts ahead stop by the calibrated acceptance too, not only where the pass would end them: on
    # prompts the draft is sure of and wrong, deeper levels held the drafting core the pass borrows
    # once they are done (at 768 MiB 0.996-1.07x in five runs, held-out 1.03x HumanEval and 1.01x
    # library-style; at 600 MiB within its 8% noise, 0.95-1.03x; README)
    calibrated_ahead: bool = True
    # costs and pace of each schedule (lever_actors.schedule): a pass verified on every core and a draft
    # the pass always waits for (turns) cost differently from a pass with a draft beside it (overlap)
    schedule: str = "overlap"
    others: dict = field(default_factory=dict)  # schedule -> (CostModel, DraftPace) not in use now
    # the acceptance of each sampler: a greedy draft's probability and a coupled draft's probability
    # under the Gumbel noise (lever_actors/sampling.py) say different things about acceptance, and a
    # daemon serving both kinds of request must not blend their records
    sampler: str = "greedy"
    other_calibrations: dict = field(default_factory=dict)  # sampler -> (calibration, ngram_calibration)

    def use_schedule(self, schedule: str) -> None:
        """Plan the next passes with ``schedule``'s costs and pace. A schedule met for the first time
        starts from a copy of the current ones, so that its first pass is planned, not verified whole."""
        if schedule == self.schedule:
            return
        from copy import deepcopy

        self.others[self.schedule] = (self.costs, self.pace)
        self.costs, self.pace = self.others.pop(schedule, None) or (deepcopy(self.costs), deepcopy(self.pace))
        self.schedule = schedule

    def use_sampler(self, sampler: str) -> None:
        """Plan with the acceptance records of ``sampler`` (``greedy`` or ``coupled``); one met for
        the first time starts from the prior alone."""
        if sampler == self.sampler:
            return
        self.other_calibrations[self.sampler] = (self.calibration, self.ngram_calibration)
        self.calibration, self.ngram_calibration = self.other_calibrations.pop(sampler, None) or (
            AcceptanceCalibration(self.calibration.max_depth), AcceptanceCalibration(self.ngram_calibration.max_depth))
        self.sampler = sampler

    def seed(self, n_rows: int, io_s: float, compute_s: float) -> None:
        """The prefill pass's measurements, until decode passes replace them (see CostModel.seed)."""
        if not self.costs.ready:
            self.costs.seed(n_rows, io_s, compute_s)
            if self.pace.verify_s is None and io_s > 0:
                self.pace.verify_s = io_s

    def draft_limits(self, hidden: bool, max_depth: int) -> tuple[int, float]:
        """(depth cap, least path probability) of the next draft request: see :class:`DraftPace`.
        The drafter cuts a waited-for draft by the draft's own path probability, which stays high
        where the draft is sure and wrong (serial drafts of half a second on prompts that accept
        three tokens a pass); so it also goes no deeper than a sure-looking path is still worth a
        level by the calibrated acceptance. So does a draft ahead (``calibrated_ahead``): it costs no
        wait, but its levels hold the drafting core, which the pass borrows once they are done."""
        node_s = self.costs.compute_per_node_s if self.costs.ready else 0.0
        if self.marginal_depth and self.costs.ready:
            node_s = self.costs.marginal_node_s(max(self.last_size, 1))
        depth, min_p = self.pace.limits(hidden, max_depth, node_s)
        if (not hidden or self.calibrated_ahead) and min_p > 0:
            levels = np.arange(1, depth + 1)
            path = np.cumprod(self.calibration.conditional(levels, np.full(depth, SURE_DRAFT_P)))
            depth = max(1, int(np.count_nonzero(path >= min_p)))
        return depth, min_p

    def conditional(self, depth: np.ndarray, draft_probs: np.ndarray, ngram: np.ndarray | None) -> np.ndarray:
        """Calibrated acceptance of each node given its parent's: drafted nodes by (depth, draft
        probability), n-gram nodes by depth from their own record (they have no draft probability)."""
        cond = self.calibration.conditional(depth, draft_probs)
        if ngram is not None and ngram.any():
            cond = np.where(ngram, self.ngram_calibration.conditional(depth, np.full(len(depth), NGRAM_PRIOR)), cond)
        return cond

    def select(self, parents: np.ndarray, draft_probs: np.ndarray, max_nodes: int,
               ngram: np.ndarray | None = None) -> list[int]:
        """Nodes (root first) of the drafted tree to verify this pass (``ngram`` marks free branch nodes)."""
        depth = tree_depths(parents)
        if not self.costs.ready:  # first pass: nothing measured yet, verify what was drafted
            keep = list(range(min(len(parents), max_nodes + 1)))
        else:
            cond = self.conditional(depth, draft_probs, ngram)
            keep = plan_tree(parents, path_probabilities(parents, cond), self.costs.cost, max_nodes + 1,
                             self.max_depth)
        self.last_size = len(keep) - 1
        return keep

    def observe(self, parents, depths, draft_probs, accepted_nodes, pass_s: float, compute_s: float,
                draft_s: float, ngram: np.ndarray | None = None, reads_s: float | None = None) -> None:
        accepted = set(accepted_nodes) | {0}
        cand = np.asarray([i for i in range(1, len(parents)) if parents[i] in accepted], int)
        if cand.size:
            free = np.zeros(len(parents), bool) if ngram is None else np.asarray(ngram, bool)
            hit = np.asarray([i in accepted for i in cand], float)
            d, p = np.asarray(depths)[cand], np.asarray(draft_probs)[cand]
            own = ~free[cand]
            if own.any():
                self.calibration.observe(d[own], p[own], hit[own])
            if (~own).any():
                self.ngram_calibration.observe(d[~own], np.full(int((~own).sum()), NGRAM_PRIOR), hit[~own])
        self.costs.observe(len(parents), pass_s, compute_s, draft_s, reads_s)

    def next_draft_size(self, cap: int) -> int:
        """Draft somewhat more than was worth verifying last time, so the planner has choices."""
        return int(min(cap, max(4, 2 * self.last_size)))

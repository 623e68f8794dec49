"""In-pipeline messages exchanged by the actors (DESIGN.md section 2).

Layer: protocols/ (wire schemas). Imports only the standard library, msgpack and numpy.

Every message carries ``session_id``, ``step`` (monotonic, one verification pass per step)
and ``epoch`` (speculation generation: consumers drop messages of older epochs). Tensors never
travel: weights and hidden states stay in buffers owned by one actor, messages carry handles
(pool slots, buffer handles) and small per-node vectors.

Trees are numbered in topological order (a parent id is smaller than its child's). In
``DraftExpansion`` the root (last committed token) is implicit and parent -1 marks its
children; from ``VerifyPlan`` on, the root is node 0 with parent -1 and node ids index the
plan's arrays. Constructors check cheap structural invariants (ValueError); ``encode`` checks
field types.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from protocols.base import Message, register

# (kind, itemsize) rather than dtype equality, so the check does not depend on byte order.
_VECTOR_DTYPES = {"int32": ("i", 4), "float32": ("f", 4), "bool": ("b", 1)}


def _vector(owner: object, name: str, dtype: str, length: int | None = None,
            increasing: bool = False) -> np.ndarray:
    arr = getattr(owner, name)
    if not (isinstance(arr, np.ndarray) and arr.ndim == 1
            and (arr.dtype.kind, arr.dtype.itemsize) == _VECTOR_DTYPES[dtype]):
        got = f"{arr.dtype}{arr.shape}" if isinstance(arr, np.ndarray) else type(arr).__name__
        raise ValueError(f"{type(owner).__name__}.{name} must be a 1-d {dtype} array, got {got}")
    if length is not None and arr.shape[0] != length:
        raise ValueError(f"{type(owner).__name__}.{name}: {arr.shape[0]} items, not {length}")
    if increasing and not _increasing(arr):
        raise ValueError(f"{type(owner).__name__}.{name} must be strictly increasing node ids")
    return arr


def _non_negative(owner: object, *names: str) -> None:
    for name in names:
        if getattr(owner, name) < 0:
            raise ValueError(f"{type(owner).__name__}.{name} must be >= 0")


def _seconds(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if not 0 <= value < math.inf:  # also rejects NaN
            raise ValueError(f"{type(owner).__name__}.{name} must be finite and >= 0, got {value}")


def _alternatives(owner: object, rows: int) -> None:
    """``owner.alternatives`` is None or an int32 ``[rows, k]`` array of token ids (k >= 1)."""
    alt = owner.alternatives
    if alt is None:
        return
    if not (isinstance(alt, np.ndarray) and alt.ndim == 2 and alt.shape[0] == rows and alt.shape[1] >= 1
            and (alt.dtype.kind, alt.dtype.itemsize) == ("i", 4)):
        got = f"{alt.dtype}{alt.shape}" if isinstance(alt, np.ndarray) else type(alt).__name__
        raise ValueError(f"{type(owner).__name__}.alternatives must be int32 [{rows}, k>=1], got {got}")
    if np.any(alt < 0):
        raise ValueError(f"{type(owner).__name__}.alternatives must be token ids >= 0")


def _increasing(values) -> bool:
    """True when ``values`` (a tuple or 1-d array) are non-negative and strictly increasing."""
    v = np.asarray(values)
    return v.size == 0 or bool(v[0] >= 0 and np.all(np.diff(v) > 0))


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineMessage(Message):
    """Header shared by every in-pipeline message (not registered itself)."""
    session_id: int
    step: int
    epoch: int

    def __post_init__(self) -> None:
        _non_negative(self, "session_id", "step", "epoch")
        self._check()

    def _check(self) -> None:
        """Per-class structural checks. Overridden instead of chaining ``__post_init__``,
        because zero-argument ``super()`` breaks in ``slots=True`` dataclasses."""


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class PassSchedule(PipelineMessage):
    """Planner/runtime -> FlashPrefetcher: stream these layers, in this order, for one pass."""
    KIND: ClassVar[str] = "flash.schedule"
    VERSION: ClassVar[int] = 1
    layers: tuple[int, ...]

    def _check(self) -> None:
        if any(layer < 0 for layer in self.layers) or len(set(self.layers)) != len(self.layers):
            raise ValueError("PassSchedule.layers must be distinct non-negative layer indices")


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class LayerReady(PipelineMessage):
    """FlashPrefetcher -> NpuVerifier: ``layer``'s weights sit in buffer-pool ``slot``."""
    KIND: ClassVar[str] = "flash.ready"
    VERSION: ClassVar[int] = 2
    layer: int
    slot: int
    nbytes: int
    io_s: float          # wall time of the read
    direct_io: bool      # False when the read fell back to buffered I/O + fadvise
    # v2: the read failed or its bytes are not the bundle's: why (the slot's contents are not
    # weights; the verifier fails the pass with this and hands the slot back)
    fault: str = ""
    fault_retryable: bool = False

    @staticmethod
    def upgrade_from_1(body: dict) -> dict:
        return body  # v2 only adds fields with defaults

    def _check(self) -> None:
        _non_negative(self, "layer", "slot", "nbytes")
        _seconds(self, "io_s")


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class LayerReleased(PipelineMessage):
    """NpuVerifier -> FlashPrefetcher: buffer-pool ``slot`` holding ``layer`` may be reused."""
    KIND: ClassVar[str] = "flash.released"
    VERSION: ClassVar[int] = 1
    layer: int
    slot: int

    def _check(self) -> None:
        _non_negative(self, "layer", "slot")


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class DraftRequest(PipelineMessage):
    """-> Drafter: grow a candidate tree below ``root_token`` at sequence ``position``."""
    KIND: ClassVar[str] = "draft.request"
    VERSION: ClassVar[int] = 10
    root_token: int
    position: int        # sequence position of root_token
    max_nodes: int
    max_depth: int
    top_k: int           # children considered per expanded node
    # v2: the tokens committed since the previous request (root last), so the drafter can
    # sync its KV cache; reset starts a new sequence; the sampling settings of the request
    committed: tuple[int, ...] = ()
    reset: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    # v4: adaptive depth. Stop growing the tree once the most probable path of the last level
    # drawn is below ``min_path_p`` (its next level would not pay for its drafting time)
    min_path_p: float = 0.0
    # v5: kernel threads for this draft (0 = the drafter's own setting); a draft the verification
    # lane waits for may borrow its idle core
    threads: int = 0
    # v6: prompt caching. With ``reset``, keep the KV rows of the longest prefix the new
    # sequence (``committed``) shares with the drafter's committed rows, and feed only the rest
    reuse_prefix: bool = False
    # v7: cross-step drafting over several outcomes (replaces v3's ``speculative``/``assume``/
    # ``confirmed``). With ``hypotheses`` the request arrives while the last tree is verified: the
    # drafter drafts one next tree per assumed outcome, batching every hypothesis's level into one
    # draft call, and answers with one DraftExpansion per hypothesis, in order (``root_token`` and
    # ``position`` then name the current root; each expansion names the root it assumed).
    # A hypothesis is ``(path, excluded, max_nodes, max_depth)``: the tree path ``path`` (tokens
    # from the root) is accepted, then the target's next token is the draft's own best token
    # after it outside ``excluded`` (the path end's children in the verified tree, refused if the
    # target stopped there); below that token the drafter drafts at most ``max_nodes`` nodes in
    # ``max_depth`` levels.
    # ``committed`` always lists the tokens committed since the last request, whatever was
    # assumed: the drafter keeps the rows a committed outcome shares with what it drafted.
    # ``confirmed_hypothesis`` >= 0 says instead that hypothesis of the last request held and
    # ``committed`` counts from after it (what v6's ``confirmed`` said of its one assumption).
    # v8: a hypothesis is ``(path, excluded, max_nodes, max_depth, rank)``: the assumed next token
    # is the draft's ``rank``-th best after the path outside ``excluded`` (0: its best, as in v7).
    # Two hypotheses may share a path: where the draft hesitates between tokens, both get a tree.
    hypotheses: tuple[tuple[tuple[int, ...], tuple[int, ...], int, int, int], ...] = ()
    confirmed_hypothesis: int = -1
    # v7 too: drafting as long as the pass lasts. ``levels`` > 0 grows the trees by at most that many
    # levels in this request (0: until each tree's own limits); ``extend`` grows the trees of the
    # last request further (nothing may have been committed since: ``committed`` is empty). Every
    # answer lists each tree so far, ``growing`` when it could still grow.
    levels: int = 0
    extend: bool = False
    # v9: a cross-step request drafted one level per draft call draws no level after its first that
    # would end after ``deadline_s`` (the process's ``time.perf_counter``; 0 = none): the pass it is
    # drafted beside is expected to commit then, and a level still being drafted at the commit
    # delays the next pass (after a miss, the next draft waits behind it)
    deadline_s: float = 0.0
    # v10: coupled sampling (sampled requests): every level's children are the draft's top tokens
    # under the Gumbel noise of their sequence position (lever_actors/sampling.py), as if greedy;
    # False: drawn from the draft's distribution for speculative rejection sampling (v9's only way)
    coupled: bool = True

    @staticmethod
    def upgrade_from_1(body: dict) -> dict:
        return body  # v2 only adds fields with defaults

    @staticmethod
    def upgrade_from_2(body: dict) -> dict:
        return body  # v3 only adds fields with defaults

    @staticmethod
    def upgrade_from_3(body: dict) -> dict:
        return body  # v4 only adds a field with a default

    @staticmethod
    def upgrade_from_4(body: dict) -> dict:
        return body  # v5 only adds a field with a default

    @staticmethod
    def upgrade_from_5(body: dict) -> dict:
        return body  # v6 only adds a field with a default

    @staticmethod
    def upgrade_from_6(body: dict) -> dict:
        # v6's single assumption is one hypothesis: its path, then the draft's own top choice
        assume, speculative = body.pop("assume", ()), body.pop("speculative", False)
        body["confirmed_hypothesis"] = 0 if body.pop("confirmed", False) else -1
        if speculative:
            body["hypotheses"] = ((tuple(assume), (), body.get("max_nodes", 0), body.get("max_depth", 0)),)
        return body

    @staticmethod
    def upgrade_from_7(body: dict) -> dict:
        # v7's hypotheses all assumed the draft's best token
        body["hypotheses"] = tuple(tuple(h) + (0,) for h in body.get("hypotheses", ()))
        return body

    @staticmethod
    def upgrade_from_8(body: dict) -> dict:
        return body  # v9 only adds a field with a default

    @staticmethod
    def upgrade_from_9(body: dict) -> dict:
        body.setdefault("coupled", False)  # v9 sampled by rejection
        return body

    def _check(self) -> None:
        _non_negative(self, "root_token", "position", "max_nodes", "max_depth", "threads", "levels")
        if self.top_k < 1:
            raise ValueError("DraftRequest.top_k must be >= 1")
        if self.extend and (self.committed or self.reset or self.hypotheses):
            raise ValueError("DraftRequest.extend continues the last trees: no commit, reset or hypotheses with it")
        if not 0.0 <= self.min_path_p <= 1.0:  # also rejects NaN
            raise ValueError(f"DraftRequest.min_path_p must lie in [0, 1], got {self.min_path_p}")
        if not 0.0 <= self.deadline_s < float("inf"):  # also rejects NaN
            raise ValueError(f"DraftRequest.deadline_s must be a finite time >= 0, got {self.deadline_s}")
        if self.confirmed_hypothesis < -1:
            raise ValueError("DraftRequest.confirmed_hypothesis must be -1 (none) or a hypothesis index")
        for path, excluded, max_nodes, max_depth, rank in self.hypotheses:
            if min(path + excluded, default=0) < 0 or min(max_nodes, max_depth, rank) < 0:
                raise ValueError("DraftRequest.hypotheses: tokens, limits and ranks must be >= 0")


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class DraftSteer(PipelineMessage):
    """CpuPruner or driver -> Drafter: what pass ``step`` commits, predicted or known, while the
    drafter still grows the trees of its cross-step request (the request of step ``step + 1``).

    The drafter applies steers between draft calls, so a steer only changes what the next levels
    draft; one that arrives after the request was answered is dropped. The one exception: a final
    steer no tree assumed stops the level in progress between two draft layers (every tree would
    stop after it anyway). ``path`` is the accepted path's tokens, ``next_token`` the target's
    token after it (-1: not predicted; the draft's own best token stands in for it, as in a
    hypothesis).

    * ``final`` False: a prediction (the early-exit layer's logit lens). A tree assuming that
      outcome keeps growing as before; when none does, the drafter plants one for it beside them.
    * ``final`` True: the pass has committed (``next_token`` is then known). Every tree assuming
      another outcome stops growing; the one that assumed this outcome grows at most to
      ``max_depth`` levels, and stops once its best path is below ``min_path_p`` (from now on
      the next pass waits for it, so the rule for a waited-for draft applies).
    """
    KIND: ClassVar[str] = "draft.steer"
    VERSION: ClassVar[int] = 1
    path: tuple[int, ...]
    next_token: int = -1
    final: bool = False
    max_depth: int = 0
    min_path_p: float = 0.0

    def outcome(self) -> tuple[int, ...] | None:
        """The committed tokens this steer names (root last), or None when the next token is open."""
        return None if self.next_token < 0 else tuple(self.path) + (self.next_token,)

    def _check(self) -> None:
        if any(t < 0 for t in self.path):
            raise ValueError("DraftSteer.path must be token ids >= 0")
        if self.final and self.next_token < 0:
            raise ValueError("a final DraftSteer names the committed next token")
        _non_negative(self, "max_depth")
        if not 0.0 <= self.min_path_p <= 1.0:  # also rejects NaN
            raise ValueError(f"DraftSteer.min_path_p must be a probability, got {self.min_path_p}")


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class LaneGrant(PipelineMessage):
    """Drafter -> NpuVerifier: the drafting lane is idle until the pass of step ``step - 1``
    commits. The drafter sends it when it has answered its cross-step request (step ``step``) and
    nothing more is asked of it before that commit; the verifier may run the rest of that one pass
    on ``threads`` more kernel threads. A grant for any other pass is ignored (the next pass starts
    with a new cross-step request: the drafting core is busy again)."""
    KIND: ClassVar[str] = "lane.grant"
    VERSION: ClassVar[int] = 1
    threads: int

    def _check(self) -> None:
        _non_negative(self, "threads")


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class DraftExpansion(PipelineMessage):
    """Drafter -> TreePlanner: candidate nodes below the (implicit) root.

    ``parents[i]`` is -1 for a child of the root, else a smaller node id; ``draft_probs[i]``
    is the draft's conditional probability of ``tokens[i]`` given its parent path (coupled
    sampling: under the softmax of the scores its position's noise perturbs, which the planner
    weighs as greedy probabilities).
    """
    KIND: ClassVar[str] = "draft.expansion"
    VERSION: ClassVar[int] = 5
    root_token: int
    position: int        # sequence position of root_token, echoed from the request
    parents: np.ndarray      # int32 [n]
    tokens: np.ndarray       # int32 [n]
    draft_probs: np.ndarray  # float32 [n]
    draft_s: float
    # v2: full draft distributions [n, vocab] that sampled nodes were drawn from (rejection sampling only)
    dists: np.ndarray | None = None
    # v3: the draft's top tokens after the root (row 0) and after each node (row i+1), best
    # first: the pruner's competitors when it scores a child against its alternatives
    alternatives: np.ndarray | None = None  # int32 [n+1, k]
    # v4: an answer to hypothesis ``hypothesis`` of ``of`` in its request: the tree was drafted
    # assuming the pass commits ``assumed`` (the hypothesis's path, then ``root_token``); empty
    # for a tree below the committed root
    assumed: tuple[int, ...] = ()
    hypothesis: int = 0
    of: int = 1
    growing: bool = False  # the tree stopped only at its request's ``levels``: an extend request grows it
    # v5: the draft could not draft this request (its embedding row read back changed: the draft
    # bundle changed under the process); the tree is empty and the driver fails the request with it
    fault: str = ""
    fault_retryable: bool = False

    @staticmethod
    def upgrade_from_1(body: dict) -> dict:
        return body

    @staticmethod
    def upgrade_from_2(body: dict) -> dict:
        return body  # v3 only adds a field with a default

    @staticmethod
    def upgrade_from_3(body: dict) -> dict:
        return body  # v4 only adds fields with defaults

    @staticmethod
    def upgrade_from_4(body: dict) -> dict:
        return body  # v5 only adds fields with defaults

    def _check(self) -> None:
        _non_negative(self, "root_token", "position")
        n = _vector(self, "parents", "int32").shape[0]
        if np.any(self.parents < -1) or np.any(self.parents >= np.arange(n)):
            raise ValueError("DraftExpansion.parents must be -1 or a smaller node id")
        if np.any(_vector(self, "tokens", "int32", n) < 0):
            raise ValueError("DraftExpansion.tokens must be >= 0")
        probs = _vector(self, "draft_probs", "float32", n)
        if not np.all((probs >= 0) & (probs <= 1)):
            raise ValueError("DraftExpansion.draft_probs must lie in [0, 1]")
        _seconds(self, "draft_s")
        _alternatives(self, n + 1)
        if not 0 <= self.hypothesis < max(self.of, 1):
            raise ValueError("DraftExpansion.hypothesis must lie in [0, of)")


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyPlan(PipelineMessage):
    """TreePlanner -> NpuVerifier: the token tree to verify in one pass.

    Node 0 is the root (the last committed token, at sequence ``position``); every other
    node's parent is a smaller id and its depth is its parent's plus one. The verifier pads
    the n nodes to ``bucket`` tokens and stops at ``exit_layers`` to let the pruner score.
    """
    KIND: ClassVar[str] = "plan.verify"
    VERSION: ClassVar[int] = 6
    position: int
    tokens: np.ndarray   # int32 [n]
    parents: np.ndarray  # int32 [n]
    depths: np.ndarray   # int32 [n]
    bucket: int
    exit_layers: tuple[int, ...] = ()
    # v2: accepted nodes of the previous pass (its KV keep-list, root first); prefill = the
    # tokens are a prompt, committed unconditionally (a new sequence); sampling settings;
    # want_logits asks for full target rows (sampled acceptance), draft_dists travel along (rejection sampling)
    prev_accepted: tuple[int, ...] = ()
    prefill: bool = False
    want_logits: bool = False
    draft_dists: np.ndarray | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    # v3: the draft's top tokens after each node (row i = node i), for the pruner; the
    # pruner's threshold on its score at exit_layers (None: score and keep everything)
    alternatives: np.ndarray | None = None  # int32 [n, k]
    prune_threshold: float | None = None
    # v4: prompt caching. A prefill keeps the KV rows of the longest prefix the prompt shares
    # with the verifier's committed rows and computes only the rest (VerifyDone.cache_n)
    reuse_prefix: bool = False
    # v5: kernel threads of this pass; 0 = the verifier's own. A pass with no drafting beside it
    # (lever taking turns with its drafter) runs on the drafting lane's cores too
    threads: int = 0
    # v6: coupled sampling (see DraftRequest v10): the acceptor takes the target's argmax under the
    # Gumbel noise of each node's next position; False: speculative rejection sampling
    coupled: bool = True

    @staticmethod
    def upgrade_from_1(body: dict) -> dict:
        return body

    @staticmethod
    def upgrade_from_2(body: dict) -> dict:
        return body  # v3 only adds fields with defaults

    @staticmethod
    def upgrade_from_3(body: dict) -> dict:
        return body  # v4 only adds a field with a default

    @staticmethod
    def upgrade_from_4(body: dict) -> dict:
        return body  # v5 only adds a field with a default

    @staticmethod
    def upgrade_from_5(body: dict) -> dict:
        body.setdefault("coupled", False)  # v5 sampled by rejection
        return body

    def _check(self) -> None:
        _non_negative(self, "position")
        _non_negative(self, "threads")
        n = _vector(self, "tokens", "int32").shape[0]
        parents, depths = _vector(self, "parents", "int32", n), _vector(self, "depths", "int32", n)
        if n < 1 or parents[0] != -1 or depths[0] != 0:
            raise ValueError("VerifyPlan needs a root node 0 with parent -1, depth 0")
        if np.any(self.tokens < 0) or self.bucket < n:
            raise ValueError(f"VerifyPlan needs token ids >= 0 and bucket >= {n} nodes")
        if np.any(parents[1:] < 0) or np.any(parents[1:] >= np.arange(1, n)):
            raise ValueError("VerifyPlan.parents must point to a smaller node id")
        if np.any(depths[1:] != depths[parents[1:]] + 1):
            raise ValueError("VerifyPlan.depths must be the parent's depth plus one")
        if not _increasing(self.exit_layers):
            raise ValueError("VerifyPlan.exit_layers must be increasing layer indices")
        _alternatives(self, n)


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class ExitHidden(PipelineMessage):
    """NpuVerifier -> CpuPruner: hidden states after ``layer`` for the surviving nodes.

    The rows of the buffer behind ``handle`` follow ``node_ids`` (strictly increasing).
    v2 adds what the pruner scores with, over all n nodes of the plan: ``tokens``,
    ``parents``, the draft's ``alternatives`` after each node, and the ``threshold``
    (None: keep every node, only score them).
    """
    KIND: ClassVar[str] = "verify.exit_hidden"
    VERSION: ClassVar[int] = 2
    layer: int
    node_ids: np.ndarray  # int32 [m]
    handle: int
    tokens: np.ndarray | None = None    # int32 [n]
    parents: np.ndarray | None = None   # int32 [n]
    alternatives: np.ndarray | None = None  # int32 [n, k]
    threshold: float | None = None

    @staticmethod
    def upgrade_from_1(body: dict) -> dict:
        return body  # v2 only adds fields with defaults

    def _check(self) -> None:
        _non_negative(self, "layer", "handle")
        _vector(self, "node_ids", "int32", increasing=True)
        if self.tokens is not None:
            n = _vector(self, "tokens", "int32").shape[0]
            _vector(self, "parents", "int32", n)
            _alternatives(self, n)
            if self.node_ids.size and self.node_ids[-1] >= n:
                raise ValueError("ExitHidden.node_ids must index the plan's nodes")


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class PruneMask(PipelineMessage):
    """CpuPruner -> NpuVerifier: ``keep[i]`` says whether plan node i survives ``layer``."""
    KIND: ClassVar[str] = "prune.mask"
    VERSION: ClassVar[int] = 1
    layer: int
    keep: np.ndarray  # bool [n]

    def _check(self) -> None:
        _non_negative(self, "layer")
        _vector(self, "keep", "bool")


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyDone(PipelineMessage):
    """NpuVerifier -> Acceptor: last-layer hidden states of ``node_ids`` behind ``handle``."""
    KIND: ClassVar[str] = "verify.done"
    VERSION: ClassVar[int] = 6
    node_ids: np.ndarray  # int32 [m], strictly increasing
    handle: int
    compute_s: float
    io_wait_s: float      # time spent waiting for LayerReady during the pass
    # v2: the verified tree echoed for the acceptor, the target's greedy token after each
    # node, full logits rows when sampling, flash bytes the pass consumed
    tokens: np.ndarray | None = None   # int32 [m]
    parents: np.ndarray | None = None  # int32 [m]
    argmax: np.ndarray | None = None   # int32 [m]
    logits: np.ndarray | None = None   # float32 [m, vocab]
    draft_dists: np.ndarray | None = None
    bytes_read: int = 0
    prefill: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    # v3: nodes the pruner dropped at an exit layer (their subtrees went with them). With
    # pruning, tokens/parents/argmax cover every plan node, node_ids the survivors, and
    # argmax is -1 where a node was not computed to the end
    pruned: np.ndarray | None = None  # int32 [p]
    # v4: prompt rows a prefill took from the cache instead of computing
    cache_n: int = 0
    # v5: the pass was lost to a flash fault (why, and whether a retry may succeed); nothing
    # else of the message is meaningful then
    fault: str = ""
    fault_retryable: bool = False
    # v6: coupled sampling (VerifyPlan v6), and the sequence position of node 0 (a prefill's: of
    # its last row), so that node i's next token is at position + depth(i) + 1
    coupled: bool = True
    position: int = 0

    @staticmethod
    def upgrade_from_1(body: dict) -> dict:
        return body

    @staticmethod
    def upgrade_from_2(body: dict) -> dict:
        return body  # v3 only adds a field with a default

    @staticmethod
    def upgrade_from_3(body: dict) -> dict:
        return body  # v4 only adds a field with a default

    @staticmethod
    def upgrade_from_4(body: dict) -> dict:
        return body  # v5 only adds fields with defaults

    @staticmethod
    def upgrade_from_5(body: dict) -> dict:
        body.setdefault("coupled", False)  # v5 sampled by rejection
        return body

    def _check(self) -> None:
        _non_negative(self, "handle", "cache_n")
        _vector(self, "node_ids", "int32", increasing=True)
        _seconds(self, "compute_s", "io_wait_s")
        if self.pruned is not None:
            _vector(self, "pruned", "int32", increasing=True)


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class Commit(PipelineMessage):
    """Acceptor -> Drafter, client: tokens that are now final.

    ``tokens`` are the accepted draft tokens followed by the target's bonus or correction
    token, so never empty. ``accepted_nodes`` is the accepted path (root first), one node per
    token, and doubles as the KV keep-list; it is empty when no tree was verified (prefill).
    ``finish_reason`` is set exactly when ``finished`` is.
    """
    KIND: ClassVar[str] = "accept.commit"
    VERSION: ClassVar[int] = 2
    tokens: tuple[int, ...]
    accepted_nodes: tuple[int, ...] = ()
    finished: bool = False
    finish_reason: str | None = None
    # v2: the pass was lost to a flash fault (VerifyDone.fault): no tokens, the request fails
    fault: str = ""
    fault_retryable: bool = False

    @staticmethod
    def upgrade_from_1(body: dict) -> dict:
        return body  # v2 only adds fields with defaults

    def _check(self) -> None:
        if self.fault:
            if self.tokens or self.accepted_nodes or self.finished:
                raise ValueError("Commit with a fault carries no tokens")
            return
        if not self.tokens or any(t < 0 for t in self.tokens):
            raise ValueError("Commit.tokens must hold at least one token id >= 0")
        nodes = self.accepted_nodes
        if nodes and (len(nodes) != len(self.tokens) or nodes[0] != 0 or not _increasing(nodes)):
            raise ValueError("Commit.accepted_nodes must be the root-first path, one per token")
        if self.finished != (self.finish_reason is not None):
            raise ValueError("Commit.finish_reason must be set exactly when finished")


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class PassStats(PipelineMessage):
    """Acceptor -> TreePlanner: measurements of one finished pass, for the cost model."""
    KIND: ClassVar[str] = "accept.stats"
    VERSION: ClassVar[int] = 3
    n_nodes: int
    n_accepted: int
    n_pruned: int
    io_s: float
    compute_s: float
    draft_s: float
    pass_s: float
    bytes_read: int
    # v2: n_pruned counts the pruner's decisions; n_dropped adds their subtrees (nodes not
    # computed to the end); n_pruned_wrong are pruned nodes the target would have accepted (the
    # parent is on the accepted path and the node's token is the target's choice there): the
    # pruner's misses, exact per pass
    n_pruned_wrong: int = 0
    n_dropped: int = 0
    # v3: prompt rows a prefill took from the cache (VerifyDone.cache_n)
    cache_n: int = 0

    @staticmethod
    def upgrade_from_1(body: dict) -> dict:
        return body  # v2 only adds a field with a default

    @staticmethod
    def upgrade_from_2(body: dict) -> dict:
        return body  # v3 only adds a field with a default

    def _check(self) -> None:
        _non_negative(self, "n_nodes", "n_accepted", "n_pruned", "bytes_read", "n_pruned_wrong", "n_dropped",
                      "cache_n")
        if not self.n_pruned_wrong <= self.n_pruned <= max(self.n_dropped, self.n_pruned) <= self.n_nodes:
            raise ValueError("PassStats: need n_pruned_wrong <= n_pruned <= n_dropped <= n_nodes")
        if self.n_accepted > self.n_nodes or self.n_pruned > self.n_nodes:
            raise ValueError("PassStats: accepted and pruned counts cannot exceed n_nodes")
        _seconds(self, "io_s", "compute_s", "draft_s", "pass_s")


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class Abort(PipelineMessage):
    """Driver -> NpuVerifier: the client of ``session_id`` is gone; stop its pass at the next layer."""
    KIND: ClassVar[str] = "session.abort"
    VERSION: ClassVar[int] = 1
    reason: str = "cancelled"

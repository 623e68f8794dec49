"""DRAM budget accounting: what is pinned, what streams, and whether it fits at all.

Pure functions, no I/O. Every large allocation is a line item: draft weights,
KV caches, the LM head, pinned target layers, stream slots and activations. A
stream *slot* holds one layer from the moment its read starts until its compute
ends. A native-layout target computes from the read buffer itself, so a slot is
the layer's bytes and a pinned layer costs its bytes. An ORT-layout model keeps
a prepacked copy per session: pinned ``layer_bytes * PREPACK_FACTOR``.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field

# ORT keeps MatMulNBits weights in its own prepacked layout (scales and block sums
# added) plus copies of small initializers: measured RSS / bundle bytes of a whole
# model's sessions was 1.29 (draft) and 1.30 (target LM head) on onnxruntime 1.32.
PREPACK_FACTOR = 1.3
MIN_SLOTS = 2  # double buffering: read layer l+1 while layer l computes
# lever streams its LM head only while at least this share of the layers stream too: a layer's compute
# for a tree's rows takes about half its read (4-5 ms against 9 on the hosts measured), so with fewer
# layers streaming the layers' part of the pass is bound by compute with the flash lane idle, and the
# head's reads (183 MiB, as much as 7 layers) all come after it (1 GiB: 9 of 28 layers, 0.96x)
STREAM_HEAD_MIN_SHARE = 0.5


@dataclass(frozen=True)
class BudgetPlan:
    budget: int | None
    items: dict[str, int]  # fixed line items (bytes)
    pinned: tuple[int, ...]  # target layers kept in DRAM
    streamed: tuple[int, ...]  # target layers read from flash every pass, in pass order
    head_streamed: bool
    n_slots: int
    slot_bytes: int
    layer_bytes: tuple[int, ...] = field(default=())
    weight_factor: float = 1.0  # DRAM per byte of a pinned layer
    trade: str = ""  # what the context length costs in pinned layers (see :func:`context_trade`)

    @property
    def pinned_bytes(self) -> int:
        return sum(int(self.layer_bytes[i] * self.weight_factor) for i in self.pinned)

    @property
    def total(self) -> int:
        pinned = self.pinned_bytes
        return sum(self.items.values()) + pinned + self.n_slots * self.slot_bytes

    def describe(self) -> str:
        mib = lambda n: f"{n / 2**20:,.{1 if n < 100 * 2**20 else 0}f} MiB"  # noqa: E731
        parts = [f"{k} {mib(v)}" for k, v in self.items.items()]
        parts.append(f"{len(self.pinned)} pinned layers {mib(self.pinned_bytes)}")
        parts.append(f"{self.n_slots} stream slots x {mib(self.slot_bytes)}")
        if self.head_streamed:  # pinned, the head is a line item above (lm_head); streamed, it reads through the slots
            parts.append("the LM head streamed through them")
        cap = "unlimited" if self.budget is None else mib(self.budget)
        return f"DRAM {mib(self.total)} of {cap}: " + ", ".join(parts) + (f"; {self.trade}" if self.trade else "")


def _count(lost: int, thing: str) -> str:
    """``2 fewer pinned layers``, ``1 more stream slot``: what a plan has against another, in words."""
    return f"{abs(lost)} {'fewer' if lost > 0 else 'more'} {thing}{'' if abs(lost) == 1 else 's'}"


def context_trade(plan: BudgetPlan, base: BudgetPlan | None, context: int, base_context: int) -> str:
    """In words, what ``context`` costs against ``base_context`` under the same budget: the memory
    its KV rows and activations take, paid for with pinned layers (which then stream every pass)."""
    mib = lambda n: f"{abs(n) / 2**20:,.0f} MiB"  # noqa: E731
    per_context = ("target_kv", "draft_kv", "activations", "draft_activations")
    grow = sum(plan.items.get(k, 0) for k in per_context)
    if base is None:
        return (f"a {context}-token context takes {mib(grow)} of KV rows and activations; "
                f"at {base_context} tokens this budget would not run at all")
    delta = grow - sum(base.items.get(k, 0) for k in per_context)
    lost = len(base.pinned) - len(plan.pinned)
    slots = base.n_slots - plan.n_slots
    more = "more" if delta >= 0 else "less"
    # the words follow each count's own sign: a plan that streams the head may pin more layers
    what = f"{_count(lost, 'pinned layer')} ({len(plan.pinned)} instead of {len(base.pinned)})" if lost \
        else "the same pinned layers"
    if slots:
        what += f" and {_count(slots, 'stream slot')}"
    head = " and streams the LM head" if plan.head_streamed and not base.head_streamed else \
        " and pins the LM head" if base.head_streamed and not plan.head_streamed else ""
    return (f"a {context}-token context takes {mib(delta)} {more} for KV rows and activations than {base_context} "
            f"tokens: {what}{head}")


def spread(n: int, s: int) -> tuple[int, ...]:
    """``s`` of the layers ``0..n-1``, evenly spaced and ending with the last one.

    Streamed layers spread this way each have the compute of the pinned layers
    before them to hide their read behind; bunched at the end, the last reads
    would wait on the first ones' slots with nothing left to compute.
    """
    return tuple(sorted({int(math.floor((j + 1) * n / s + 0.5)) - 1 for j in range(s)})) if s else ()


def plan_budget(budget: int | None, items: dict[str, int], layer_bytes: list[int], head_chunk_bytes: list[int],
                max_slots: int = 4, in_place: bool = True, stream_head: bool = False) -> BudgetPlan:
    """Pin as many target layers as fit, stream the rest, spread through the pass (:func:`spread`).

    ``items`` are fixed costs that must be resident (draft, KV caches, activations).
    The LM head is pinned when it fits beside two stream slots; otherwise its
    vocabulary slices stream after the last layer, like layers. With ``stream_head``
    (lever) the head streams instead, and layers are pinned in its place, whenever
    layers stream anyway, that reads no more than one layer more a pass, and at
    least half the layers still stream (``STREAM_HEAD_MIN_SHARE``): a pinned head
    computes after the last layer with nothing left to read beside it (a tree's
    8-12 rows outlast the read-ahead of two stream slots), streamed slices compute
    behind the reads of the next ones. Raises :class:`BudgetError` with the
    numbers when even streaming everything cannot fit.
    """
    from lever_actors.errors import BudgetError

    n = len(layer_bytes)
    factor = 1.0 if in_place else PREPACK_FACTOR  # in_place: layers compute from their own buffer (native layout)
    head_cost = int(sum(head_chunk_bytes) * factor)
    if budget is None:
        return BudgetPlan(None, dict(items, lm_head=head_cost), tuple(range(n)), (), False, 0, 0, tuple(layer_bytes), factor)
    biggest = max(list(layer_bytes) + list(head_chunk_bytes), default=0)
    slot = int(biggest * (1.0 if in_place else 1 + PREPACK_FACTOR))

    def plan(head_streamed: bool) -> BudgetPlan | None:
        line = dict(items) if head_streamed else dict(items, lm_head=head_cost)
        spare = budget - sum(line.values()) - MIN_SLOTS * slot
        if spare < 0:
            return None
        fit = 0  # how many layers fit, taken in order (a lower bound on what can be pinned)
        for i in range(n):
            cost = int(layer_bytes[i] * factor)
            if cost > spare:
                break
            fit += 1
            spare -= cost
        spare += sum(int(layer_bytes[i] * factor) for i in range(fit))
        for n_streamed in range(n - fit, n + 1):  # spreading may pick smaller layers to stream: then one more
            streamed = spread(n, n_streamed)
            pinned = [i for i in range(n) if i not in streamed]
            cost = sum(int(layer_bytes[i] * factor) for i in pinned)
            if cost <= spare:
                spare -= cost
                break
        if not streamed and not head_streamed:
            return BudgetPlan(budget, line, tuple(pinned), (), False, 0, 0, tuple(layer_bytes), factor)
        extra = min(max_slots - MIN_SLOTS, spare // slot)
        return BudgetPlan(budget, line, tuple(pinned), streamed, head_streamed, MIN_SLOTS + extra, slot,
                          tuple(layer_bytes), factor)

    def reads(p: BudgetPlan) -> int:  # bytes a pass streams
        return sum(layer_bytes[i] for i in p.streamed) + (sum(head_chunk_bytes) if p.head_streamed else 0)

    usual = plan(False) or plan(True)
    if usual is not None and stream_head and usual.streamed and not usual.head_streamed:
        alt = plan(True)
        if reads(alt) <= reads(usual) + max(layer_bytes) and len(alt.streamed) >= STREAM_HEAD_MIN_SHARE * n:
            return alt
    if usual is not None:
        return usual
    need = sum(items.values()) + MIN_SLOTS * slot
    mib = lambda v: f"{v / 2**20:,.{1 if v < 100 * 2**20 else 0}f} MiB"  # noqa: E731
    detail = ", ".join(f"{k} {mib(v)}" for k, v in items.items())
    err = BudgetError(
        f"a DRAM budget of {mib(budget)} cannot run this model pair: the resident minimum is {mib(need)} "
        f"({detail}, plus {MIN_SLOTS} stream slots of {mib(slot)}); raise --dram-budget to at least {mib(need)}"
    )
    err.minimum = need
    raise err

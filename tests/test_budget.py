"""The DRAM planner: never over budget, pins a prefix, refuses with numbers."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lever_actors.budget import MIN_SLOTS, PREPACK_FACTOR, plan_budget
from lever_actors.errors import BudgetError

MB = 2**20


@given(budget=st.integers(1, 3000 * MB), layers=st.lists(st.integers(1 * MB, 60 * MB), min_size=1, max_size=40),
       head=st.lists(st.integers(1 * MB, 60 * MB), min_size=1, max_size=10),
       fixed=st.dictionaries(st.sampled_from(["kv", "draft", "act"]), st.integers(0, 800 * MB)),
       max_slots=st.integers(2, 6), in_place=st.booleans())
def test_plan_never_exceeds_the_budget(budget, layers, head, fixed, max_slots, in_place):
    try:
        plan = plan_budget(budget, fixed, layers, head, max_slots=max_slots, in_place=in_place)
    except BudgetError as e:
        assert e.minimum > budget
        assert "raise --dram-budget" in str(e)
        return
    assert plan.total <= budget
    assert plan.pinned == tuple(range(len(plan.pinned)))  # earliest layers pinned
    assert set(plan.pinned) | set(plan.streamed) == set(range(len(layers)))
    assert not set(plan.pinned) & set(plan.streamed)
    if plan.streamed or plan.head_streamed:
        assert MIN_SLOTS <= plan.n_slots <= max_slots
        # a slot holds the read buffer, plus the prepacked session copy unless layers compute in place
        assert plan.slot_bytes >= max(layers + head) * (1 if in_place else 1 + PREPACK_FACTOR) - 1


def test_unlimited_budget_pins_everything():
    plan = plan_budget(None, {"kv": 5}, [10, 20], [7])
    assert plan.pinned == (0, 1) and not plan.streamed and not plan.head_streamed


@pytest.mark.parametrize("in_place", [True, False])
def test_head_streams_only_when_it_does_not_fit(in_place):
    layers, head = [10 * MB] * 4, [10 * MB] * 3
    slot = 10 * MB * (1 if in_place else 1 + PREPACK_FACTOR)
    roomy = plan_budget(400 * MB, {}, layers, head, in_place=in_place)
    tight = plan_budget(int(2 * slot) + MB, {}, layers, head, in_place=in_place)
    assert not roomy.head_streamed and tight.head_streamed and not tight.pinned
    with pytest.raises(BudgetError):
        plan_budget(int(2 * slot) - MB, {}, layers, head, in_place=in_place)


def test_in_place_layers_pin_more_in_the_same_budget():
    layers, head = [10 * MB] * 20, [10 * MB]
    native = plan_budget(150 * MB, {}, layers, head, in_place=True)
    prepacked = plan_budget(150 * MB, {}, layers, head, in_place=False)
    assert len(native.pinned) > len(prepacked.pinned)
    # an in-place layer costs its own bytes; a prepacked one carries ORT's copy on top
    assert native.pinned_bytes == sum(layers[i] for i in native.pinned)
    assert prepacked.pinned_bytes == sum(int(layers[i] * PREPACK_FACTOR) for i in prepacked.pinned)
    assert native.slot_bytes == max(layers + head)

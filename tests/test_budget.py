"""The DRAM planner: never over budget, streams what it cannot pin spread through the pass, refuses with numbers."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lever_actors.budget import MIN_SLOTS, PREPACK_FACTOR, STREAM_HEAD_MIN_SHARE, plan_budget, spread
from lever_actors.errors import BudgetError

MB = 2**20


@given(budget=st.integers(1, 3000 * MB), layers=st.lists(st.integers(1 * MB, 60 * MB), min_size=1, max_size=40),
       head=st.lists(st.integers(1 * MB, 60 * MB), min_size=1, max_size=10),
       fixed=st.dictionaries(st.sampled_from(["kv", "draft", "act"]), st.integers(0, 800 * MB)),
       max_slots=st.integers(2, 6), in_place=st.booleans(), stream_head=st.booleans())
def test_plan_never_exceeds_the_budget(budget, layers, head, fixed, max_slots, in_place, stream_head):
    try:
        plan = plan_budget(budget, fixed, layers, head, max_slots=max_slots, in_place=in_place, stream_head=stream_head)
    except BudgetError as e:
        assert e.minimum > budget
        assert "raise --dram-budget" in str(e)
        return
    assert plan.total <= budget
    assert plan.streamed == spread(len(layers), len(plan.streamed))  # evenly spread, the last layer streamed
    assert set(plan.pinned) | set(plan.streamed) == set(range(len(layers)))
    assert not set(plan.pinned) & set(plan.streamed)
    if plan.streamed or plan.head_streamed:
        assert MIN_SLOTS <= plan.n_slots <= max_slots
        # a slot holds the read buffer, plus the prepacked session copy unless layers compute in place
        assert plan.slot_bytes >= max(layers + head) * (1 if in_place else 1 + PREPACK_FACTOR) - 1


@given(n=st.integers(1, 64), data=st.data())
def test_spread_is_even_distinct_and_ends_with_the_last_layer(n, data):
    s = data.draw(st.integers(0, n))
    got = spread(n, s)
    assert len(got) == s and len(set(got)) == s and all(0 <= i < n for i in got)
    if s:
        assert got[-1] == n - 1
        gaps = [b - a for a, b in zip((-1,) + got, got)]
        assert max(gaps) - min(gaps) <= 1  # as even as integers allow


def test_flash_ar_at_one_gib_streams_every_seventh_layer():
    assert spread(28, 4) == (6, 13, 20, 27)
    # the planner itself: 28 equal layers, room for 24 beside two slots -> the same four streamed
    plan = plan_budget(31 * MB + 2 * 10 * MB + 24 * 10 * MB, {"kv": 30 * MB}, [10 * MB] * 28, [1 * MB], max_slots=2)
    assert plan.pinned and plan.streamed == (6, 13, 20, 27)


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
    assert "LM head streamed" in tight.describe() and "LM head streamed" not in roomy.describe()
    with pytest.raises(BudgetError):
        plan_budget(int(2 * slot) - MB, {}, layers, head, in_place=in_place)


def _reads(plan, layers, head) -> int:
    """Bytes a pass of ``plan`` streams."""
    return sum(layers[i] for i in plan.streamed) + (sum(head) if plan.head_streamed else 0)


@given(budget=st.integers(1, 3000 * MB), layers=st.lists(st.integers(1 * MB, 60 * MB), min_size=1, max_size=40),
       head=st.lists(st.integers(1 * MB, 60 * MB), min_size=1, max_size=10),
       fixed=st.dictionaries(st.sampled_from(["kv", "draft", "act"]), st.integers(0, 800 * MB)))
def test_a_streamed_head_pins_layers_in_its_place_only_where_that_reads_about_as_much(budget, layers, head, fixed):
    """lever's plan (``stream_head``): where the usual plan pins everything, so does it; where the usual
    plan streams layers beside a pinned head, the head streams instead only when that reads no more
    than one layer more a pass and at least half the layers still stream, and then pins at least as
    many layers; otherwise the plans agree."""
    try:
        usual = plan_budget(budget, fixed, layers, head)
    except BudgetError:
        with pytest.raises(BudgetError):
            plan_budget(budget, fixed, layers, head, stream_head=True)
        return
    plan = plan_budget(budget, fixed, layers, head, stream_head=True)
    assert _reads(plan, layers, head) <= _reads(usual, layers, head) + max(layers)
    if plan != usual:
        assert usual.streamed and not usual.head_streamed
        assert plan.head_streamed and len(plan.pinned) >= len(usual.pinned)
        assert len(plan.streamed) >= STREAM_HEAD_MIN_SHARE * len(layers)


LEVER_768 = {"runtime": 101 * MB, "headroom": 40 * MB, "target_kv": 28 * MB, "activations": 32 * MB,
             "draft_weights": 210 * MB, "draft_activations": 8 * MB, "draft_kv": 12 * MB}  # lever's items at 768 MiB
TARGET_LAYERS = [29990912 if i % 3 == 0 else 26341376 for i in range(28)]  # the 1.5B target's layer sizes
TARGET_HEAD = [29683712] * 6 + [13393920]  # its LM head's seven slices: 183 MiB


def test_lever_streams_the_real_targets_head_at_768_mib_and_pins_layers_in_its_place():
    """The real pair's shapes at 768 MiB: the usual plan pins the head and 3 layers; lever's streams the
    head and pins 10 layers, reading about the same bytes a pass (18 layers and the head, not 25 layers)."""
    usual = plan_budget(768 * MB, LEVER_768, TARGET_LAYERS, TARGET_HEAD)
    plan = plan_budget(768 * MB, LEVER_768, TARGET_LAYERS, TARGET_HEAD, stream_head=True)
    assert not usual.head_streamed and len(usual.pinned) == 3
    assert plan.head_streamed and len(plan.pinned) == 10
    assert _reads(plan, TARGET_LAYERS, TARGET_HEAD) <= _reads(usual, TARGET_LAYERS, TARGET_HEAD)


@pytest.mark.parametrize("budget_mib, streams", [(700, True), (832, True), (896, False), (1024, False)])
def test_lever_keeps_its_head_pinned_where_fewer_than_half_the_layers_would_stream(budget_mib, streams):
    """Streamed, the head's reads all come after the last layer; with fewer than half the layers
    streaming, the layers' part of the pass is bound by their compute and the flash lane idles
    through it (1 GiB: 8 of 28 layers would stream, and the streamed head ran 0.96x the pinned one).
    The real pair's shapes: lever streams its head up to 832 MiB (16 layers streamed beside it),
    not from 896 MiB (13)."""
    usual = plan_budget(budget_mib * MB, LEVER_768, TARGET_LAYERS, TARGET_HEAD)
    plan = plan_budget(budget_mib * MB, LEVER_768, TARGET_LAYERS, TARGET_HEAD, stream_head=True)
    assert usual.streamed and not usual.head_streamed
    if streams:
        assert plan.head_streamed and len(plan.streamed) >= 14 and len(plan.pinned) > len(usual.pinned)
    else:
        assert plan == usual


def test_a_head_larger_than_what_streams_stays_pinned():
    """Near a budget that fits everything (1.375 GiB for the real pair) the usual plan streams one or two
    layers; streaming the head (183 MiB) there would read several times as much: lever keeps it pinned."""
    usual = plan_budget(1408 * MB, LEVER_768, TARGET_LAYERS, TARGET_HEAD)
    plan = plan_budget(1408 * MB, LEVER_768, TARGET_LAYERS, TARGET_HEAD, stream_head=True)
    assert usual.streamed and len(usual.streamed) <= 3 and not usual.head_streamed
    assert plan == usual


def test_in_place_layers_pin_more_in_the_same_budget():
    layers, head = [10 * MB] * 20, [10 * MB]
    native = plan_budget(150 * MB, {}, layers, head, in_place=True)
    prepacked = plan_budget(150 * MB, {}, layers, head, in_place=False)
    assert len(native.pinned) > len(prepacked.pinned)
    # an in-place layer costs its own bytes; a prepacked one carries ORT's copy on top
    assert native.pinned_bytes == sum(layers[i] for i in native.pinned)
    assert prepacked.pinned_bytes == sum(int(layers[i] * PREPACK_FACTOR) for i in prepacked.pinned)
    assert native.slot_bytes == max(layers + head)


def test_a_longer_context_says_how_many_pinned_layers_its_kv_rows_cost():
    from lever_actors.budget import context_trade

    layers, head = [10 * MB] * 12, [8 * MB]
    short = plan_budget(200 * MB, {"target_kv": 20 * MB, "activations": 5 * MB}, layers, head)
    long = plan_budget(200 * MB, {"target_kv": 80 * MB, "activations": 10 * MB}, layers, head)
    assert len(long.pinned) < len(short.pinned)
    text = context_trade(long, short, 4096, 1024)
    assert text.startswith("a 4096-token context takes 65 MiB more for KV rows and activations than 1024 tokens")
    assert f"{len(short.pinned) - len(long.pinned)} fewer pinned layers ({len(long.pinned)} instead of " \
           f"{len(short.pinned)})" in text
    assert text in dataclasses.replace(long, trade=text).describe()
    assert "would not run at all" in context_trade(long, None, 4096, 1024)
    assert "less for KV rows" in context_trade(short, long, 512, 4096) and "more pinned layers" in context_trade(short, long, 512, 4096)


def test_a_longer_context_that_trades_the_pinned_head_for_a_layer_says_so():
    """The head pinned at the short context (no layer), streamed at the long one (a layer fits then):
    one *more* pinned layer and a streamed head, not "1 fewer pinned layers (1 instead of 0)"."""
    from lever_actors.budget import context_trade

    layers, head = [10 * MB] * 12, [10 * MB] * 3
    short = plan_budget(100 * MB, {"target_kv": 45 * MB}, layers, head)
    long = plan_budget(100 * MB, {"target_kv": 60 * MB}, layers, head)
    assert not short.head_streamed and not short.pinned and long.head_streamed and long.pinned
    text = context_trade(long, short, 4096, 1024)
    assert f"{len(long.pinned)} more pinned layers ({len(long.pinned)} instead of 0) and streams the LM head" in text
    assert "pins the LM head" in context_trade(short, long, 1024, 4096)


def test_a_context_trade_counts_in_words_that_follow_the_number():
    """One layer or slot is "1 ... layer", not "1 ... layers"; no change says so."""
    from lever_actors.budget import context_trade

    layers, head = [10 * MB] * 12, [8 * MB]
    base = plan_budget(200 * MB, {"target_kv": 20 * MB}, layers, head)
    one_fewer = dataclasses.replace(base, pinned=base.pinned[1:], n_slots=base.n_slots + 1,
                                    items={"target_kv": 30 * MB})
    text = context_trade(one_fewer, base, 4096, 1024)
    assert f"1 fewer pinned layer ({len(base.pinned) - 1} instead of {len(base.pinned)}) and 1 more stream slot" \
        in text and "layers (" not in text and "slots" not in text
    two_more = context_trade(base, dataclasses.replace(base, pinned=base.pinned[2:]), 512, 1024)
    assert "2 more pinned layers" in two_more
    same = context_trade(dataclasses.replace(base, items={"target_kv": 21 * MB}), base, 2048, 1024)
    assert same.endswith("than 1024 tokens: the same pinned layers")

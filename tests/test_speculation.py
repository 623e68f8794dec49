"""Cross-step bookkeeping on its own: hits, misses, and what the drafter is told, over random runs."""
from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

import numpy as np
import pytest

from lever_actors.speculation import CrossStep, main_path, outcome_hypotheses


def expansion(*assumed: int, hypothesis: int = 0):
    return SimpleNamespace(assumed=assumed, root_token=assumed[-1], hypothesis=hypothesis)


def test_main_path_follows_the_most_probable_child():
    # root(0) -> 1 (p .6), 2 (p .3); 1 -> 3 (p .2), 4 (p .7); 4 -> 5; 2 -> 6
    drafted = [10, 20, 30, 40, 50, 60]
    parents = [-1, 0, 0, 1, 1, 4, 2]
    probs = [0.6, 0.3, 0.2, 0.7, 0.9, 0.99]
    assert main_path(drafted, parents, probs) == [10, 40, 50]
    assert main_path([], [-1], []) == []
    assert main_path([7, 8, 9], [-1, 0, 1, 2], [0.1, 0.2, 0.3]) == [7, 8, 9]  # a chain is its own main path


def test_a_hit_keeps_the_tree_drafted_under_the_outcome_that_held():
    cs = CrossStep(unseen=[1, 2, 3])
    assert cs.settle_fields() == {"committed": (1, 2, 3)}
    cs.assume(2)
    main, early = expansion(5, 6, 7), expansion(8, hypothesis=1)
    assert cs.settle([8], [main, early])
    assert (cs.hits, cs.misses, cs.early_hits) == (1, 0, 1)
    assert cs.take_ready() is early and cs.take_ready() is None  # handed out once
    assert cs.settle_fields() == {"committed": (8,)}  # the drafter finds its own rows for them
    assert cs.settle_fields() == {"committed": ()}  # ... and is told once


def test_a_hit_on_the_drafts_runner_up_token_is_not_an_early_stop():
    cs = CrossStep()
    cs.assume(3)
    main, runner_up, early = expansion(5, 6, 7), expansion(5, 6, 9, hypothesis=1), expansion(8, hypothesis=2)
    assert cs.settle([5, 6, 9], [main, runner_up, early])
    assert (cs.hits, cs.runner_up_hits, cs.early_hits) == (1, 1, 0) and cs.take_ready() is runner_up
    cs.assume(3)
    assert cs.settle([8], [main, runner_up, early])
    assert (cs.hits, cs.runner_up_hits, cs.early_hits) == (2, 1, 1)
    cs.assume(2)  # no room to assume the main path: a stop at the root is still an early stop
    assert cs.settle([9], [SimpleNamespace(assumed=(), root_token=0, hypothesis=0), expansion(9, hypothesis=1)])
    assert (cs.hits, cs.runner_up_hits, cs.early_hits) == (3, 1, 2)


def test_a_miss_drops_the_trees_and_sends_the_real_tokens():
    cs = CrossStep()
    cs.assume(2)
    assert not cs.settle([5, 9], [expansion(5, 6, 7), expansion(8)])
    assert (cs.hits, cs.misses) == (0, 1) and cs.take_ready() is None
    assert cs.settle_fields() == {"committed": (5, 9)}


def test_a_miss_says_whether_the_stop_or_only_the_next_token_was_wrong():
    cs = CrossStep()
    assumed = [expansion(5, 6, 7), expansion(5, 8, hypothesis=1)]  # main path 5, 6 then 7; a stop after 5, then 8
    cs.assume(2)
    assert not cs.settle([2], assumed)  # stopped at the root: no assumption did
    assert (cs.misses, cs.next_token_misses) == (1, 0)
    cs.assume(2)
    assert not cs.settle([5, 6, 9], assumed)  # the main path held, the target's next token was not the draft's
    assert (cs.misses, cs.next_token_misses) == (2, 1)
    cs.assume(2)
    assert not cs.settle([5, 3], assumed)  # the early stop held, its next token did not
    assert (cs.misses, cs.next_token_misses) == (3, 2)
    no_main = [SimpleNamespace(assumed=(), root_token=0, hypothesis=0), expansion(5, hypothesis=1)]
    cs.assume(2)  # no room to assume the main path: its empty guess names no stop (the root's does)
    assert not cs.settle([7, 1], no_main)
    assert (cs.misses, cs.next_token_misses) == (4, 2)
    cs.assume(2)
    assert not cs.settle([4], no_main)
    assert (cs.misses, cs.next_token_misses) == (5, 3)


def test_no_assumption_in_flight_is_neither_hit_nor_miss():
    cs = CrossStep()
    assert not cs.settle([4], [])
    assert (cs.hits, cs.misses) == (0, 0) and cs.hit_rate is None
    assert cs.settle_fields()["committed"] == (4,)


def test_commits_without_a_request_between_them_all_reach_the_drafter():
    cs = CrossStep()
    cs.assume(1)
    assert cs.settle([5, 6], [expansion(5, 6)])
    assert not cs.settle([7], [])  # the tree drafted ahead was verified; nothing was drafted beside it
    assert cs.settle_fields() == {"committed": (5, 6, 7)}


def test_outcomes_start_with_the_main_path_then_the_likeliest_stops():
    # root -> 1 (10, p .9) -> 3 (30, p .8) -> 4 (40, p .9); root -> 2 (20, p .05)
    drafted, parents = [10, 20, 30, 40], [-1, 0, 0, 1, 3]
    probs = np.array([0.9, 0.05, 0.8, 0.9])
    cond = np.concatenate([[1.0], probs])
    out = outcome_hypotheses(parents, drafted, probs, cond, 3)
    assert out[0][:2] == ((10, 30, 40), ())
    # stops: root .05, node 1 .9 * .2 = .18, node 3 .72 * .1 = .072, node 2 .05
    assert [o[:2] for o in out[1:]] == [((10,), (30,)), ((10, 30), (40,))]
    assert out[1][2] == pytest.approx(0.18)
    assert [o[:2] for o in outcome_hypotheses(parents, drafted, probs, cond, 3, min_weight=0.1)] == [
        ((10, 30, 40), ()), ((10,), (30,))]
    assert outcome_hypotheses([-1], [], np.zeros(0), np.ones(1), 3) == [((), (), 1.0)]


@given(st.integers(1, 12), st.integers(1, 4), st.data())
def test_outcomes_are_distinct_tree_stops_with_their_children_excluded(n, k, data):
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n + 1)]
    drafted = list(range(100, 100 + n))
    probs = np.array(data.draw(st.lists(st.floats(0, 1), min_size=n, max_size=n)))
    cond = np.concatenate([[1.0], probs])
    out = outcome_hypotheses(parents, drafted, probs, cond, k)
    assert 1 <= len(out) <= k
    assert out[0][0] == tuple(main_path(drafted, parents, probs)) and out[0][1] == ()
    assert len({o[0] for o in out}) == len(out)
    node_of = {(): 0}
    for i in range(1, n + 1):
        node_of[node_of_path(parents, drafted, i)] = i
    for path, excluded, weight in out:
        x = node_of[path]
        assert set(excluded) == {drafted[c - 1] for c in range(1, n + 1) if parents[c] == x}
        assert 0 <= weight <= 1


def node_of_path(parents, drafted, i):
    toks = []
    while i > 0:
        toks.append(drafted[i - 1])
        i = parents[i]
    return tuple(toks[::-1])


@given(st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=3), st.lists(st.integers(0, 3), min_size=1, max_size=4),
                          st.integers(0, 3), st.booleans()), max_size=30))
def test_drafter_hears_every_commit_exactly_once(passes):
    """Replays the driver's protocol: the tokens the drafter is sent are exactly the committed
    sequence, whatever was guessed and whichever passes had a request."""
    cs = CrossStep(unseen=[100])
    told = []

    def request():
        told.extend(cs.settle_fields()["committed"])

    committed = [100]
    for assumed, real, root, ahead in passes:
        if cs.take_ready() is None:
            request()
        if ahead:
            request()
            cs.assume(1)
        committed += real
        hit = cs.settle(real, [expansion(*assumed, root)] if ahead else [])
        assert hit == (ahead and real == assumed + [root])
    request()
    assert told == committed
    assert cs.hits + cs.misses == sum(1 for *_, ahead in passes if ahead)

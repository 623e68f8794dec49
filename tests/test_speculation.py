"""Cross-step bookkeeping on its own: hits, misses, and what the drafter is told, over random runs."""
from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from lever_actors.speculation import CrossStep, main_path


def expansion(root: int):
    return SimpleNamespace(root_token=root)


def test_main_path_follows_the_most_probable_child():
    # root(0) -> 1 (p .6), 2 (p .3); 1 -> 3 (p .2), 4 (p .7); 4 -> 5; 2 -> 6
    drafted = [10, 20, 30, 40, 50, 60]
    parents = [-1, 0, 0, 1, 1, 4, 2]
    probs = [0.6, 0.3, 0.2, 0.7, 0.9, 0.99]
    assert main_path(drafted, parents, probs) == [10, 40, 50]
    assert main_path([], [-1], []) == []
    assert main_path([7, 8, 9], [-1, 0, 1, 2], [0.1, 0.2, 0.3]) == [7, 8, 9]  # a chain is its own main path


def test_a_hit_keeps_the_tree_and_confirms_once():
    cs = CrossStep(unseen=[1, 2, 3])
    assert cs.settle_fields() == {"committed": (1, 2, 3), "confirmed": False}
    cs.assume([5, 6])
    exp = expansion(7)
    assert cs.settle([5, 6, 7], exp)
    assert (cs.hits, cs.misses) == (1, 0)
    assert cs.take_ready() is exp and cs.take_ready() is None  # handed out once
    assert cs.settle_fields() == {"committed": (), "confirmed": True}  # the drafter saw these tokens itself
    assert cs.settle_fields() == {"committed": (), "confirmed": False}  # ... and is told once


def test_a_miss_drops_the_tree_and_sends_the_real_tokens():
    cs = CrossStep()
    cs.assume([5, 6])
    assert not cs.settle([5, 9], expansion(7))
    assert (cs.hits, cs.misses) == (0, 1) and cs.take_ready() is None
    assert cs.settle_fields() == {"committed": (5, 9), "confirmed": False}


def test_no_assumption_in_flight_is_neither_hit_nor_miss():
    cs = CrossStep()
    assert not cs.settle([4], None)
    assert (cs.hits, cs.misses) == (0, 0) and cs.hit_rate is None
    assert cs.settle_fields()["committed"] == (4,)


@given(st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=3), st.lists(st.integers(0, 3), min_size=1, max_size=4),
                          st.integers(0, 3), st.booleans()), max_size=30))
def test_drafter_hears_every_commit_exactly_once(passes):
    """Replays the driver's protocol: the tokens the drafter learns, from requests or from its own
    confirmed assumptions, are exactly the committed sequence, whatever was guessed."""
    cs = CrossStep(unseen=[100])
    told, pending = [], None  # what the drafter knows as history; its unconfirmed assumption

    def request(assumption=None):
        nonlocal pending
        f = cs.settle_fields()
        if pending is not None and f["confirmed"]:
            told.extend(pending)
        pending = None  # confirmed into history, or undone (then the real tokens are in ``committed``)
        told.extend(f["committed"])
        if assumption is not None:
            pending = assumption

    committed = [100]
    for assumed, real, root, ahead in passes:
        if cs.take_ready() is None:
            request()
        if ahead:
            request(assumed + [root])
            cs.assume(assumed)
        committed += real
        hit = cs.settle(real, expansion(root) if ahead else None)
        assert hit == (ahead and real == assumed + [root])
    request()
    assert told == committed
    assert cs.hits + cs.misses == sum(1 for *_, ahead in passes if ahead)

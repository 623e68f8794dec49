"""The drafter's scratch tree on its own: nodes keyed by path, walks, and rebasing below a committed outcome."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lever_actors.scratch_tree import ScratchTree


def _tokens_of(tree: ScratchTree, node: int) -> tuple[int, ...]:
    return tuple(tree.tok[n] for n in tree.path(node))


def test_a_token_drafted_twice_under_one_path_is_one_node():
    t = ScratchTree()
    a = t.add(-1, 5)
    assert t.add(-1, 5) == a and t.add(a, 5) != a and len(t) == 2
    assert t.child(-1, 6) is None and t.path(1) == [0, 1]


def test_a_walk_stops_at_the_first_token_not_drafted_or_not_fed():
    t = ScratchTree()
    a = t.add(-1, 1)
    b = t.add(a, 2)
    t.add(b, 3)
    t.hid[a] = t.hid[b] = 0.0
    assert t.walk([1, 2, 3]) == [a, b]  # node 3 was never fed
    assert t.walk([1, 9, 3]) == [a] and t.walk([4]) == []


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 2)), max_size=40), st.data())
def test_rebasing_below_a_node_keeps_every_path_below_it(adds, data):
    t = ScratchTree()
    for parent_pick, token in adds:
        parent = -1 if not len(t) else parent_pick % (len(t) + 1) - 1
        n = t.add(parent, token)
        t.hid[n] = n  # a stand-in for the node's row
    if not len(t):
        return
    root = data.draw(st.integers(0, len(t) - 1))
    below = t.below(root)
    assert all(root in t.path(n) and n != root for n in below)
    assert len(below) == sum(1 for n in range(len(t)) if root in t.path(n)) - 1
    new = t.rebased(below, root)
    prefix = len(t.path(root))
    assert sorted(_tokens_of(new, j) for j in range(len(new))) == sorted(_tokens_of(t, n)[prefix:] for n in below)
    assert [new.hid[j] for j in range(len(new))] == below  # node below[j] became node j, its row with it
    assert all(new.par[j] < j for j in range(len(new)))

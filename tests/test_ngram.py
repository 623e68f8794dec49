"""Prompt lookup and branch merging, as plain functions."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lever_actors.ngram import merge_branch, prompt_lookup


def test_lookup_continues_the_most_recent_occurrence_of_the_longest_suffix():
    ctx = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert prompt_lookup(ctx, 3) == [7, 8, 5]  # [1, 2, 3] last seen before 7 8 5
    assert prompt_lookup([4, 5, 6, 4, 5], 2) == [6, 4]
    assert prompt_lookup([1, 2, 3, 4], 3) == []  # nothing recurs
    assert prompt_lookup([1, 2, 1, 2], 0) == []
    assert prompt_lookup([7, 7, 7], 2, min_match=2) == [7]  # only one token follows the earlier 7 7


@given(st.lists(st.integers(0, 4), max_size=40), st.integers(1, 8))
def test_lookup_returns_a_real_continuation(ctx, k):
    out = prompt_lookup(ctx, k)
    assert len(out) <= k
    if out:  # some earlier occurrence of a suffix is followed by exactly these tokens
        n = len(ctx)
        assert any(ctx[s - m:s] == ctx[n - m:] and ctx[s:s + len(out)] == out
                   for m in range(2, 5) for s in range(m, n))


def test_merge_reuses_shared_nodes_and_appends_the_rest():
    tokens, parents = [10, 20, 30], [-1, 0, 1, 0]  # root -> 10 -> 20; root -> 30
    t, p, first = merge_branch(tokens, parents, [10, 20, 40, 50])
    assert first == 4 and t == [10, 20, 30, 40, 50] and p == [-1, 0, 1, 0, 2, 4]
    t, p, first = merge_branch(tokens, parents, [10, 20])
    assert (t, p) == (tokens, parents) and first == 4  # nothing new


@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=6), st.data())
def test_merged_tree_is_topological_and_holds_the_branch_as_a_path(tokens, branch, data):
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, len(tokens) + 1)]
    t, p, first = merge_branch(tokens, parents, branch)
    assert t[: len(tokens)] == tokens and p[: len(parents)] == parents  # old nodes untouched
    assert all(p[i] < i for i in range(1, len(p)))
    node = 0
    for tok in branch:  # the branch is a path from the root
        node = next(i for i in range(1, len(p)) if p[i] == node and t[i - 1] == tok)

"""Cross-step drafting keeps the draft's KV cache exact whatever the verdict.

A cross-step request drafts ahead under several assumed outcomes; the next
request's committed tokens say which (if any) held. Either way the cache must end
up holding exactly the rows a drafter that never speculated would hold (the draft
model is batch-invariant, so "exactly" means bit for bit), or later drafts would
silently get worse.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import trio

from actors.draft import Drafter
from lever_actors.bundle import load_bundle
from lever_actors.model import Transformer
from lever_actors.ortrt import LaneConfig
from lever_actors.trace import Tracer
from protocols import DraftRequest, DraftSteer

CONTEXT = 128
PROMPT = [5, 9, 13, 2, 7, 11]


def _drafter(bundle) -> Drafter:
    return Drafter(Transformer(load_bundle(bundle), CONTEXT, LaneConfig()), None, None, None, Tracer(enabled=False))


def _req(step, **kw) -> DraftRequest:
    base = dict(session_id=1, step=step, epoch=0, root_token=0, position=0, max_nodes=4, max_depth=4, top_k=1)
    return DraftRequest(**(base | kw))


def _prefix(d: Drafter) -> tuple[np.ndarray, np.ndarray]:
    n = d.m.kv.length
    return d.m.kv.k[:, :, :n].copy(), d.m.kv.v[:, :, :n].copy()


def _check_rows(d: Drafter, bundle, sequence: list[int]) -> None:
    """The drafter's committed rows are exactly a plain prefill of ``sequence``, bit for bit."""
    ref = Transformer(load_bundle(bundle), CONTEXT, LaneConfig())
    ref.prefill(sequence)
    assert d.m.kv.length == len(sequence)
    for a, b in zip(_prefix(d), (ref.kv.k[:, :, :len(sequence)], ref.kv.v[:, :, :len(sequence)])):
        np.testing.assert_array_equal(a, b)


def _first(d: Drafter, **kw):
    return d.draft(_req(0, root_token=PROMPT[-1], position=len(PROMPT) - 1, committed=tuple(PROMPT), reset=True, **kw))


@pytest.mark.parametrize("verdict", ["main-held", "second-held", "diverges-at-0", "diverges-at-2", "all-but-bonus"])
def test_speculation_then_verdict_leaves_the_exact_cache(tiny_bundles, verdict):
    """Two outcomes drafted ahead; whichever holds (or none), the committed rows are exact, and a
    held outcome's next tree is what a drafter that never speculated drafts after it."""
    spec = _drafter(tiny_bundles[1])
    (tree,) = _first(spec)
    chain = [int(t) for t in tree.tokens]
    main, second = spec.draft(_req(1, root_token=PROMPT[-1], position=len(PROMPT) - 1,
                                   hypotheses=((tuple(chain), (), 4, 4, 0), ((), (chain[0],), 3, 3, 0))))
    assert main.assumed[:-1] == tuple(chain) and second.assumed[:-1] == () and second.assumed[0] != chain[0]
    assert (main.hypothesis, main.of, second.hypothesis) == (0, 2, 1)
    assert main.position == len(PROMPT) - 1 + len(main.assumed) and second.position == len(PROMPT)
    actual = {"main-held": list(main.assumed),
              "second-held": list(second.assumed),
              "diverges-at-0": [(chain[0] + 1) % 50],
              "diverges-at-2": chain[:2] + [(chain[2] + 1) % 50],
              "all-but-bonus": chain + [(int(main.root_token) + 1) % 50]}[verdict]
    nxt = _req(2, root_token=actual[-1], position=len(PROMPT) + len(actual) - 1, committed=tuple(actual))
    (after,) = spec.draft(nxt)
    _check_rows(spec, tiny_bundles[1], PROMPT + actual)
    plain = _drafter(tiny_bundles[1])
    plain.draft(_req(0, root_token=actual[-1], position=len(PROMPT) + len(actual) - 1,
                     committed=tuple(PROMPT + actual), reset=True, max_nodes=0, max_depth=0))
    (want,) = plain.draft(_req(2, root_token=actual[-1], position=len(PROMPT) + len(actual) - 1))
    np.testing.assert_array_equal(after.tokens, want.tokens)
    np.testing.assert_array_equal(after.parents, want.parents)
    if verdict in ("main-held", "second-held"):  # drafted ahead: the same tree, found in the scratch rows
        held = main if verdict == "main-held" else second
        np.testing.assert_array_equal(held.tokens[:len(want.tokens)], want.tokens[:len(held.tokens)])


def test_held_outcome_keeps_its_subtree_rows_through_further_commits(tiny_bundles):
    """A hit moves the tree drafted below the outcome up next to the prefix; committing its path later
    uses those rows, and they are exactly what feeding the tokens would give."""
    d = _drafter(tiny_bundles[1])
    (tree,) = _first(d, max_nodes=3, max_depth=3)
    path = [int(t) for t in tree.tokens]
    (h,) = d.draft(_req(1, root_token=PROMPT[-1], position=len(PROMPT) - 1, hypotheses=((tuple(path), (), 4, 4, 0),)))
    outcome = list(h.assumed)
    below = [int(t) for t in h.tokens]
    for step, commit in enumerate([outcome, below[:2], below[2:] + [7]], start=2):
        d.draft(_req(step, root_token=commit[-1], position=0, committed=tuple(commit), max_nodes=2, max_depth=2))
    _check_rows(d, tiny_bundles[1], PROMPT + outcome + below + [7])


def test_a_v6_style_confirmation_commits_the_assumed_outcome(tiny_bundles):
    """``confirmed_hypothesis`` stands for the tokens that hypothesis assumed (what v6 said with ``confirmed``)."""
    d = _drafter(tiny_bundles[1])
    (tree,) = _first(d)
    (h,) = d.draft(_req(1, root_token=PROMPT[-1], position=len(PROMPT) - 1, hypotheses=((tuple(tree.tokens[:2].tolist()), (), 4, 4, 0),)))
    d.draft(_req(2, root_token=9, position=0, committed=(9,), confirmed_hypothesis=0, max_nodes=2, max_depth=2))
    _check_rows(d, tiny_bundles[1], PROMPT + list(h.assumed) + [9])
    with pytest.raises(ValueError, match="never assumed"):
        d.draft(_req(3, root_token=9, position=0, confirmed_hypothesis=3))


def test_nodes_and_their_ancestors_fed_in_one_call_match_feeding_them_apart(tiny_bundles):
    """Tree attention: a path of undrafted nodes (a prompt-lookup branch) is fed in one draft call."""
    d = _drafter(tiny_bundles[1])
    _first(d, max_nodes=0, max_depth=0)
    a = d._node(-1, 3)
    b = d._node(a, 4)
    d._feed_nodes([b, a])
    d._sync([3, 4, 8])
    _check_rows(d, tiny_bundles[1], PROMPT + [3, 4, 8])


@pytest.mark.parametrize("hit", [True, False])
def test_speculating_on_the_first_token_during_prefill(tiny_bundles, hit):
    """The reset request may already assume the first token (the target is still prefilling)."""
    spec = _drafter(tiny_bundles[1])
    (guess,) = _first(spec, max_nodes=0, max_depth=0, hypotheses=(((), (), 4, 4, 0),))
    assert len(guess.tokens) > 0 and guess.position == len(PROMPT) and guess.assumed == (guess.root_token,)
    token = int(guess.root_token) if hit else (int(guess.root_token) + 1) % 50
    spec.draft(_req(1, root_token=token, position=len(PROMPT), committed=(token,)))
    _check_rows(spec, tiny_bundles[1], PROMPT + [token])


def test_excluded_tokens_are_never_the_assumed_next_token(tiny_bundles):
    d = _drafter(tiny_bundles[1])
    (tree,) = _first(d, max_nodes=0, max_depth=0)
    (free,) = d.draft(_req(1, root_token=PROMPT[-1], position=0, hypotheses=(((), (), 1, 1, 0),)))
    best = int(free.assumed[0])
    (other,) = d.draft(_req(2, root_token=PROMPT[-1], position=0, hypotheses=(((), (best,), 1, 1, 0),)))
    assert other.assumed[0] != best


def test_ranked_hypotheses_assume_the_drafts_runner_up_tokens_in_order(tiny_bundles):
    """Hypotheses sharing a path assume the draft's best, second and third token after it, and a
    rank counts among the tokens outside ``excluded``."""
    d = _drafter(tiny_bundles[1])
    (tree,) = _first(d, max_nodes=3, max_depth=1, top_k=3)  # level 1: the draft's three best, best first
    best = [int(t) for t in tree.tokens]
    out = d.draft(_req(1, root_token=PROMPT[-1], position=len(PROMPT) - 1,
                       hypotheses=tuple(((), (), 1, 1, r) for r in range(3))))
    assert [int(e.assumed[0]) for e in out] == best and [e.hypothesis for e in out] == [0, 1, 2]
    (skip,) = d.draft(_req(2, root_token=PROMPT[-1], position=len(PROMPT) - 1,
                           hypotheses=(((), (best[0],), 1, 1, 1),)))
    assert int(skip.assumed[0]) == best[2]


def _fields(msg) -> dict:
    import dataclasses

    return {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}


def test_alternatives_list_the_drafts_top_tokens_after_every_expanded_node(tiny_bundles):
    """The pruner's rivals: row 0 after the root, row i+1 after node i, best first, holding every
    child drafted there; a node never scored lists only its own token."""
    d = _drafter(tiny_bundles[1])
    (exp,) = d.draft(_req(0, root_token=PROMPT[-1], position=len(PROMPT) - 1, committed=tuple(PROMPT), reset=True,
                          max_nodes=12, max_depth=4, top_k=3))
    alt, parents, tokens = exp.alternatives, exp.parents, exp.tokens
    assert alt.shape == (len(tokens) + 1, 4) and alt.dtype == np.int32
    expanded = {-1} | {int(p) for p in parents}
    for v, (p, t) in enumerate(zip(parents, tokens)):
        assert t in alt[p + 1][:3]  # a top-3 child is among its parent's top tokens
    for v in range(len(tokens)):
        own = (alt[v + 1] == tokens[v]).all()
        if v in expanded:
            assert len(set(alt[v + 1].tolist())) == 4  # four distinct best tokens
        else:  # a leaf: never scored (last level), or scored but none of its children kept
            assert own or len(set(alt[v + 1].tolist())) == 4
    # row 0 is the draft's own ranking after the root: its best is the first drafted child
    assert alt[0][0] == tokens[0]


def test_a_nearly_full_context_drafts_ahead_what_fits_and_answers_every_hypothesis(tiny_bundles):
    d = _drafter(tiny_bundles[1])
    long = (PROMPT * 40)[:CONTEXT - 3]
    d.draft(_req(0, root_token=long[-1], position=len(long) - 1, committed=tuple(long), reset=True, max_nodes=0,
                 max_depth=0))
    out = d.draft(_req(1, root_token=long[-1], position=len(long) - 1,
                       hypotheses=(((), (), 8, 4, 0), ((1, 2, 3), (), 4, 4, 0))))
    assert [e.hypothesis for e in out] == [0, 1] and all(e.of == 2 for e in out)
    assert len(out[0].tokens) + 1 <= 3 and out[1].assumed == () and len(out[1].tokens) == 0
    assert d.m.kv.length + len(d.tree) <= CONTEXT


def test_hypotheses_sharing_a_path_near_a_full_context_take_only_the_slots_left(tiny_bundles):
    """One slot left: the first hypothesis's root takes it, the runner-up gets an empty answer
    (not a drafter out of KV slots)."""
    d = _drafter(tiny_bundles[1])
    long = (PROMPT * 40)[:CONTEXT - 1]
    d.draft(_req(0, root_token=long[-1], position=len(long) - 1, committed=tuple(long), reset=True, max_nodes=0,
                 max_depth=0))
    assert d._free_slots() == 1
    out = d.draft(_req(1, root_token=long[-1], position=len(long) - 1,
                       hypotheses=(((), (), 4, 4, 0), ((), (), 4, 4, 1))))
    assert len(out[0].assumed) == 1 and out[1].assumed == () and len(out[1].tokens) == 0
    assert d.m.kv.length + len(d.tree) <= CONTEXT


def test_ranked_tokens_break_ties_to_the_lower_column_and_never_name_an_excluded_one():
    from actors.draft import _ranked

    row = np.array([1.0, 3.0, 3.0, 2.0, 3.0], np.float32)
    assert [_ranked(row, r) for r in range(5)] == [1, 2, 4, 3, 0]
    row[[1, 4]] = -np.inf  # excluded
    assert [_ranked(row, r) for r in range(5)] == [2, 3, 0, None, None]


def test_trees_grown_a_level_at_a_time_are_the_trees_grown_at_once(tiny_bundles):
    """Drafting until the commit: extend requests grow the last request's trees further, and the
    trees come out as one request to the same limits would have drafted them."""
    hyps = (((), (), 6, 6, 0), ((), (0,), 3, 3, 0))
    whole, steps = _drafter(tiny_bundles[1]), _drafter(tiny_bundles[1])
    for d in (whole, steps):
        _first(d, max_nodes=0, max_depth=0)
    want = whole.draft(_req(1, root_token=PROMPT[-1], position=len(PROMPT) - 1, hypotheses=hyps))
    got = steps.draft(_req(1, root_token=PROMPT[-1], position=len(PROMPT) - 1, hypotheses=hyps, levels=2))
    assert [len(e.tokens) for e in got] == [2, 2] and all(e.growing for e in got)
    while any(e.growing for e in got):
        got = steps.draft(_req(1, root_token=PROMPT[-1], position=len(PROMPT) - 1, extend=True, levels=1))
    for a, b in zip(got, want):
        assert a.assumed == b.assumed and not a.growing and not b.growing
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.parents, b.parents)
        np.testing.assert_array_equal(a.alternatives, b.alternatives)
    assert got[0].draft_s >= 0 and steps.draft(_req(1, root_token=PROMPT[-1], position=0, extend=True, levels=1))[0].tokens.size == 6
    with pytest.raises(ValueError, match="extend"):  # nothing to grow
        _drafter(tiny_bundles[1]).draft(_req(2, root_token=PROMPT[-1], position=0, extend=True, levels=1))


# -- steering: the commit cut and the early exit's predicted outcome ---------------------------------

def _steer(step, path, next_token=-1, **kw) -> DraftSteer:
    return DraftSteer(session_id=1, step=step, epoch=0, path=tuple(path), next_token=next_token, **kw)


def _ahead(d: Drafter, hyps, step=1) -> DraftRequest:
    """Start drafting ahead (one level drawn) beside pass ``step - 1``; the request."""
    req = _req(step, root_token=PROMPT[-1], position=len(PROMPT) - 1, hypotheses=hyps)
    d._begin(req)
    d._grow_levels(1)
    return req


def test_the_commit_cut_stops_the_other_outcomes_and_caps_the_one_that_held(tiny_bundles):
    """At the commit every tree of an outcome that did not happen stops growing, and the held one grows
    only to the waited-for depth; what was drafted is what an uncut drafter drafts, and the rows stay exact."""
    bundle = tiny_bundles[1]
    cut, whole = _drafter(bundle), _drafter(bundle)
    (tree,) = _first(cut)
    _first(whole)
    chain = [int(t) for t in tree.tokens]
    hyps = ((tuple(chain), (), 6, 6, 0), ((), (chain[0],), 6, 6, 0))
    ref_main, ref_second = whole.draft(_req(1, root_token=PROMPT[-1], position=len(PROMPT) - 1, hypotheses=hyps))
    req = _ahead(cut, hyps)
    held = tuple(cut.growing["trees"][0]["assumed"])
    cut.steer(_steer(0, held[:-1], held[-1], final=True, max_depth=3), req)
    cut._grow_levels(0)
    main, second = cut._answer(req)
    assert (len(ref_main.tokens), len(ref_second.tokens)) == (6, 6)
    assert (len(main.tokens), len(second.tokens)) == (3, 1) and not main.growing and not second.growing
    np.testing.assert_array_equal(main.tokens, ref_main.tokens[:3])
    np.testing.assert_array_equal(second.tokens, ref_second.tokens[:1])
    cut.draft(_req(2, root_token=held[-1], position=len(PROMPT) + len(held) - 1, committed=held))
    _check_rows(cut, bundle, PROMPT + list(held))


def _steered(d: Drafter, req: DraftRequest):
    """Run ``req`` as the drafter's run loop does a cross-step request: a level per lane call."""
    from lever_actors.lanes import VirtualLanes

    d.lanes = VirtualLanes(lambda *a: 0.0)
    d.steer_recv = trio.open_memory_channel(1)[1]
    return trio.run(d._draft_steered, req)


def test_a_draft_ahead_draws_no_level_after_its_first_that_would_outlast_its_deadline(tiny_bundles):
    """+level-deadline: the pass is expected to commit at ``deadline_s``; a level that would still run
    then is not started (the first level always is), and the trees drawn are those a drafter without
    a deadline draws, cut short."""
    hyps = (((), (), 6, 6, 0), ((), (0,), 6, 6, 0))
    answers, stops = {}, {}
    for name, deadline in (("none", 0.0), ("far", 1e9), ("past", 1e-9)):
        d = _drafter(tiny_bundles[1])
        _first(d, max_nodes=0, max_depth=0)
        answers[name] = _steered(d, _req(1, root_token=PROMPT[-1], position=len(PROMPT) - 1, hypotheses=hyps,
                                         deadline_s=deadline))
        stops[name] = d.deadline_stops
    assert [len(e.tokens) for e in answers["none"]] == [6, 6] and stops["none"] == 0
    assert [len(e.tokens) for e in answers["far"]] == [6, 6] and stops["far"] == 0
    assert [len(e.tokens) for e in answers["past"]] == [1, 1] and stops["past"] == 1
    for cut, whole in zip(answers["past"], answers["none"]):
        assert cut.assumed == whole.assumed
        np.testing.assert_array_equal(cut.tokens, whole.tokens[:1])


def test_a_level_is_in_time_by_the_pace_of_the_levels_before_it(tiny_bundles):
    d = _drafter(tiny_bundles[1])
    req = _req(1, deadline_s=10.0)
    assert d.level_in_time(req, 9.99)  # no level timed yet
    d.level_s = 0.5
    assert d.level_in_time(req, 9.5) and not d.level_in_time(req, 9.51)
    assert d.level_in_time(_req(1), 1e6)  # no deadline


def test_a_cut_with_no_outcome_held_stops_every_tree(tiny_bundles):
    d = _drafter(tiny_bundles[1])
    (tree,) = _first(d)
    chain = [int(t) for t in tree.tokens]
    req = _ahead(d, ((tuple(chain), (), 6, 6, 0), ((), (chain[0],), 6, 6, 0)))
    d.steer(_steer(0, (), (chain[0] + 1) % 50 if (chain[0] + 1) % 50 != d.growing["trees"][1]["assumed"][0]
                   else (chain[0] + 2) % 50, final=True, max_depth=6), req)
    assert not any(t["active"] for t in d.growing["trees"])
    assert [len(e.tokens) for e in d._answer(req)] == [1, 1]


@pytest.mark.parametrize("held", [False, True])
def test_a_commit_no_tree_assumed_stops_the_level_drafting_between_two_layers(tiny_bundles, held):
    """A level drafts in a thread; the commit of the pass beside it arrives while the level is at
    its first layer. When no tree assumed that outcome, the level stops before its next layer
    (every tree stops, the answers are the trees before it) and the rows it half wrote are never
    trusted: committing through the nodes it was feeding leaves the exact cache. When a tree
    held, the level runs to its end."""
    import threading

    from lever_actors.lanes import ThreadLanes

    bundle = tiny_bundles[1]
    d = _drafter(bundle)
    (tree,) = _first(d)
    chain = [int(t) for t in tree.tokens]
    hyps = ((tuple(chain), (), 6, 6, 0), ((), (chain[0],), 6, 6, 0))
    req = _req(1, root_token=PROMPT[-1], position=len(PROMPT) - 1, hypotheses=hyps)
    layers, at_layer, run_layer = [], threading.Event(), d.m.run_layer
    gate = {"level": 0}

    def gated(i, *a):
        if gate["level"] == 2:  # the second level (the first after the one answered in full)
            layers.append(i)
            if i == 0:
                at_layer.set()
                deadline = time.monotonic() + 30
                while not d.steers and time.monotonic() < deadline:  # the commit arrives now, mid-level
                    time.sleep(0.001)  # (the drafter decides on a cut before it keeps the steer)
        return run_layer(i, *a)

    grow = d._grow_levels

    def counted(levels, t0=None):
        gate["level"] += 1
        return grow(levels, t0)

    d.m.run_layer, d._grow_levels = gated, counted

    async def main():
        send, d.steer_recv = trio.open_memory_channel(4)
        d.lanes = ThreadLanes()
        async with trio.open_nursery() as nursery:
            async def commit():
                assert await trio.to_thread.run_sync(at_layer.wait, 30), "the second level never started"
                assumed = [tuple(t["assumed"]) for t in d.growing["trees"]]
                if held:  # the main path accepted whole, then the draft's own next token
                    send.send_nowait(_steer(0, assumed[0][:-1], assumed[0][-1], final=True, max_depth=2))
                else:  # the first drafted token rejected, and the target's token not the draft's runner-up
                    other = next(t for t in range(50) if (t,) not in assumed)
                    send.send_nowait(_steer(0, (), other, final=True, max_depth=6))
            nursery.start_soon(commit)
            return await d._draft_steered(req)

    main_tree, second = trio.run(main)
    n_layer = d.m.n_layer
    if held:
        assert layers == list(range(n_layer)) and d.levels_cut == 0
        assert [len(e.tokens) for e in (main_tree, second)] == [2, 2]  # both trees' level, in one call
        return
    assert layers == [0] and d.levels_cut == 1  # stopped before its second layer
    assert [len(e.tokens) for e in (main_tree, second)] == [1, 1] and not main_tree.growing
    # commit the main outcome and its first drafted node, one of the nodes the cut level was feeding
    assumed = tuple(d.growing["trees"][0]["assumed"])
    committed = assumed + (int(main_tree.tokens[0]),)
    d.m.run_layer, d._grow_levels = run_layer, grow
    d.draft(_req(2, root_token=committed[-1], position=len(PROMPT) + len(committed) - 1, committed=committed,
                 max_nodes=0, max_depth=0))
    _check_rows(d, bundle, PROMPT + list(committed))


def test_a_fault_in_a_level_read_for_steers_fails_the_request_not_the_drafter(tiny_bundles):
    """A level that reads the steers as it drafts runs beside a task of its own; a FlashFault raised in
    it (a draft row changed under the process) still reaches the drafter's loop as itself: every tree
    of the request is answered with it, and the drafter answers the next request."""
    from lever_actors.errors import FlashFault
    from lever_actors.lanes import ThreadLanes

    d = _drafter(tiny_bundles[1])
    grow = d._grow_levels

    def faulty(levels, t0=None):
        raise FlashFault("draft embedding row 7 changed", retryable=False)

    async def main():
        req_send, d.requests_recv = trio.open_memory_channel(4)
        d.out_send, out_recv = trio.open_memory_channel(8)
        _, d.steer_recv = trio.open_memory_channel(4)
        d.lanes = ThreadLanes()
        async with trio.open_nursery() as nursery:
            await nursery.start(d.run)
            await req_send.send(_req(0, root_token=PROMPT[-1], position=len(PROMPT) - 1, committed=tuple(PROMPT),
                                     reset=True, max_nodes=0, max_depth=0))
            assert not (await out_recv.receive()).fault
            d._grow_levels = faulty
            await req_send.send(_req(1, root_token=PROMPT[-1], position=len(PROMPT) - 1,
                                     hypotheses=(((), (), 4, 4, 0), ((), (0,), 4, 4, 0))))
            faults = [await out_recv.receive() for _ in range(2)]
            d._grow_levels = grow
            await req_send.send(_req(2, root_token=PROMPT[-1], position=len(PROMPT) - 1, committed=tuple(PROMPT),
                                     reset=True))
            after = await out_recv.receive()
            nursery.cancel_scope.cancel()
        return faults, after

    faults, after = trio.run(main)
    assert [(e.hypothesis, e.of) for e in faults] == [(0, 2), (1, 2)]
    assert all("row 7 changed" in e.fault and not e.fault_retryable for e in faults)
    assert not after.fault and len(after.tokens) == 4


def test_a_predicted_outcome_no_hypothesis_assumed_gets_a_tree_of_its_own(tiny_bundles):
    """The exit layer predicts an outcome no hypothesis assumed: the drafter plants a tree for it in
    the same draft calls; that tree is what a drafter that had committed the outcome drafts, and when
    it holds the committed rows are exact."""
    bundle = tiny_bundles[1]
    d = _drafter(bundle)
    (tree,) = _first(d)
    chain = [int(t) for t in tree.tokens]
    req = _ahead(d, ((tuple(chain), (), 4, 4, 0),))
    other = next(t for t in range(50) if t != chain[1])
    outcome = (chain[0], other)
    d.steer(_steer(0, outcome[:1], other), req)
    d.steer(_steer(0, outcome[:1], other), req)  # said twice: still one tree
    d._grow_levels(0)
    main, planted = d._answer(req)
    assert (main.of, planted.of, planted.hypothesis) == (2, 2, 1)
    assert planted.assumed == outcome and planted.position == len(PROMPT) - 1 + len(outcome)
    assert d.steer_counts["planted"] == 1 and len(main.tokens) == 4
    plain = _drafter(bundle)
    plain.draft(_req(0, root_token=other, position=len(PROMPT) + 1, committed=tuple(PROMPT) + outcome, reset=True,
                     max_nodes=0, max_depth=0))
    (want,) = plain.draft(_req(1, root_token=other, position=len(PROMPT) + 1))
    np.testing.assert_array_equal(planted.tokens, want.tokens)
    np.testing.assert_array_equal(planted.parents, want.parents)
    (after,) = d.draft(_req(2, root_token=other, position=len(PROMPT) + 1, committed=outcome))
    _check_rows(d, bundle, PROMPT + list(outcome))
    np.testing.assert_array_equal(after.tokens, want.tokens)


def test_a_prediction_a_hypothesis_assumed_plants_nothing(tiny_bundles):
    d = _drafter(tiny_bundles[1])
    (tree,) = _first(d)
    chain = [int(t) for t in tree.tokens]
    req = _ahead(d, ((tuple(chain), (), 4, 4, 0),))
    held = tuple(d.growing["trees"][0]["assumed"])
    d.steer(_steer(0, held[:-1], held[-1]), req)
    d.steer(_steer(0, held[:-1]), req)  # the next token not predicted: the draft's own guess stands
    d.steer(_steer(0, (chain[0],)), req)  # ... and a path no tree assumes, with no token: nothing to plant
    assert len(d.growing["trees"]) == 1 and d.steer_counts == {"applied": 3, "checked": 0, "right": 0, "planted": 0}


def test_a_planted_tree_never_takes_the_slots_the_hypotheses_still_need(tiny_bundles):
    """Near the end of the context a predicted outcome gets a tree only from slots no growing tree
    may still take (else a hypothesis would run out of KV slots mid-draft and stop the drafter)."""
    d = _drafter(tiny_bundles[1])
    long = (PROMPT * 40)[:CONTEXT - 12]
    d.draft(_req(0, root_token=long[-1], position=len(long) - 1, committed=tuple(long), reset=True, max_nodes=0,
                 max_depth=0))
    req = _req(1, root_token=long[-1], position=len(long) - 1, hypotheses=(((), (), 6, 6, 0),))
    d._begin(req)
    d._grow_levels(1)
    assumed = d.growing["trees"][0]["assumed"]
    d.steer(_steer(0, (), (assumed[0] + 1) % 50), req)  # no room beside the hypothesis's 5 more nodes
    d.steer(_steer(0, (1, 2, 3), 4), req)
    d._grow_levels(0)
    out = d._answer(req)
    assert d._free_slots() >= 0
    assert len(out[0].tokens) == 6 and all(len(e.tokens) <= 6 for e in out)
    assert sum(len(e.tokens) + len(e.assumed) for e in out) + d.m.kv.length <= CONTEXT


def test_steers_of_earlier_passes_are_dropped_later_ones_kept_and_predictions_scored(tiny_bundles):
    send, recv = trio.open_memory_channel(8)
    d = Drafter(Transformer(load_bundle(tiny_bundles[1]), CONTEXT, LaneConfig()), None, None, None,
                Tracer(enabled=False), steer_recv=recv)
    (tree,) = _first(d)
    chain = [int(t) for t in tree.tokens]
    req = _ahead(d, ((tuple(chain), (), 4, 4, 0),), step=3)  # drafted beside pass 2
    held = tuple(d.growing["trees"][0]["assumed"])
    send.send_nowait(_steer(1, (), 7, final=True))  # an earlier pass: dropped
    send.send_nowait(DraftSteer(session_id=0, step=2, epoch=0, path=(), next_token=7, final=True))  # earlier session
    send.send_nowait(_steer(2, held[:-1], held[-1]))  # this pass's prediction: right
    send.send_nowait(_steer(5, (), 9))  # a later pass: kept for its request
    d._take_steers(req)
    assert d.growing["trees"][0]["active"] and [s.step for s in d.steers] == [5]
    send.send_nowait(_steer(2, held[:-1], held[-1], final=True, max_depth=1))
    d._take_steers(req)
    assert not d.growing["trees"][0]["active"]  # it held, and is as deep as a waited-for draft may be
    assert d.steer_counts == {"applied": 1, "checked": 1, "right": 1, "planted": 0}


def test_a_final_steer_must_name_the_committed_token():
    with pytest.raises(ValueError, match="final"):
        _steer(0, (1, 2), final=True)
    with pytest.raises(ValueError, match="min_path_p"):
        _steer(0, (1,), 3, final=True, min_path_p=float("nan"))

"""Gain/cost planning: valid trees, caps held, the objective never falls as nodes are added."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lever_actors.planner import AcceptanceCalibration, CostModel, LeverPolicy, overlap, path_probabilities, plan_tree


@st.composite
def candidate_trees(draw):
    n = draw(st.integers(1, 40))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    cond = [1.0] + [draw(st.floats(0.0, 1.0)) for _ in range(1, n)]
    return np.array(parents), np.array(cond)


@given(candidate_trees(), st.floats(0.01, 2.0), st.floats(0.0, 0.2), st.integers(1, 40), st.integers(0, 12))
def test_plan_is_a_valid_capped_subtree_whose_ratio_only_rises(tree, fixed, per_node, max_nodes, max_depth):
    parents, cond = tree
    p = path_probabilities(parents, cond)
    cost = lambda n: fixed + per_node * n  # noqa: E731
    keep = plan_tree(parents, p, cost, max_nodes, max_depth)
    assert keep[0] == 0 and keep == sorted(set(keep))
    assert len(keep) <= max(max_nodes, 1)
    kept = set(keep)
    depth = np.zeros(len(parents), int)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    for i in keep[1:]:
        assert parents[i] in kept and depth[i] <= max_depth  # ancestor-closed, depth-capped
    # replaying the greedy order, G/C never falls
    order = [0]
    ratio = 1 / cost(1)
    rest = [i for i in keep[1:]]
    gain = 1.0
    while rest:
        ok = [i for i in rest if parents[i] in order]
        best = max(ok, key=lambda i: (p[i], -i))
        gain += p[best]
        order.append(best)
        rest.remove(best)
        new = gain / cost(len(order))
        assert new >= ratio - 1e-12
        ratio = new


def test_free_verification_takes_every_useful_node_and_costly_takes_few():
    parents = np.array([-1, 0, 1, 2, 3, 0, 5])
    p = path_probabilities(parents, np.array([1, 0.9, 0.9, 0.9, 0.9, 0.05, 0.5]))
    assert len(plan_tree(parents, p, lambda n: 1.0 + 0.001 * n, 10, 10)) == 7
    assert plan_tree(parents, p, lambda n: 0.01 + 1.0 * n, 10, 10) == [0]


def test_calibration_learns_from_observations():
    cal = AcceptanceCalibration()
    before = cal.conditional([1], [0.6])[0]
    cal.observe([1] * 50, [0.6] * 50, [True] * 50)
    assert cal.conditional([1], [0.6])[0] > max(before, 0.95)
    cal.observe([2] * 50, [0.6] * 50, [False] * 50)
    assert cal.conditional([2], [0.6])[0] < 0.05


def test_cost_model_learns_the_compute_line_and_the_io_floor():
    cm = CostModel(alpha=0.2)
    for _ in range(3):
        for n in (4, 8, 16, 32):  # compute 0.1 + 0.01 n, flash floor 0.3 s, no drafting waited for
            cm.observe(n_nodes=n, pass_s=max(0.3, 0.1 + 0.01 * n), compute_s=0.1 + 0.01 * n, draft_s=0.0)
    c0, c1 = cm.compute_line()
    assert abs(c1 - 0.01) < 1e-9 and abs(c0 - 0.1) < 1e-9
    assert 0.3 <= cm.cost(4) <= cm.floor_s + 1e-12  # below the floor, nodes are free
    assert cm.cost(64) > cm.cost(32) > cm.cost(16)  # above it, every node costs compute


def test_cost_model_charges_waited_drafting():
    cm = CostModel(alpha=1.0)
    cm.observe(n_nodes=10, pass_s=1.5, compute_s=0.2, draft_s=0.3)
    assert abs(cm.draft_per_node_s - 0.03) < 1e-12
    assert abs(cm.floor_s - 1.2) < 1e-12
    assert cm.cost(20) > cm.cost(10) > cm.cost(1)


def test_bucket_helpers_and_the_cost_of_static_shapes():
    from lever_actors.planner import CostModel, bucket_for, parse_buckets

    assert parse_buckets("1,2,4,8") == (1, 2, 4, 8) and parse_buckets("off") == () and parse_buckets(None) == ()
    for bad in ("4,2", "0,1", "a,b", "1,1"):
        with pytest.raises(ValueError):
            parse_buckets(bad)
    assert [bucket_for(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert bucket_for(7, ()) == 7
    with pytest.raises(ValueError, match="largest token bucket"):
        bucket_for(9, (1, 2, 4, 8))
    buckets = (1, 2, 4, 8, 16)
    cm = CostModel(buckets=buckets)
    for n in (1, 3, 5, 9, 2, 7) * 4:  # compute = 0.01 per row of the bucket, whatever the node count
        rows = bucket_for(n, buckets)
        cm.observe(n, pass_s=0.01 * rows, compute_s=0.01 * rows, draft_s=0.0)
    c0, c1 = cm.compute_line()
    assert c0 == pytest.approx(0, abs=1e-9) and c1 == pytest.approx(0.01)  # fitted on bucket rows
    assert cm.cost(5) == pytest.approx(cm.cost(8)) and cm.cost(9) > cm.cost(8)  # flat inside a bucket


def test_draft_pace_drafts_what_fits_behind_the_pass_and_stops_serial_drafts_when_they_stop_paying():
    from lever_actors.planner import DraftPace

    pace = DraftPace(alpha=1.0)
    assert pace.limits(hidden=True, max_depth=16, node_s=0.01) == (16, 0.0)  # nothing measured yet
    pace.observe_draft(draft_s=0.25, calls=10)  # 25 ms a level
    pace.observe_pass(committed=6, pass_s=0.40, waited_s=0.0)  # 15 tok/s, 0.4 s to hide drafting behind
    depth, p_hidden = pace.limits(hidden=True, max_depth=16, node_s=0.01)
    assert depth == int(0.40 / 0.025) - 2 and p_hidden == pytest.approx(15 * 0.01)
    assert pace.limits(hidden=True, max_depth=8, node_s=0.01)[0] == 8  # never past the mode's own cap
    _, p_serial = pace.limits(hidden=False, max_depth=16, node_s=0.01)
    assert p_serial == pytest.approx(15 * (0.025 + 0.01)) and p_serial > p_hidden  # waited-for levels cost more
    pace.observe_pass(committed=2, pass_s=0.40, waited_s=0.1)  # acceptance fell: 5 tok/s
    assert pace.limits(hidden=False, max_depth=16, node_s=0.01)[1] < p_serial  # a slower rate: a level pays sooner
    pace.observe_draft(draft_s=1.0, calls=2)  # a slow drafter: hidden drafts get shallow
    assert pace.limits(hidden=True, max_depth=16, node_s=0.01)[0] == 1


def test_hidden_drafts_are_capped_once_their_own_level_time_is_known():
    """Every pass may find its tree drafted ahead, so no draft is ever waited for: the cap of a hidden
    draft must not wait for a waited-for level time (it once did, and drafted 16 levels behind every pass)."""
    from lever_actors.planner import DraftPace

    pace = DraftPace(alpha=1.0)
    pace.observe_draft(draft_s=0.6, calls=10, hidden=True)  # 60 ms a level, three hypotheses' rows
    pace.observe_pass(committed=6, pass_s=0.6, waited_s=0.0)
    assert pace.level_s is None and not pace.ready
    assert pace.limits(hidden=True, max_depth=16, node_s=0.01)[0] == int(0.6 / 0.06) - 2
    # a waited-for draft before any was waited for: the hidden level time stands in (it once drafted
    # 16 levels, about a second, on a fresh process's first miss)
    assert pace.limits(hidden=False, max_depth=16, node_s=0.01) == (16, pytest.approx(10 * (0.06 + 0.01)))


def test_a_fresh_process_plans_its_first_pass_from_the_prefill():
    """Seeded by the prefill (its reads one pass's floor, its compute one point of the line), the
    policy plans and caps the first drafts instead of verifying and drafting everything; the decode
    passes then replace the seed."""
    from lever_actors.planner import LeverPolicy

    pol = LeverPolicy()
    assert not pol.costs.ready and pol.draft_limits(hidden=True, max_depth=16) == (16, 0.0)
    pol.seed(n_rows=100, io_s=0.5, compute_s=3.0)  # 30 ms a row, 0.5 s of reads
    assert pol.costs.ready and pol.costs.floor_s == 0.5 and pol.pace.verify_s == 0.5
    c0, c1 = pol.costs.compute_line()
    assert c0 == pytest.approx(0.0) and c1 == pytest.approx(0.03)
    assert pol.costs.cost(4) == pytest.approx(overlap(0.5, 0.12)) and pol.costs.cost(30) == pytest.approx(overlap(0.5, 0.9))
    assert 0.5 < pol.costs.cost(4) < 0.501 and 0.9 < pol.costs.cost(30) < 0.93
    parents = np.arange(-1, 32)  # a 32-deep chain, every node a sure thing: a floor-sized plan, not all 32
    keep = pol.select(parents, np.ones(33), max_nodes=32)
    assert 16 <= len(keep) - 1 < 32
    pol.pace.observe_draft(draft_s=0.6, calls=10, hidden=True)  # the prefill's own draft: 60 ms a level
    assert pol.draft_limits(hidden=True, max_depth=16) == (int(0.5 / 0.06) - 2, 0.0)
    pol.seed(n_rows=10, io_s=9.0, compute_s=9.0)  # once seeded (or measured), a seed changes nothing
    assert pol.costs.floor_s == 0.5
    for _ in range(20):
        pol.costs.observe(n_nodes=8, pass_s=0.7, compute_s=0.4, draft_s=0.0, reads_s=0.6)
    assert pol.costs.floor_s == pytest.approx(0.6, abs=0.01)
    assert pol.costs.rest_s == pytest.approx(0.7 - overlap(0.6, 0.4), abs=0.01)


def test_reads_and_compute_overlap_imperfectly_so_no_node_is_free():
    """With the reads measured, a node costs a part of its compute however far below the reads the
    pass's compute stays (a max() made every node free there, and lever's trees grew until each
    pass ran 15% over its reads); far below, nearly nothing; above, nearly all of it."""
    assert overlap(0.5, 0.0) == 0.5 and overlap(0.0, 0.3) == 0.3
    assert overlap(0.486, 0.445) == pytest.approx(0.555, abs=0.002)  # a measured pass took 0.56 s
    assert overlap(1.0, 1.0) == pytest.approx(2 ** 0.25)
    cm = CostModel(alpha=0.5)
    for _ in range(30):
        for n in (4, 8, 16):  # compute 0.1 + 0.02 n against 0.5 s of reads; 20 ms of bookkeeping
            c = 0.1 + 0.02 * n
            cm.observe(n_nodes=n, pass_s=overlap(0.5, c) + 0.02, compute_s=c, draft_s=0.0, reads_s=0.5)
    assert cm.floor_s == pytest.approx(0.5) and cm.rest_s == pytest.approx(0.02)
    step = [cm.cost(n + 1) - cm.cost(n) for n in (1, 10, 40)]
    assert 0 < step[0] < 0.001 < step[1] < 0.02 and step[2] == pytest.approx(0.02, rel=0.1)
    # a chain whose nodes are accepted 85% of the time given their parent: the plan is shorter than
    # the one that takes nodes as free below a floor of the whole pass
    free = CostModel(alpha=0.5)
    for _ in range(30):
        for n in (4, 8, 16):
            c = 0.1 + 0.02 * n
            free.observe(n_nodes=n, pass_s=overlap(0.5, c) + 0.02, compute_s=c, draft_s=0.0)
    chain, path_p = np.arange(-1, 32), 0.85 ** np.arange(33)
    ours, old = (len(plan_tree(chain, path_p, m.cost, 33, 32)) - 1 for m in (cm, free))
    assert 4 <= ours < old


def test_a_waited_for_draft_goes_no_deeper_than_the_calibrated_acceptance_pays():
    """A draft the pass waits for stops where even a sure-looking path (draft probability 0.9) is
    no longer accepted often enough to pay for a level; where the target accepts such paths, the
    pace's own cap stands."""
    from lever_actors.planner import LeverPolicy

    def policy(accept: float) -> LeverPolicy:
        pol = LeverPolicy()
        pol.pace.observe_draft(draft_s=0.04, calls=1)  # 40 ms a level
        pol.pace.observe_pass(committed=5, pass_s=0.5, waited_s=0.0)  # 10 tok/s
        for d in range(1, 17):  # many observations: the prior no longer matters
            pol.calibration.observe([d] * 200, [0.9] * 200, np.arange(200) < 200 * accept)
        return pol

    depth, min_p = policy(0.7).draft_limits(hidden=False, max_depth=16)
    assert min_p == pytest.approx(10 * 0.04) and depth == int(np.log(min_p) / np.log(0.7))  # 0.7^2 >= 0.4 > 0.7^3
    assert policy(0.99).draft_limits(hidden=False, max_depth=16)[0] == 16
    assert policy(0.3).draft_limits(hidden=False, max_depth=16)[0] == 1  # at least one level
    assert policy(0.3).draft_limits(hidden=True, max_depth=16)[0] > 1  # hidden drafts cost no wait


def test_marginal_depth_prices_a_node_at_what_it_adds_to_a_pass_bound_by_its_reads():
    """+marginal-depth: the drafter's least path probability is the current rate times what one more
    node adds to the pass (a small part of its compute far below the reads, nearly all of it above
    them), not its whole compute; by default the whole compute stays the price."""
    from lever_actors.planner import LeverPolicy

    def policy(reads_s: float, marginal: bool) -> LeverPolicy:
        pol = LeverPolicy(marginal_depth=marginal)
        for _ in range(30):
            for n in (4, 8, 16):  # compute 0.1 + 0.02 n
                c = 0.1 + 0.02 * n
                pol.costs.observe(n_nodes=n, pass_s=overlap(reads_s, c), compute_s=c, draft_s=0.0, reads_s=reads_s)
        pol.pace.observe_draft(draft_s=0.02, calls=1, hidden=True)
        pol.pace.observe_pass(committed=8, pass_s=0.5, waited_s=0.0)  # 16 tok/s
        pol.last_size = 8
        return pol

    whole = policy(0.5, False).draft_limits(hidden=True, max_depth=16)[1]
    assert whole == pytest.approx(16 * 0.02, rel=0.05)
    far_below = policy(1.0, True)
    step = far_below.costs.marginal_node_s(8)
    assert 0 < step < 0.02 / 10 and far_below.draft_limits(hidden=True, max_depth=16)[1] == pytest.approx(16 * step)
    above = policy(0.1, True)  # compute 0.26 s against 0.1 s of reads: a node costs nearly its compute
    assert above.costs.marginal_node_s(8) == pytest.approx(0.02, rel=0.1)


def test_calibrated_ahead_cuts_a_hidden_draft_where_the_calibrated_acceptance_stops_paying():
    """Drafts ahead hold the drafting core (which the pass borrows once they are done) and a level
    still running at the commit delays the next pass: they stop where even a sure-looking path is
    no longer accepted often enough to be worth verifying; where the target accepts such paths, the
    pace's own cap (what fits inside the pass) stands. +no-calibrated-ahead keeps only that cap."""
    from lever_actors.planner import LeverPolicy

    def policy(accept: float, calibrated: bool) -> LeverPolicy:
        pol = LeverPolicy(calibrated_ahead=calibrated)
        pol.pace.observe_draft(draft_s=0.04, calls=1, hidden=True)  # 40 ms a level drafted ahead
        pol.pace.observe_pass(committed=5, pass_s=0.5, waited_s=0.0)  # 10 tok/s, 0.5 s to hide drafts in
        pol.costs.seed(n_rows=8, io_s=0.5, compute_s=0.26)  # 32.5 ms of compute a node
        for d in range(1, 17):
            pol.calibration.observe([d] * 200, [0.9] * 200, np.arange(200) < 200 * accept)
        return pol

    cap = int(0.5 / 0.04) - 2  # the levels that fit inside the pass
    depth, min_p = policy(0.7, True).draft_limits(hidden=True, max_depth=16)
    assert min_p == pytest.approx(10 * 0.26 / 8)
    assert depth == int(np.log(min_p) / np.log(0.7)) < cap  # 0.7^3 >= 0.325 > 0.7^4
    assert policy(0.7, False).draft_limits(hidden=True, max_depth=16)[0] == cap
    assert policy(0.99, True).draft_limits(hidden=True, max_depth=16)[0] == cap


def test_each_sampler_keeps_its_own_acceptance_records():
    """A daemon serving greedy and coupled-sampled requests plans each with its own records: what
    coupled passes observed never moves the greedy calibration, and switching back restores it."""
    policy = LeverPolicy()
    depth, prob = np.array([1, 1, 2]), np.array([0.9, 0.9, 0.5])
    for _ in range(50):
        policy.calibration.observe(depth, prob, [1, 1, 1])
    greedy = policy.conditional(depth, prob, None)
    policy.use_sampler("coupled")
    fresh = policy.conditional(depth, prob, None)
    np.testing.assert_allclose(fresh, prob)  # a sampler met first: the prior alone (the draft's probability)
    for _ in range(50):
        policy.calibration.observe(depth, prob, [0, 0, 0])
        policy.ngram_calibration.observe(depth, prob, [0, 0, 0])
    coupled = policy.conditional(depth, prob, None)
    assert np.all(coupled < 0.1) and np.all(greedy > 0.9)
    policy.use_sampler("greedy")
    np.testing.assert_array_equal(policy.conditional(depth, prob, None), greedy)
    assert policy.ngram_calibration.seen.sum() == 0
    policy.use_sampler("coupled")
    np.testing.assert_array_equal(policy.conditional(depth, prob, None), coupled)

"""lever's choice between drafting beside its passes (overlap) and taking turns: pure logic."""
import pytest
from hypothesis import given, settings, strategies as st

from lever_actors.planner import LeverPolicy
from lever_actors.schedule import OVERLAP, SCHEDULES, TURNS, ScheduleChoice


def run_blocks(choice: ScheduleChoice, reads_s: float, compute_s: float, blocks: int, tokens=4) -> list[str]:
    """Run ``blocks`` whole blocks whose overlap passes read for ``reads_s`` and compute for ``compute_s``
    (turns passes compute faster); the schedule of each block, in order."""
    order = []
    for _ in range(blocks):
        s = choice.current
        order.append(s)
        for _ in range(choice.block):
            compute = compute_s if s == OVERLAP else compute_s / 2
            choice.observe(tokens, max(reads_s, compute), reads_s, compute)
    return order


def test_compute_bound_passes_take_turns_and_overlap_is_measured_again():
    choice = ScheduleChoice(block=3, warmup=2, explore_every=6)
    order = run_blocks(choice, reads_s=0.23, compute_s=0.33, blocks=16)
    assert order[:2] == [OVERLAP, OVERLAP]
    assert order[2:] == [TURNS] * 5 + [OVERLAP] + [TURNS] * 5 + [OVERLAP] + [TURNS] * 2
    assert choice.compute_bound() and choice.rate(TURNS) == pytest.approx(4 / 0.23)


def test_read_bound_passes_always_draft_beside_the_pass():
    choice = ScheduleChoice()
    assert run_blocks(choice, reads_s=0.61, compute_s=0.39, blocks=24) == [OVERLAP] * 24
    assert choice.compute_bound() is False and choice.blocks[TURNS] == 0


def test_a_requests_first_large_trees_do_not_make_a_read_bound_host_take_turns():
    """A measured trace (HumanEval 0, 768 MiB, a disk reading ~4 GB/s): the first two passes verify the
    tree drafted beside the prefill and compute longer than they read; every pass after reads longer.
    A moving average seeded by the first pass chose turns after the warm-up (0.27 s against 0.23)."""
    choice = ScheduleChoice()
    trace = [(0.243, 0.501), (0.236, 0.314), (0.237, 0.201), (0.207, 0.079), (0.217, 0.147), (0.217, 0.150)]
    for reads, compute in trace:
        choice.observe(4, max(reads, compute), reads, compute)
    assert choice.compute_bound() is False and choice.current == OVERLAP
    assert choice.compute_s < choice.reads_s
    # the next request starts the same way: two long passes among the last six do not turn it either
    for reads, compute in [(0.242, 0.256), (0.201, 0.220), (0.196, 0.101)]:
        choice.observe(4, max(reads, compute), reads, compute)
    assert choice.current == OVERLAP


def run_rates(choice: ScheduleChoice, blocks: int, overlap_tokens: int, turns_tokens: int) -> list[str]:
    """Blocks of compute-bound passes (0.26 s of compute against 0.22 s of reads beside the draft)
    where a turns pass is shorter (0.26 s) but commits ``turns_tokens`` (its tree drafted after it)."""
    order = []
    for _ in range(blocks):
        s = choice.current
        order.append(s)
        for _ in range(choice.block):
            tokens, seconds, compute = (overlap_tokens, 0.28, 0.26) if s == OVERLAP else (turns_tokens, 0.26, 0.15)
            choice.observe(tokens, seconds, 0.22, compute)
    return order


def test_turns_that_commit_fewer_tokens_a_second_is_not_taken_again_until_forgotten():
    """Measured (HumanEval 10:40, 768 MiB, a disk reading ~3.4 GB/s): lever took turns on the prompts
    whose overlap passes computed about as long as they read, in runs of whole prompts, while its turns
    blocks committed 20.8-24.4 tokens a second against its overlap blocks' 33.9-34.7 (their shallower
    trees are drafted after the pass)."""
    choice = ScheduleChoice(forget=12)
    assert run_rates(choice, blocks=4, overlap_tokens=7, turns_tokens=4) == [OVERLAP, OVERLAP, TURNS, OVERLAP]
    assert choice.describe()["turns_vetoed"] and choice.compute_bound()  # the stats say why it runs overlap
    choice = ScheduleChoice(forget=12)
    order = run_rates(choice, blocks=40, overlap_tokens=7, turns_tokens=4)
    at = [i for i, x in enumerate(order) if x == TURNS]
    assert at and order[at[0] + 1] == OVERLAP  # one turns block, then back
    assert all(j - i >= choice.forget for i, j in zip(at, at[1:]))  # each later try only once forgotten
    assert len(at) >= 2  # ... and tried again: the host may have changed
    # without the veto the same passes take turns in every block but the explore ones
    plain = run_rates(ScheduleChoice(forget=12, veto=False), blocks=40, overlap_tokens=7, turns_tokens=4)
    assert plain.count(TURNS) > 3 * len(at)


def test_turns_that_commits_more_tokens_a_second_keeps_its_turns():
    choice = ScheduleChoice()
    order = run_rates(choice, blocks=20, overlap_tokens=5, turns_tokens=7)
    assert order[2:] == ([TURNS] * 7 + [OVERLAP]) * 2 + [TURNS, TURNS] and not choice.turns_lost()


def test_nothing_streamed_is_compute_bound():
    choice = ScheduleChoice(block=1, warmup=1)
    choice.observe(3, 0.2, None, 0.2)
    assert choice.compute_bound() and choice.current == TURNS


def test_the_choice_follows_when_the_host_changes():
    choice = ScheduleChoice()
    run_blocks(choice, reads_s=0.23, compute_s=0.33, blocks=12)
    later = run_blocks(choice, reads_s=0.50, compute_s=0.33, blocks=16)
    first = later.index(OVERLAP)  # the next overlap block measures the new reads
    assert first < choice.explore_every and later[first + 2:] == [OVERLAP] * (len(later) - first - 2)


def test_a_block_closes_after_its_passes_only():
    choice = ScheduleChoice(block=3, warmup=1)
    choice.observe(2, 0.5, 0.2, 0.3)
    choice.observe(2, 0.5, 0.2, 0.3)
    assert choice.blocks == {OVERLAP: 0, TURNS: 0} and choice.current == OVERLAP
    choice.observe(2, 0.5, 0.2, 0.3)
    assert choice.blocks[OVERLAP] == 1 and choice.rate(OVERLAP) == pytest.approx(4.0) and choice.current == TURNS


def test_bad_settings_and_observations_are_refused():
    for bad in ({"block": 0}, {"decay": 1.0}, {"window": 0}, {"forget": 0}, {"current": "sideways"}):
        with pytest.raises(ValueError):
            ScheduleChoice(**bad)
    with pytest.raises(ValueError):
        ScheduleChoice().observe(3, -1.0, 0.1, 0.1)
    with pytest.raises(ValueError):
        ScheduleChoice().observe(3, 1.0, -0.1, 0.1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.floats(0.0, 5.0), st.one_of(st.none(), st.floats(0.0, 2.0)),
                          st.floats(0.0, 2.0)), min_size=1, max_size=200),
       st.integers(1, 5), st.integers(1, 3), st.integers(2, 8))
def test_overlap_is_never_left_unmeasured_whatever_the_timings(passes, block, warmup, explore_every):
    """Invariants: the first blocks run overlap; any explore_every blocks in a row hold an overlap
    block (its reads and compute are what the choice rests on); turns runs only while the last
    measure says compute bound and no recent turns block ran slower than overlap's."""
    choice = ScheduleChoice(block=block, warmup=warmup, explore_every=explore_every)
    order = [choice.current]
    for tokens, seconds, reads, compute in passes:
        choice.observe(tokens, seconds, reads, compute)
        assert choice.current in SCHEDULES
        if choice._passes == 0:  # a block closed: the next block's schedule
            order.append(choice.current)
            assert choice.current == OVERLAP or (choice.compute_bound() and not choice.turns_lost())
    assert order[:warmup] == [OVERLAP] * len(order[:warmup])
    for i in range(len(order) - explore_every + 1):
        assert OVERLAP in order[i:i + explore_every]


def test_each_schedule_plans_with_its_own_costs():
    policy = LeverPolicy()
    policy.costs.observe(4, 0.5, 0.3, 0.0, reads_s=0.2)
    overlap_costs = policy.costs
    policy.use_schedule(TURNS)  # met for the first time: a copy of the current costs, not a blank model
    assert policy.costs is not overlap_costs and policy.costs.ready
    assert policy.costs.pass_s(4) == pytest.approx(overlap_costs.pass_s(4))
    for _ in range(8):
        policy.costs.observe(4, 0.3, 0.15, 0.0, reads_s=0.2)
    turns_pass = policy.costs.pass_s(4)
    policy.use_schedule(OVERLAP)
    assert policy.costs is overlap_costs and policy.costs.pass_s(4) > turns_pass
    policy.use_schedule(TURNS)
    assert policy.costs.pass_s(4) == pytest.approx(turns_pass)

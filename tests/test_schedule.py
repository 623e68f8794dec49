"""lever's choice between drafting beside its passes (overlap) and taking turns: pure logic."""
import pytest
from hypothesis import given, settings, strategies as st

from lever_actors.planner import LeverPolicy
from lever_actors.schedule import OVERLAP, SCHEDULES, TURNS, ScheduleChoice


def run_blocks(choice: ScheduleChoice, pass_s: dict, blocks: int, tokens=lambda s, i: 4) -> list[str]:
    """Run ``blocks`` whole blocks, a schedule's passes cycling in ``pass_s[schedule]`` seconds; the
    schedule of each block, in order."""
    order = []
    for b in range(blocks):
        s = choice.current
        order.append(s)
        for i in range(choice.block):
            choice.observe(tokens(s, b * choice.block + i), pass_s[s])
    return order


def test_warmup_alternates_then_the_cheaper_runs_and_the_other_is_measured_again():
    choice = ScheduleChoice(block=3, warmup=2, explore_every=6)
    order = run_blocks(choice, {OVERLAP: 0.40, TURNS: 0.36}, 16)
    assert order[:4] == [OVERLAP, TURNS, OVERLAP, TURNS]
    assert order[4:] == [TURNS] * 4 + [OVERLAP] + [TURNS] * 5 + [OVERLAP, TURNS]
    assert choice.rate(TURNS) == pytest.approx(4 / 0.36) and choice.rate(OVERLAP) == pytest.approx(4 / 0.40)


def test_overlap_wins_where_reads_bound_the_pass():
    order = run_blocks(ScheduleChoice(), {OVERLAP: 0.62, TURNS: 0.74}, 24)
    assert order[4:].count(OVERLAP) == 18 and order[-1] == OVERLAP


def test_the_prompt_does_not_decide_what_the_cycles_do():
    """Every turns block lands on passes that commit 1 token and every overlap block on passes that
    commit 9 (a hard and an easy stretch): tokens per second says overlap, the cycles say turns."""
    choice = ScheduleChoice()
    run_blocks(choice, {OVERLAP: 0.40, TURNS: 0.34}, 12, tokens=lambda s, i: 1 if s == TURNS else 9)
    assert choice.rate(OVERLAP) > choice.rate(TURNS)
    assert choice.current == TURNS and choice.blocks[TURNS] > choice.blocks[OVERLAP]


def test_the_choice_follows_when_the_host_changes():
    choice = ScheduleChoice()
    run_blocks(choice, {OVERLAP: 0.40, TURNS: 0.36}, 12)
    later = run_blocks(choice, {OVERLAP: 0.30, TURNS: 0.36}, 30)
    # within two rounds of measuring overlap again, it runs every block but the checks of turns
    assert later[2 * choice.explore_every:].count(OVERLAP) >= (30 - 2 * choice.explore_every) * 7 // 8


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0.3, 3.0), st.integers(1, 12)), min_size=6, max_size=30),
       st.sampled_from([0.8, 0.9, 1.15, 1.3]))
def test_a_prompts_own_cycle_time_does_not_bias_the_choice(sequences, turns_ratio):
    """Each sequence (a prompt) has its own cycle time (its trees' size), which scales both schedules'
    cycles alike; a turns cycle takes ``turns_ratio`` times an overlap one within every one. Comparing
    adjacent blocks of one sequence measures exactly that ratio, wherever each schedule's blocks fell."""
    choice = ScheduleChoice()
    for base_s, passes in sequences:
        choice.new_sequence()
        for _ in range(passes):
            choice.observe(4, base_s * (turns_ratio if choice.current == TURNS else 1.0))
    if choice.pairs:
        assert choice.turns_ratio() == pytest.approx(turns_ratio)


def test_a_block_closes_after_its_passes_only():
    choice = ScheduleChoice(block=3)
    choice.observe(2, 0.5)
    choice.observe(2, 0.5)
    assert choice.blocks == {OVERLAP: 0, TURNS: 0} and choice.rate(OVERLAP) is None
    choice.observe(2, 0.5)
    assert choice.blocks[OVERLAP] == 1 and choice.rate(OVERLAP) == pytest.approx(4.0) and choice.current == TURNS


def test_bad_settings_and_observations_are_refused():
    with pytest.raises(ValueError):
        ScheduleChoice(block=0)
    with pytest.raises(ValueError):
        ScheduleChoice(decay=1.0)
    with pytest.raises(ValueError):
        ScheduleChoice(alpha=0.0)
    with pytest.raises(ValueError):
        ScheduleChoice(current="sideways")
    with pytest.raises(ValueError):
        ScheduleChoice().observe(3, -1.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.floats(0.0, 5.0)), min_size=1, max_size=200),
       st.integers(1, 5), st.integers(1, 3), st.integers(2, 8))
def test_neither_schedule_goes_unmeasured_whatever_the_timings(passes, block, warmup, explore_every):
    """Invariant: the warmup alternates, any explore_every blocks in a row run both schedules (the
    slower one is measured again however the timings go), and the choice is a known schedule."""
    choice = ScheduleChoice(block=block, warmup=warmup, explore_every=explore_every)
    order = [choice.current]
    for tokens, seconds in passes:
        choice.observe(tokens, seconds)
        assert choice.current in SCHEDULES
        if choice._passes == 0:  # a block closed: the next block's schedule
            order.append(choice.current)
    assert order[: 2 * warmup] == ([OVERLAP, TURNS] * warmup)[: len(order[: 2 * warmup])]
    for i in range(len(order) - explore_every + 1):
        assert set(order[i:i + explore_every]) == set(SCHEDULES)


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

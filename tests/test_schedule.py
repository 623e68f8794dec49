"""lever's choice between drafting beside its passes (overlap) and taking turns: pure logic."""
import pytest
from hypothesis import given, settings, strategies as st

from lever_actors.planner import LeverPolicy
from lever_actors.schedule import OVERLAP, SCHEDULES, TURNS, ScheduleChoice


def run_blocks(choice: ScheduleChoice, rate: dict, blocks: int) -> list[str]:
    """Feed ``blocks`` whole blocks at fixed tokens/s per schedule; the schedule of each block, in order."""
    order = []
    for _ in range(blocks):
        s = choice.current
        order.append(s)
        for _ in range(choice.block):
            choice.observe(4, 4 / rate[s])
    return order


def test_warmup_alternates_then_the_faster_runs_and_the_slower_is_checked_again():
    choice = ScheduleChoice(block=4, warmup=2, explore_every=6)
    order = run_blocks(choice, {OVERLAP: 8.0, TURNS: 10.0}, 16)
    assert order[:4] == [OVERLAP, TURNS, OVERLAP, TURNS]
    assert order[4:] == [TURNS] * 4 + [OVERLAP] + [TURNS] * 5 + [OVERLAP, TURNS]
    assert choice.rate(TURNS) == pytest.approx(10.0) and choice.rate(OVERLAP) == pytest.approx(8.0)


def test_overlap_wins_where_it_is_faster():
    order = run_blocks(ScheduleChoice(), {OVERLAP: 20.0, TURNS: 15.0}, 20)
    assert order[4:].count(OVERLAP) >= len(order[4:]) * 5 // 6


def test_the_choice_follows_when_the_host_changes():
    choice = ScheduleChoice()
    run_blocks(choice, {OVERLAP: 8.0, TURNS: 10.0}, 12)
    later = run_blocks(choice, {OVERLAP: 12.0, TURNS: 10.0}, 24)
    assert later[-10:].count(OVERLAP) >= 8  # one explore block of overlap at 12 tok/s outweighs its past


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
        ScheduleChoice(current="sideways")
    with pytest.raises(ValueError):
        ScheduleChoice().observe(3, -1.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.floats(0.0, 5.0)), min_size=1, max_size=200),
       st.integers(1, 5), st.integers(1, 3), st.integers(1, 8))
def test_neither_schedule_goes_unmeasured_whatever_the_timings(passes, block, warmup, explore_every):
    """Invariant: the warmup alternates, any explore_every blocks in a row run both schedules (the
    slower one is measured again however the timings go), and the choice is always a known schedule."""
    choice = ScheduleChoice(block=block, warmup=warmup, explore_every=explore_every)
    order = [choice.current]
    for tokens, seconds in passes:
        choice.observe(tokens, seconds)
        assert choice.current in SCHEDULES
        if choice._passes == 0:  # a block closed: the next block's schedule
            order.append(choice.current)
    assert order[: 2 * warmup] == ([OVERLAP, TURNS] * warmup)[: len(order[: 2 * warmup])]
    if explore_every > 1:
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



@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0.2, 5.0), st.integers(1, 12)), min_size=6, max_size=30),
       st.sampled_from([0.8, 1.15, 1.4]))
def test_prompts_of_any_difficulty_do_not_bias_the_choice(sequences, turns_gain):
    """Each sequence (a prompt) has its own difficulty, which scales both schedules' rates alike; turns
    is ``turns_gain`` times overlap within every one. Comparing adjacent blocks of one sequence
    measures exactly that gain, wherever the blocks of each schedule happened to fall, and once it is
    known the faster schedule runs all blocks but the one in every explore_every that checks the other."""
    choice = ScheduleChoice()
    best = TURNS if turns_gain > 1 else OVERLAP
    order = []
    for difficulty, passes in sequences:
        choice.new_sequence()
        for _ in range(passes):
            if choice._passes == 0:
                order.append((choice.current, choice.pairs > 0))
            rate = difficulty * (turns_gain if choice.current == TURNS else 1.0)
            choice.observe(4, 4 / rate)
    if choice.pairs:
        assert choice.gain() == pytest.approx(turns_gain)
    informed = [s for s, known in order if known][1:]  # decided once the gain was measured
    for i in range(len(informed) - 1):
        assert best in informed[i:i + 2]  # the slower one never runs two blocks in a row
    assert informed.count(best) >= len(informed) * (choice.explore_every - 1) // choice.explore_every - 1

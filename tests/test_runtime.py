"""The actor pipeline on the tiny models: lossless output, buffers, cancellation, no deadlock."""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from lever_actors.engine import EngineConfig
from lever_actors.errors import BudgetError
from lever_actors.runtime import open_pipeline
from lever_actors.sampling import SamplingParams
from lever_actors.tokenizer import TextTokenizer

PROMPT = "def add(left, right):\n    return"
CONTEXT = 160
TOKENS = 40


@pytest.fixture(scope="module")
def unrelated_draft(tmp_path_factory) -> Path:
    """A draft with the same vocabulary but different weights: its guesses are almost always wrong."""
    from lever_actors.convert import convert
    from tools.make_tiny_models import make_tiny_pair

    out = tmp_path_factory.mktemp("unrelated")
    _, draft = make_tiny_pair(out, seed=99)
    return convert(draft, out / "unrelated.bundle", progress=lambda m: None)


def tokenizer(bundle: Path) -> TextTokenizer:
    return TextTokenizer.from_file(bundle / "tokenizer.json")


async def generate(cfg, target, draft, ids, params=SamplingParams(), **kw):
    tok_eos = set(tokenizer(target).eos_ids)
    async with open_pipeline(cfg, target, draft, tok_eos, **kw) as pipe:
        async def emit(_):
            return False
        toks, finish, stats = await pipe.generate(ids, TOKENS, params, emit)
        assert pipe.verifier.taken == set()
        return toks, stats, pipe


def reference(tiny_bundles) -> list[int]:
    target = tiny_bundles[0]
    ids = tokenizer(target).encode(PROMPT)
    cfg = EngineConfig(mode="resident-ar", context=CONTEXT)
    return trio.run(generate, cfg, target, None, ids)[0]


@pytest.fixture(scope="module")
def ar_tokens(tiny_bundles):
    return reference(tiny_bundles)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("draft_kind", ["perturbed", "exact", "unrelated", "ort"])
@pytest.mark.parametrize("mode,size", [("flash-chain", 1), ("flash-chain", 3), ("flash-chain", 7),
                                       ("flash-tree", 2), ("flash-tree", 9), ("flash-tree", 24)])
def test_greedy_speculation_equals_resident_ar(tiny_bundles, unrelated_draft, tiny_ort_draft, ar_tokens, draft_kind,
                                               mode, size, overlap):
    target = tiny_bundles[0]
    draft = {"perturbed": tiny_bundles[1], "exact": target, "unrelated": unrelated_draft,
             "ort": tiny_ort_draft}[draft_kind]  # the draft on ONNX Runtime sessions (--layout ort) too
    ids = tokenizer(target).encode(PROMPT)
    cfg = EngineConfig(mode=mode, gamma=size, context=CONTEXT, dram_budget=24 * 2**20, overlap=overlap)
    toks, stats, _ = trio.run(generate, cfg, target, draft, ids)
    assert toks == ar_tokens
    if draft_kind == "exact":  # a draft that is the target is always right: its top choice is always in
        assert stats["mean_accepted"] >= 2
        if mode == "flash-chain":
            assert stats["draft_n_accepted"] == stats["draft_n"]
    if draft_kind == "unrelated":
        assert stats["draft_n_accepted"] < stats["draft_n"] / 2
    if not overlap:
        assert stats["spec_hits"] == stats["spec_misses"] == 0
    elif draft_kind == "exact" and mode == "flash-chain":
        # every assumption holds (whole chain accepted, the draft's next token is the target's):
        # after the first pass no drafting is waited for
        assert stats["spec_misses"] == 0 and stats["spec_hits"] >= stats["passes"] - 2
    elif draft_kind == "unrelated":
        assert stats["spec_misses"] > stats["spec_hits"]  # wrong guesses are undone, output unchanged


def _recording(monkeypatch, cls, *modules) -> list:
    """Every ``cls`` message the given modules construct, in order (still sent as usual)."""
    made = []

    def construct(**kw):
        made.append(cls(**kw))
        return made[-1]

    for module in modules:
        monkeypatch.setattr(module, cls.__name__, construct)
    return made


def test_multi_outcome_drafting_hits_early_stops_and_changes_no_token(tiny_bundles, ar_tokens, monkeypatch):
    """lever drafts ahead for its tree's likeliest early stops too: some passes find their tree ready
    after a partial acceptance (never with +no-multi-outcome), and the output is the same. With
    +runner-up it assumes the draft's second-best token after the main path as well."""
    import lever_actors.driver
    from protocols import DraftRequest

    requests = _recording(monkeypatch, DraftRequest, lever_actors.driver)
    target, draft = tiny_bundles
    ids = tokenizer(target).encode(PROMPT)
    # the draft as stored: the tiny draft in Q4_0 agrees with the tiny target so rarely (2 hits in 25
    # passes) that the hit counts compared below are a coin toss
    budget = _min_budget(target, draft, "lever:16+no-draft-q4")
    runs, ranks = {}, {}
    for multi, runner_up in ((True, True), (True, False), (False, True)):
        # every layer streamed, slowly enough that the pass is bound by its reads as on the real pair
        # (trees pay there; a pinned tiny model's pass is mostly bookkeeping, and its plans verify little)
        cfg = EngineConfig(mode="lever", gamma=16, context=CONTEXT, dram_budget=budget, multi_outcome=multi,
                           runner_up=runner_up, flash_bandwidth=20e6, auto_schedule=False, draft_q4=False)  # every pass drafts ahead
        requests.clear()
        toks, stats, _ = trio.run(generate, cfg, target, draft, ids)
        assert toks == ar_tokens
        runs[multi, runner_up] = stats
        ranks[multi, runner_up] = [[h[4] for h in r.hypotheses] for r in requests if len(r.hypotheses) > 1]
    assert runs[False, True]["spec_early_hits"] == 0 and runs[True, False]["spec_early_hits"] > 0
    assert runs[True, False]["spec_hits"] > runs[True, False]["spec_early_hits"]  # the main path holds most often
    assert runs[True, False]["spec_hits"] > runs[False, True]["spec_hits"]
    # hypothesis 1 is the main path again, with the draft's second-best token; every other takes its best
    assert ranks[True, True] and all(r[:2] == [0, 1] and not any(r[2:]) for r in ranks[True, True])
    assert ranks[True, False] and not any(any(r) for r in ranks[True, False])
    assert ranks[False, True] == []


def test_idle_lanes_lend_their_threads(tiny_bundles, ar_tokens, monkeypatch):
    """By default (lever and the pipelined chain alike) a draft the pass waits for runs on the drafting
    lane's threads and the idle verification lane's; a draft ahead (beside the pass) never borrows them; +no-core-borrow never
    does. The other way round, once the drafts ahead are in, the drafter lends its threads to the
    rest of that one pass (never with +no-core-lend), and every pass starts on the verification
    lane's own. Thread counts change no bit of a product, so nor do they change a token."""
    import lever_actors.driver
    from actors.npu_verify import NpuVerifier
    from protocols import DraftRequest

    requests = _recording(monkeypatch, DraftRequest, lever_actors.driver)
    target, draft = tiny_bundles
    ids = tokenizer(target).encode(PROMPT)
    # the chains' draft is the stored one, larger than lever's requantized draft: the budget fits both
    budget = max(_min_budget(target, draft, m) for m in ("lever:16", "flash-chain:4"))
    cfg = EngineConfig(mode="lever", gamma=16, context=CONTEXT, dram_budget=budget,
                       draft_threads=1, flash_bandwidth=20e6, auto_schedule=False)  # every pass drafts ahead
    cfg = replace(cfg, lane=replace(cfg.lane, threads=2))
    verify_threads, own = [], NpuVerifier._use_threads
    monkeypatch.setattr(NpuVerifier, "_use_threads", lambda self, n: (verify_threads.append(n), own(self, n)))
    threads, lent, prefills_lent = {}, {}, {}
    for mode in ("lever", "lever+no-core-borrow", "lever+no-core-lend", "flash-chain:4", "flash-chain:4+no-overlap"):
        requests.clear()
        toks, stats, pipe = trio.run(generate, cfg.with_mode(mode, 16), target, draft, ids)
        assert toks == ar_tokens
        waited = [r.threads for r in requests if not r.hypotheses and not r.extend]
        threads[mode] = (waited, [r.threads for r in requests if r.hypotheses])
        lent[mode] = pipe.verifier.lent_passes
        prefills_lent[mode] = pipe.verifier.lent_prefills
        assert pipe.verifier.m.lane.threads == 2  # back to its own after the last pass
    waited, ahead = threads["lever"]
    assert waited and set(waited) == {3} and ahead and set(ahead) == {0}
    waited, ahead = threads["lever+no-core-borrow"]
    assert waited and set(waited) == {0} and set(ahead) == {0}
    assert lent["lever"] > 0 and lent["lever+no-core-borrow"] > 0 and lent["lever+no-core-lend"] == 0
    # the pipelined chain, a baseline on the same machine, shares its idle cores the same way; lanes
    # that take turns (+no-overlap) have nothing to lend
    waited, ahead = threads["flash-chain:4"]
    assert waited and set(waited) == {3} and ahead and set(ahead) == {0} and lent["flash-chain:4"] > 0
    waited, ahead = threads["flash-chain:4+no-overlap"]
    assert waited and set(waited) == {0} and not ahead and lent["flash-chain:4+no-overlap"] == 0
    assert 3 in verify_threads and set(verify_threads) == {2, 3}
    # the prefill, too, takes the drafter's threads once the prompt is digested (its reads are slow
    # here: the grant comes before its last stage), in every mode that lends: not +no-core-lend, not
    # the lanes that take turns
    assert prefills_lent == {"lever": 1, "lever+no-core-borrow": 1, "lever+no-core-lend": 0, "flash-chain:4": 1,
                             "flash-chain:4+no-overlap": 0}


@pytest.fixture(scope="module")
def sliced_target(tiny_gguf, tmp_path_factory) -> Path:
    """The tiny target with its LM head in three vocabulary slices (the real target's has seven;
    the tiny one's fits one slice of the usual size)."""
    from lever_actors import convert as convert_module

    def in_thirds(out, n, row_bytes, layer_bytes, slice_arrays):
        rows = -(-n // 3)
        return [out.write(*slice_arrays(lo, min(lo + rows, n))) for lo in range(0, n, rows)]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(convert_module, "_write_head", in_thirds)
        out = tmp_path_factory.mktemp("sliced")
        return convert_module.convert(tiny_gguf[0], out / "sliced.bundle", progress=lambda m: None, layout="native")


def test_threads_lent_while_the_head_runs_take_its_remaining_slices(sliced_target, tiny_bundles, ar_tokens,
                                                                     monkeypatch):
    """The drafter usually finishes its levels ahead during the pinned LM head, which was one call on
    the lane's own threads. The head now runs slice by slice while nothing is lent, and once threads
    are lent (the drafter's grant, stood in for here after a pass's first slice) the rest go in one call
    on them. The tokens do not change (thread counts change no bit)."""
    from actors.npu_verify import NpuVerifier

    target, draft = sliced_target, tiny_bundles[1]
    ids = tokenizer(target).encode(PROMPT)
    calls, own_take, own_head = [], NpuVerifier._take_grants, NpuVerifier._run_head

    def take_grants(self, plan):
        own_take(self, plan)
        if calls and calls[-1][0] == plan.step and calls[-1][2] == self.own_threads and not plan.prefill:
            self._use_threads(self.own_threads + 1)  # lent after the head's first slice of this pass

    def run_head(self, x, feeds_list, slots_list, rows, stages, scores):
        calls.append((self._plan_step, list(stages), self.m.lane.threads))
        return own_head(self, x, feeds_list, slots_list, rows, stages, scores)

    verify = NpuVerifier.verify

    async def verify_spy(self, plan):
        self._plan_step = plan.step
        return await verify(self, plan)

    monkeypatch.setattr(NpuVerifier, "_take_grants", take_grants)
    monkeypatch.setattr(NpuVerifier, "_run_head", run_head)
    monkeypatch.setattr(NpuVerifier, "verify", verify_spy)
    cfg = EngineConfig(mode="lever", gamma=8, context=CONTEXT, dram_budget=24 * 2**20, draft_threads=1)
    toks, stats, pipe = trio.run(generate, cfg, target, draft, ids)
    assert toks == ar_tokens
    head = list(range(pipe.verifier.m.n_layer, pipe.verifier.stage_count))
    assert len(head) == 3
    by_pass = {}
    for step, stages, threads in calls:
        by_pass.setdefault(step, []).append((stages, threads))
    decode = [v for step, v in by_pass.items() if step > 0]
    assert decode
    # lent before the head (the drafter's own grant): one call; else the first slice alone on the
    # lane's own thread, then the rest together on the lent ones
    assert all(v in ([(head, 2)], [([head[0]], 1), (head[1:], 2)]) for v in decode)
    assert sum(v == [([head[0]], 1), (head[1:], 2)] for v in decode) >= 2


@pytest.mark.parametrize("draft_kind", ["perturbed", "unrelated"])
def test_steered_drafting_changes_no_token(tiny_bundles, unrelated_draft, ar_tokens, draft_kind, monkeypatch):
    """lever's drafter reads steers between its draft calls: the commit cut (on by default) and, with
    +exit-predict, the outcome a logit lens predicts at the early exit. Whatever they say, and with
    either off, the output is the target's; predictions are made and scored against the commits."""
    from actors.draft import Drafter

    grow = Drafter._grow_levels

    def slow(self, levels, t0=None):  # a level as slow as the real draft's against its pass, so steers arrive in time
        time.sleep(0.01)
        return grow(self, levels, t0)

    monkeypatch.setattr(Drafter, "_grow_levels", slow)
    target = tiny_bundles[0]
    draft = {"perturbed": tiny_bundles[1], "unrelated": unrelated_draft}[draft_kind]
    ids = tokenizer(target).encode(PROMPT)
    runs = {}
    for mode in ("lever:16", "lever:16+exit-predict", "lever:16+no-commit-cut", "lever:16+no-commit-cut+exit-predict",
                 "lever:16+level-deadline"):
        # every layer streamed (the multi-outcome test says why)
        cfg = EngineConfig(context=CONTEXT, dram_budget=_min_budget(target, draft, mode),
                           flash_bandwidth=20e6).with_mode(mode)
        assert cfg.mode_string() == mode
        toks, stats, pipe = trio.run(generate, cfg, target, draft, ids)
        assert toks == ar_tokens, mode
        runs[mode] = stats
        predicting = "exit-predict" in mode
        assert (pipe.predict_exit is not None) == predicting and pipe.prune_exits == ()
        assert (stats.get("exit_predicted", 0) > 0) == predicting
        assert 0 <= stats["exit_right"] <= stats["exit_checked"] <= stats.get("exit_predicted", 0)
        assert stats["exit_applied"] <= stats.get("exit_predicted", 0)
        assert stats["spec_predicted_hits"] <= stats["exit_planted"]
        assert stats["deadline_stops"] == 0 or "level-deadline" in mode  # (the drafter's tests cut levels)
    assert runs["lever:16+exit-predict"]["exit_checked"] > 0  # scored against the commit the cut names
    # (whether a prediction still finds its request drafting is timing: the drafter's tests plant trees)


def test_lever_sampling_by_rejection_is_never_steered(tiny_bundles, monkeypatch):
    """Steers make tree shapes depend on timing, so a seeded run sampling by rejection would not repeat:
    lever sends none then (no prediction, no commit cut), and draws the same output either way.
    (Coupled sampling commits the same tokens whatever the trees: it may steer.)"""
    import actors.prune
    import lever_actors.driver
    from protocols import DraftRequest, DraftSteer

    sent = _recording(monkeypatch, DraftSteer, lever_actors.driver, actors.prune)  # the cut's and the pruner's
    requests = _recording(monkeypatch, DraftRequest, lever_actors.driver)
    target, draft = tiny_bundles
    ids = tokenizer(target).encode(PROMPT)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3)
    out = []
    for mode in ("lever:16+no-coupled", "lever:16+exit-predict+runner-up+no-coupled"):
        cfg = EngineConfig(context=CONTEXT, dram_budget=24 * 2**20).with_mode(mode)
        toks, stats, _ = trio.run(generate, cfg, target, draft, ids, params)
        assert stats.get("exit_predicted", 0) == 0 and stats["exit_applied"] == 0
        out.append(toks)
    assert out[0] == out[1] and sent == []
    # nor does it assume several outcomes: its trees follow the draft's draws, never a ranked guess
    assert requests and all(len(r.hypotheses) <= 1 and not any(h[4] for h in r.hypotheses) for r in requests)
    # and every tree it drafts, the first after the prompt too, keeps the sampled rule (verified whole)
    cap = lever_actors.driver.SAMPLED_WIDTH * lever_actors.driver.SAMPLED_MAX_DEPTH
    assert all(h[2] <= cap and h[3] <= lever_actors.driver.SAMPLED_MAX_DEPTH for r in requests for h in r.hypotheses)
    assert all(r.min_path_p == lever_actors.driver.SAMPLED_MIN_PATH_P for r in requests if r.hypotheses)
    cfg = EngineConfig(context=CONTEXT, dram_budget=24 * 2**20).with_mode("lever:16+exit-predict")  # greedy: both sent
    trio.run(generate, cfg, target, draft, tokenizer(target).encode(PROMPT))
    assert any(s.final for s in sent) and any(not s.final for s in sent)


def test_drafting_until_the_commit_drops_late_answers_and_changes_no_token(tiny_bundles, ar_tokens, monkeypatch):
    """+draft-until-commit: the trees drafted ahead grow a level per request while the pass runs; answers
    still being drafted at the commit are dropped, the draft's rows stay exact, the output is the same."""
    import numpy as np

    from lever_actors.bundle import load_bundle
    from lever_actors.model import Transformer
    from lever_actors.ortrt import LaneConfig

    target, draft = tiny_bundles
    ids = tokenizer(target).encode(PROMPT)
    from actors.draft import Drafter

    cfg = EngineConfig(mode="lever", gamma=16, context=CONTEXT, dram_budget=24 * 2**20, draft_until_commit=True)
    assert cfg.mode_string() == "lever:16+draft-until-commit"
    extends = []
    original = Drafter._extend

    def counting(self, req):
        extends.append(req.levels)
        return original(self, req)

    monkeypatch.setattr(Drafter, "_extend", counting)
    # whether another level still fits in the pass is a timing rule, and on the tiny pair a pass can
    # end before the first trees drafted ahead arrive (then nothing grows): let every level fit, and
    # make each layer of a pass take 20 ms, so the growth, the late answers and the rows are what is
    # tested here, not the machine's speed
    from actors.npu_verify import NpuVerifier
    from lever_actors.driver import Pipeline

    monkeypatch.setattr(Pipeline, "_level_fits", lambda self, g: True)
    run_stage = NpuVerifier._run_stage

    def slow_stage(self, *a, **k):
        time.sleep(0.02)
        return run_stage(self, *a, **k)

    monkeypatch.setattr(NpuVerifier, "_run_stage", slow_stage)
    toks, stats, pipe = trio.run(generate, cfg, target, draft, ids)
    assert extends and set(extends) == {1}  # the trees drafted ahead did grow a level per request
    assert toks == ar_tokens
    assert stats["spec_hits"] > 0
    d = pipe.drafter
    n = d.m.kv.length
    ref = Transformer(load_bundle(draft), CONTEXT, LaneConfig(), requantize=d.m.requantize,
                      tiles=d.m.tiles)  # lever's draft is Q4_0 (in AMX tile strips where the CPU has them)
    ref.prefill((ids + toks)[:n])
    np.testing.assert_array_equal(d.m.kv.k[:, :, :n], ref.kv.k[:, :, :n])


def test_levers_draft_is_requantized_to_q4_0_and_the_output_is_the_target_s(tiny_bundles, ar_tokens):
    """Lever's draft computes from its matrices requantized to Q4_0 (Q4_0T in AMX tile strips where the
    CPU has AMX, else Q4_0R where the build repacks pairs): the plan charges the smaller draft, the
    stats say so, and the greedy output stays the target's. +no-draft-q4 and the baselines keep the
    draft as stored; +no-draft-tiles keeps the pairs."""
    from lever_actors import kernels
    from lever_actors.bundle import load_bundle
    from lever_actors.model import requantized_bytes

    target, draft = tiny_bundles
    ids = tokenizer(target).encode(PROMPT)
    cfg = EngineConfig(mode="lever", gamma=8, context=CONTEXT, dram_budget=24 * 2**20)
    weights, notes, types = {}, {}, {}
    for mode in ("lever", "lever+no-draft-q4", "lever+no-draft-tiles", "flash-chain:4"):
        toks, stats, pipe = trio.run(generate, cfg.with_mode(mode, 8), target, draft, ids)
        assert toks == ar_tokens
        weights[mode] = pipe.plan.items["draft_weights"]
        notes[mode] = pipe.describe()["draft_weights"]
        types[mode] = {w.qtype for layer in pipe.drafter.m.resident.values() for w in layer.mats.values()}
    assert "no-draft-q4" in notes["lever+no-draft-q4"] and "baselines" in notes["flash-chain:4"]
    if kernels.simd() != "avx512-vnni":  # only the AVX-512 kernels read Q4_0 in pairs: elsewhere it does not pay
        assert notes["lever"].startswith("as stored") and weights["lever"] == weights["lever+no-draft-q4"]
        return
    assert notes["lever"].startswith("Q4_0")
    stored_types, q4_types = {"Q5_0", "Q5_0R", "Q6_K", "Q8_0"}, {"Q4_0", "Q4_0R", "Q4_0T"}
    assert types["lever"] & q4_types and not types["lever"] & stored_types
    assert types["lever+no-draft-q4"] & stored_types and not types["lever+no-draft-q4"] & q4_types
    # AMX tile strips where the CPU has them, the paired layout without (and with +no-draft-tiles)
    assert ("Q4_0T" in types["lever"]) == kernels.amx() == ("AMX tile strips" in notes["lever"])
    assert "Q4_0T" not in types["lever+no-draft-tiles"] and "no-draft-tiles" in notes["lever+no-draft-tiles"]
    assert weights["lever+no-draft-tiles"] == weights["lever"]  # the same bytes, rearranged
    # the same head, layers charged at Q4_0's 18 bytes a block where they had Q5_0's 22 and Q8_0's 34
    stored, q4 = (sum(f(r) for r in load_bundle(draft).layers) for f in (lambda r: r.nbytes, requantized_bytes))
    assert weights["lever+no-draft-q4"] - weights["lever"] == stored - q4 > 0


def _min_budget(target, draft=None, mode: str = "flash-ar", context: int = CONTEXT) -> int:
    """The smallest budget the planner accepts (found from its own refusal message)."""
    cfg = EngineConfig(context=context, dram_budget=1).with_mode(mode)
    try:
        trio.run(generate, cfg, target, draft, [1, 2, 3])
    except BudgetError as e:
        return e.minimum
    raise AssertionError("a 1-byte budget was accepted")


def test_flash_ar_streams_layers_and_head_and_stays_lossless(tiny_bundles, ar_tokens):
    target = tiny_bundles[0]
    ids = tokenizer(target).encode(PROMPT)
    cfg = EngineConfig(mode="flash-ar", context=CONTEXT, dram_budget=_min_budget(target))
    toks, stats, pipe = trio.run(generate, cfg, target, None, ids)
    assert toks == ar_tokens
    assert pipe.plan.head_streamed and pipe.plan.streamed  # the smallest budget streams everything
    per_pass = stats["flash_bytes_read"] / stats["passes"]
    streamed = sum(pipe.target.bundle.layer_bytes()) + pipe.target.bundle.head_bytes()
    assert per_pass >= streamed * 0.9  # every pass reads the streamed stages (plus read-ahead)
    assert stats["direct_io"] in (True, False)


def test_budget_refusal_names_the_numbers(tiny_bundles):
    cfg = EngineConfig(mode="flash-ar", context=CONTEXT, dram_budget=1000)
    with pytest.raises(BudgetError, match=r"resident minimum is .* MiB .*raise --dram-budget"):
        trio.run(generate, cfg, tiny_bundles[0], None, [1, 2])


@settings(max_examples=12, deadline=None)
@given(caps=st.fixed_dictionaries({k: st.integers(1, 3) for k in ("ready", "plans", "done", "commits", "stats",
                                                                   "draft_requests", "drafts")}),
       extra_mib=st.integers(0, 6), gamma=st.integers(1, 5))
def test_no_deadlock_and_lossless_at_any_channel_capacity(tiny_bundles, ar_tokens, caps, extra_mib, gamma):
    target, draft = tiny_bundles
    ids = tokenizer(target).encode(PROMPT)
    budget = _budget_cache(target, draft) + extra_mib * 2**20
    cfg = EngineConfig(mode="flash-chain", gamma=gamma, context=CONTEXT, dram_budget=budget)

    async def main():
        with trio.fail_after(120):  # a deadlock shows up as a timeout, not a hung suite
            return await generate(cfg, target, draft, ids, channels=caps)

    toks, _, pipe = trio.run(main)
    assert toks == ar_tokens
    # every slot is free or lent (read ahead, announced, or still being read), none twice, none lost
    pf = pipe.prefetcher
    assert sorted(pf.free + list(pf.lent)) == list(range(len(pf.pool)))


_BUDGETS: dict = {}


def _budget_cache(target, draft) -> int:
    key = (str(target), str(draft))
    if key not in _BUDGETS:
        cfg = EngineConfig(mode="flash-chain", context=CONTEXT, dram_budget=1)
        try:
            trio.run(generate, cfg, target, draft, [1, 2, 3])
        except BudgetError as e:
            _BUDGETS[key] = e.minimum
    return _BUDGETS[key]


@pytest.mark.parametrize("delay", [0.0, 0.01, 0.05, 0.2])
def test_cancelling_a_generation_frees_buffers_and_the_next_one_is_exact(tiny_bundles, ar_tokens, delay):
    target, draft = tiny_bundles
    ids = tokenizer(target).encode(PROMPT)
    cfg = EngineConfig(mode="flash-chain", gamma=3, context=CONTEXT, dram_budget=_budget_cache(target, draft))
    seen = {}

    async def main():
        with trio.fail_after(120):
            async with open_pipeline(cfg, target, draft, set(tokenizer(target).eos_ids)) as pipe:
                async def emit(_):
                    return False

                with trio.move_on_after(delay):
                    await pipe.generate(ids, TOKENS, SamplingParams(), emit)
                toks, _, _ = await pipe.generate(ids, TOKENS, SamplingParams(), emit)
                seen["toks"] = toks
                seen["holding"] = set(pipe.verifier.taken)
                seen["pool"] = pipe.prefetcher.pool
            seen["closed"] = all(b.closed for b in seen["pool"])

    trio.run(main)
    assert seen["toks"] == ar_tokens
    assert seen["holding"] == set()
    assert seen["closed"]  # closing the pipeline unmaps every stream buffer


@pytest.mark.parametrize("mode", ["lever:16", "flash-chain:3"])
def test_requests_cancelled_one_after_another_leave_the_pipeline_serving_exactly(tiny_bundles, ar_tokens, mode):
    """A cancelled generation leaves answers owed: the drafter's (it answers every request, and is
    held in a send while one waits in its channel) and the acceptor's (a commit, then its stats).
    Several cancels in a row once filled every channel and the next request waited for ever."""
    target, draft = tiny_bundles
    ids = tokenizer(target).encode(PROMPT)
    cfg = EngineConfig(context=CONTEXT, dram_budget=_min_budget(target, draft, mode)).with_mode(mode)
    seen = {}

    async def main():
        async with open_pipeline(cfg, target, draft, set(tokenizer(target).eos_ids)) as pipe:
            for at in (1, 1, 1, 2, 1, 3, 2, 2, 1):  # cancelled at its at-th commit, some right after the prefill
                with trio.fail_after(60), trio.CancelScope() as scope:
                    commits = 0

                    async def cancel_at(_):
                        nonlocal commits
                        commits += 1
                        if commits == at:
                            scope.cancel()
                        return False

                    await pipe.generate(ids, TOKENS, SamplingParams(), cancel_at)
                assert scope.cancelled_caught
            with trio.fail_after(60):
                seen["toks"] = (await pipe.generate(ids, TOKENS, SamplingParams(), lambda _: trio.sleep(0)))[0]
            seen["holding"] = set(pipe.verifier.taken)

    trio.run(main)
    assert seen["toks"] == ar_tokens
    assert seen["holding"] == set()


def test_passes_that_outlive_their_cancelled_requests_leave_the_pipeline_serving_exactly(tiny_bundles, ar_tokens):
    """An abort that comes too late (after the pass's last layer) lets the pass commit: its commit
    and stats wait unread. Dropping the commit alone left the stats in their channel, and a second
    such request held the acceptor in a send while the driver waited for the next commit."""
    target, draft = tiny_bundles
    ids = tokenizer(target).encode(PROMPT)
    cfg = EngineConfig(context=CONTEXT, dram_budget=_min_budget(target, draft, "lever:16"),
                       flash_bandwidth=20e6).with_mode("lever:16")
    seen = {}

    class TooLate:  # every abort comes after its pass is done
        def send_nowait(self, msg):
            pass

    async def main():
        async with open_pipeline(cfg, target, draft, set(tokenizer(target).eos_ids)) as pipe:
            pipe.abort_send = TooLate()

            async def emit(_):
                return False

            for delay in (0.05, 0.12, 0.2, 0.07, 0.15, 0.1):  # inside a pass of the throttled reads
                with trio.fail_after(60), trio.move_on_after(delay):
                    await pipe.generate(ids, TOKENS, SamplingParams(), emit)
            with trio.fail_after(60):
                seen["toks"] = (await pipe.generate(ids, TOKENS, SamplingParams(), emit))[0]
            seen["stale"] = pipe.stale

    trio.run(main)
    assert seen["toks"] == ar_tokens
    assert seen["stale"] > 0  # the cancelled requests' answers did come, and were dropped


def test_a_passs_reads_and_waits_are_measured_inside_the_decode_passes(tiny_bundles):
    """The prefill reads every streamed layer once: its reads are the request's (``io_s``), not the
    passes' (``decode_io_s``, what ``io_s_per_pass`` and the bench's pipeline bound divide), and the
    first pass's time includes its wait for the draft drafted beside the prefill."""
    target, draft = tiny_bundles
    ids = tokenizer(target).encode(PROMPT)
    cfg = EngineConfig(context=CONTEXT, dram_budget=_min_budget(target, draft, "lever:16"),
                       flash_bandwidth=20e6).with_mode("lever:16")  # reads bound every pass
    _, stats, _ = trio.run(generate, cfg, target, draft, ids)
    per_pass_read = stats["decode_io_s"] / stats["passes"]
    assert stats["io_s"] - stats["decode_io_s"] > 0.5 * per_pass_read  # the prefill read about a pass's worth
    assert stats["io_s_per_pass"] == pytest.approx(per_pass_read)
    assert stats["decode_io_s"] <= 1.02 * stats["pass_s"]  # a pass's reads lie inside the passes
    assert stats["draft_wait_s"] <= stats["pass_s"]


def test_sampled_generation_is_reproducible_and_differs_from_greedy(tiny_bundles, ar_tokens):
    target, draft = tiny_bundles
    ids = tokenizer(target).encode(PROMPT)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=5)
    for flags in ("", "+no-coupled"):  # coupled, and by rejection (the speculative sampler's own draws)
        # the smallest budget of each (by rejection, the draft's distributions are a line item of their own)
        mode = "flash-chain:3" + flags
        cfg = EngineConfig(context=CONTEXT, dram_budget=_min_budget(target, draft, mode)).with_mode(mode)
        a = trio.run(generate, cfg, target, draft, ids, params)[0]
        b = trio.run(generate, cfg, target, draft, ids, params)[0]
        assert a == b
        assert a != ar_tokens


def test_trees_accept_more_per_pass_than_chains_of_the_same_size(tiny_bundles):
    target, draft = tiny_bundles
    ids = tokenizer(target).encode(PROMPT)
    per_pass = {}
    for mode in ("flash-chain", "flash-tree"):
        cfg = EngineConfig(mode=mode, gamma=12, context=CONTEXT, dram_budget=24 * 2**20)
        per_pass[mode] = trio.run(generate, cfg, target, draft, ids)[1]["mean_accepted"]
    assert per_pass["flash-tree"] > per_pass["flash-chain"]


def test_sampled_tree_is_reproducible(tiny_bundles):
    target, draft = tiny_bundles
    ids = tokenizer(target).encode(PROMPT)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=9)
    for flags in ("", "+no-coupled"):
        cfg = EngineConfig(context=CONTEXT, dram_budget=24 * 2**20).with_mode("flash-tree:10" + flags)
        a = trio.run(generate, cfg, target, draft, ids, params)
        b = trio.run(generate, cfg, target, draft, ids, params)
        assert a[0] == b[0] and a[1]["passes"] == b[1]["passes"]


def run_lever(tiny_bundles, unrelated_draft, draft_kind: str, gamma: int, flags: str = "",
              params: SamplingParams = SamplingParams()):
    """lever (its defaults, or with the mode ``flags`` such as '+no-overlap') on the tiny target and a
    draft of ``draft_kind``: (draft, prompt ids, tokens, stats, pipeline)."""
    target = tiny_bundles[0]
    draft = {"perturbed": tiny_bundles[1], "exact": target, "unrelated": unrelated_draft}[draft_kind]
    ids = tokenizer(target).encode(PROMPT)
    cfg = EngineConfig(mode="lever", gamma=gamma, context=CONTEXT, dram_budget=24 * 2**20)
    if flags:
        cfg = cfg.with_mode(f"lever:{gamma}{flags}")
    return (draft, ids, *trio.run(generate, cfg, target, draft, ids, params))


def alternate_schedules(monkeypatch) -> None:
    """lever's schedule switches every pass (overlap, turns, overlap, ...), whatever it measures."""
    from lever_actors import driver
    from lever_actors.schedule import ScheduleChoice

    monkeypatch.setattr(ScheduleChoice, "_next", lambda self: "turns" if self.current == "overlap" else "overlap")
    monkeypatch.setattr(driver, "ScheduleChoice", lambda **kw: ScheduleChoice(block=1, **kw))


@pytest.mark.parametrize("draft_kind", ["perturbed", "exact", "unrelated"])
def test_lever_planned_trees_are_lossless(tiny_bundles, unrelated_draft, ar_tokens, draft_kind):
    _, _, toks, stats, pipe = run_lever(tiny_bundles, unrelated_draft, draft_kind, gamma=24)
    assert toks == ar_tokens
    assert stats["mean_tree_nodes"] is not None and 0 <= stats["mean_tree_nodes"] <= 24  # drafted nodes verified
    if draft_kind == "exact":  # every node is accepted: the planner learns that nodes pay
        assert stats["mean_tree_nodes"] >= 2
    assert pipe.lever.costs.ready and pipe.lever.calibration.seen.sum() > 0
    # the schedule rests on the overlap passes' reads and compute, as measured
    assert stats["schedule"]["compute_s"] > 0 and stats["schedule"]["reads_s"] >= 0


@pytest.mark.parametrize("mode,size", [("flash-chain", 3), ("lever", 12)])
@pytest.mark.parametrize("draft_kind", ["perturbed", "unrelated"])
def test_draft_cache_holds_exactly_the_committed_sequence(tiny_bundles, unrelated_draft, draft_kind, mode, size):
    """Whatever cross-step drafting guessed, the draft's committed KV rows are those of prompt + output.

    Losslessness cannot see a drafter that kept a wrong guess (the target corrects every token);
    this can: the rows must equal a plain prefill of the same tokens, bit for bit, including the
    rows lever's drafter drafted ahead under several outcomes and kept when one held.
    """
    import numpy as np

    from lever_actors.bundle import load_bundle
    from lever_actors.model import Transformer
    from lever_actors.ortrt import LaneConfig

    target = tiny_bundles[0]
    draft = {"perturbed": tiny_bundles[1], "unrelated": unrelated_draft}[draft_kind]
    ids = tokenizer(target).encode(PROMPT)
    cfg = EngineConfig(mode=mode, gamma=size, context=CONTEXT, dram_budget=24 * 2**20)
    toks, stats, pipe = trio.run(generate, cfg, target, draft, ids)
    assert stats["spec_hits"] + stats["spec_misses"] > 0
    d = pipe.drafter
    n = d.m.kv.length  # assumptions are never committed: only what a later request said was
    assert len(ids) <= n <= len(ids) + len(toks)
    ref = Transformer(load_bundle(draft), CONTEXT, LaneConfig(), requantize=d.m.requantize,
                      tiles=d.m.tiles)  # lever's draft is Q4_0 (in AMX tile strips where the CPU has them)
    ref.prefill((ids + toks)[:n])
    np.testing.assert_array_equal(d.m.kv.k[:, :, :n], ref.kv.k[:, :, :n])
    np.testing.assert_array_equal(d.m.kv.v[:, :, :n], ref.kv.v[:, :, :n])


def test_an_ort_layout_target_refuses_to_stream(tiny_ort_draft):
    """Only native layers compute from their read buffer; an ORT bundle says how to fix it."""
    from lever_actors.errors import ConfigError

    ort_bundle = tiny_ort_draft
    ids = tokenizer(ort_bundle).encode(PROMPT)
    cfg = EngineConfig(mode="flash-ar", context=CONTEXT, dram_budget=24 * 2**20)
    with pytest.raises(ConfigError, match="cannot stream from flash.*--layout native"):
        trio.run(generate, cfg, ort_bundle, None, ids)
    toks, _, _ = trio.run(generate, EngineConfig(mode="resident-ar", context=CONTEXT), ort_bundle, None, ids)
    assert toks  # resident, it runs


@pytest.mark.parametrize("mode,size,threshold", [("flash-chain", 5, None), ("flash-tree", 9, None),
                                                 ("lever", 24, None), ("lever", 24, 0.0)])
def test_static_token_buckets_pad_passes_without_changing_output(tiny_bundles, ar_tokens, mode, size, threshold):
    target, draft = tiny_bundles
    cfg = EngineConfig(mode=mode, gamma=size, context=CONTEXT, dram_budget=24 * 2**20, buckets=(1, 2, 4, 8, 16, 32),
                       prune_threshold=threshold, fixed_tree=threshold is not None)
    toks, stats, pipe = trio.run(generate, cfg, target, target if threshold is not None else draft,
                                 tokenizer(target).encode(PROMPT))
    assert toks == ar_tokens
    assert stats["padded_rows"] > 0  # some pass was not a power of two
    if threshold is not None:
        assert stats["dropped_nodes"] > 0  # survivors were re-padded to their own bucket


@pytest.mark.parametrize("buckets,gamma,match", [((1, 2, 4), 8, "largest token bucket"),
                                                 ((1, 2, 4, 8), 8, "largest token bucket")])
def test_buckets_that_cannot_hold_a_tree_are_refused(tiny_bundles, buckets, gamma, match):
    from lever_actors.errors import ConfigError

    target, draft = tiny_bundles
    cfg = EngineConfig(mode="flash-chain", gamma=gamma, context=CONTEXT, dram_budget=24 * 2**20, buckets=buckets)
    with pytest.raises(ConfigError, match=match):
        trio.run(generate, cfg, target, draft, [1, 2, 3])


@pytest.mark.parametrize("buckets", [(), (1, 2, 4, 8, 16, 32)], ids=["exact", "buckets"])
def test_target_cache_holds_exactly_the_committed_sequence_after_pruning(tiny_bundles, ar_tokens, buckets):
    """Pruning at two exits (and ghost rows of static buckets) must never touch a survivor's K/V:
    the target's committed rows equal a plain prefill of prompt + output, bit for bit."""
    import functools

    import numpy as np

    from lever_actors.bundle import load_bundle
    from lever_actors.model import Transformer
    from lever_actors.ortrt import LaneConfig

    target = tiny_bundles[0]
    ids = tokenizer(target).encode(PROMPT)
    cfg = EngineConfig(mode="lever", gamma=24, context=CONTEXT, dram_budget=24 * 2**20, prune_threshold=-0.05,
                       fixed_tree=True, buckets=buckets)
    toks, stats, pipe = trio.run(functools.partial(generate, cfg, target, target, ids, prune_exits=(0, 1)))
    assert toks == ar_tokens and stats["dropped_nodes"] > 0
    kv = pipe.target.kv
    n = kv.length  # prompt + every committed token but the last (the next root)
    ref = Transformer(load_bundle(target), CONTEXT, LaneConfig())
    ref.prefill((ids + toks)[:n])
    np.testing.assert_array_equal(kv.k[:, :, :n], ref.kv.k[:, :, :n])
    np.testing.assert_array_equal(kv.v[:, :, :n], ref.kv.v[:, :, :n])


def test_lane_threads_are_configuration(tiny_bundles, ar_tokens):
    target, draft = tiny_bundles
    cfg = EngineConfig(mode="flash-chain", gamma=3, context=CONTEXT, dram_budget=24 * 2**20, draft_threads=2)
    toks, _, pipe = trio.run(generate, cfg, target, draft, tokenizer(target).encode(PROMPT))
    assert toks == ar_tokens
    assert pipe.drafter.m.lane.threads == 2 and pipe.target.lane.threads == cfg.lane.threads == 1


def test_lanes_that_run_alone_take_every_core_by_default(monkeypatch):
    """With neither --threads nor --draft-threads, a lane that never runs beside the other takes every
    core: the target without a draft, and both lanes when they take turns (+no-overlap). Pipelined
    lanes keep one each (they lend idle cores per draft or pass), and given counts are kept."""
    import lever_actors.runtime as rt
    from lever_actors.cli import build_parser

    monkeypatch.setattr(rt, "available_cores", lambda: 4)

    def threads(*argv):
        args = build_parser().parse_args(["generate", "x", *argv])
        return rt.lane_threads(EngineConfig.from_args(args))

    assert threads("--mode", "resident-ar") == (4, 1)
    assert threads("--mode", "flash-ar") == (4, 1)
    assert threads("--mode", "flash-chain:8+no-overlap") == (4, 4)
    assert threads("--mode", "flash-chain:8") == (1, 1)
    assert threads("--mode", "lever") == (1, 1)
    assert threads("--mode", "flash-ar", "--threads", "2") == (2, 1)
    assert threads("--mode", "flash-chain:8+no-overlap", "--draft-threads", "3") == (1, 3)


@pytest.mark.parametrize("draft_kind", ["perturbed", "unrelated"])
def test_lever_with_prompt_lookup_branches_is_lossless(tiny_bundles, unrelated_draft, draft_kind):
    """A repetitive prompt gives the planner free n-gram nodes; whatever it verifies, the output is the target's."""
    target = tiny_bundles[0]
    draft = {"perturbed": tiny_bundles[1], "unrelated": unrelated_draft}[draft_kind]
    ids = tokenizer(target).encode("x = add(left, right)\n" * 4 + "x = add(")
    ref = trio.run(generate, EngineConfig(mode="resident-ar", context=CONTEXT), target, None, ids)[0]
    cfg = EngineConfig(mode="lever", gamma=12, context=CONTEXT, dram_budget=24 * 2**20)
    toks, stats, pipe = trio.run(generate, cfg, target, draft, ids)
    assert toks == ref
    assert stats["ngram_offered"] > 0  # the branch was offered (whether it pays is the cost model's call)
    seen = pipe.lever.ngram_calibration.seen.sum()  # what was verified of it is recorded on its own
    assert seen > 0 if stats["ngram_n"] > 0 else seen == 0
    off = trio.run(generate, cfg.with_mode("lever:12+no-ngram"), target, draft, ids)
    assert off[0] == ref and off[1]["ngram_n"] == 0


def test_expansion_depth_counts_the_levels_drafted():
    from types import SimpleNamespace

    from lever_actors.driver import expansion_depth

    assert expansion_depth(SimpleNamespace(parents=[])) == 0
    assert expansion_depth(SimpleNamespace(parents=[-1, -1, 0, 2, 1])) == 3  # root -> 0 -> 2 -> 3


def test_the_drafters_activations_are_planned_and_grow_with_the_context(tiny_bundles):
    """The drafter computes beside the verifier, so its peak (a prompt chunk's rows and their key
    orders over the context, a draft call's logits) is a line item of its own; left to the headroom
    it took a 3000-token prompt at a 4096-token context over a 768 MiB budget on the real pair."""
    from lever_actors.bundle import load_bundle
    from lever_actors.runtime import build_budget, draft_activation_bytes

    target, draft = (load_bundle(b) for b in tiny_bundles)
    plans = {ctx: build_budget(EngineConfig(mode="lever", gamma=8, context=ctx, dram_budget=None), target, draft, 0)
             for ctx in (256, 1024)}
    for ctx, plan in plans.items():
        assert plan.items["draft_activations"] == draft_activation_bytes(draft.dims, ctx)
    assert plans[1024].items["draft_activations"] > plans[256].items["draft_activations"]
    alone = build_budget(EngineConfig(mode="flash-ar", context=1024, dram_budget=None), target, None, 0)
    assert "draft_activations" not in alone.items


def test_sampling_by_rejection_plans_the_draft_distributions_it_keeps(tiny_bundles):
    """+no-coupled keeps a whole-vocabulary draft distribution per drafted node (the drafter's tree,
    its answer, the pass's copy): a line item of the plan, and only there."""
    from lever_actors.bundle import load_bundle
    from lever_actors.runtime import DRAFT_DIST_COPIES, build_budget, verify_rows

    target, draft = (load_bundle(b) for b in tiny_bundles)
    vocab = draft.dims["vocab_size"]
    for mode in ("lever:16+no-coupled", "flash-chain:4+no-coupled"):
        cfg = EngineConfig(context=CONTEXT, dram_budget=None).with_mode(mode)
        plan = build_budget(cfg, target, draft, 0)
        assert plan.items["draft_dists"] == DRAFT_DIST_COPIES * verify_rows(cfg)[1] * vocab * 4, mode
    for mode, d in (("lever:16", draft), ("flash-chain:4", draft), ("flash-ar+no-coupled", None)):
        assert "draft_dists" not in build_budget(EngineConfig(context=CONTEXT, dram_budget=None).with_mode(mode),
                                                 target, d, 0).items, mode


@pytest.mark.parametrize("context", [128, 1024])
@pytest.mark.parametrize("kind,rows", [("prompt chunk", 64), ("tree", 9)])
def test_a_native_layer_call_holds_no_more_than_the_plan_counts_a_row(tiny_bundles, context, kind, rows):
    """The plan's activations rest on ``layer_floats_per_row``: what one row of a native layer call
    holds at its peak, its key order and mask included (a tree's rows have their own). Traced from
    before the layout is built to the end of the call, the peak stays within the bound, and the
    bound is not loose by every head's scores. (The tiny target has the real target's Q4_K and
    Q6_K matrices; the tiny draft's F32 and F16 ones, which no real pair here has, take the
    headroom for a converted copy of the rows.)"""
    import tracemalloc

    import numpy as np

    from lever_actors.bundle import load_bundle
    from lever_actors.model import Transformer, attention_layout, causal_layout
    from lever_actors.ortrt import LaneConfig
    from lever_actors.runtime import layer_floats_per_row

    bundle = load_bundle(tiny_bundles[0])
    m = Transformer(bundle, context, LaneConfig(threads=2), resident_layers=[0], load_head=False)
    p0 = context - rows - 3
    slots = np.arange(p0, p0 + rows)
    x = np.random.default_rng(context + rows).standard_normal((rows, m.hidden)).astype(np.float32)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        layout = (causal_layout(context, p0, rows) if kind == "prompt chunk" else
                  attention_layout(context, p0, [[p0 + j for j in range(i // 3 * 3, i + 1)] for i in range(rows)]))
        y = m.run_layer(0, m.resident[0], x, m.feeds(slots, slots, layout), slots)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert y.shape == x.shape
    bound = rows * layer_floats_per_row(bundle.dims, context) * 4
    assert peak <= bound, (peak, bound)
    # counting every head's scores (and their exponentials and probabilities, as a layer graph of
    # ONNX Runtime holds them) would leave at least 9 floats a slot per row unheld, more than this:
    assert bound - peak < rows * 2 * bundle.dims["n_head"] * context * 4, (peak, bound)


def test_a_prompt_of_several_chunks_is_prefilled_in_place_and_exactly(tiny_bundles):
    """A streamed layer computes every chunk of a prompt before the next layer is read, each chunk's
    output overwriting its own input rows. Every layer's K/V rows of the prompt equal, bit for bit,
    those of the resident model, whose prefill takes each chunk through every layer before the next
    (the tiny pair's tokens alone would not show a wrong hidden row: its embeddings dominate)."""
    import numpy as np

    from lever_actors.bundle import load_bundle
    from lever_actors.model import FEED_CHUNK, Transformer
    from lever_actors.ortrt import LaneConfig

    target = tiny_bundles[0]
    ids = tokenizer(target).encode(PROMPT * 40)[: 2 * FEED_CHUNK + 37]
    assert len(ids) == 2 * FEED_CHUNK + 37  # three chunks, the last one short
    resident = Transformer(load_bundle(target), 256, LaneConfig())
    resident.prefill(ids)
    cfg = EngineConfig(mode="flash-ar", context=256, dram_budget=_min_budget(target, context=256))
    _, _, pipe = trio.run(generate, cfg, target, None, ids)
    assert pipe.plan.streamed
    n = len(ids)
    for mine, want in ((pipe.target.kv.k, resident.kv.k), (pipe.target.kv.v, resident.kv.v)):
        np.testing.assert_array_equal(mine[:, :, :n], want[:, :, :n])


@pytest.mark.parametrize("draft_kind", ["perturbed", "exact", "unrelated"])
def test_lever_taking_turns_is_lossless_and_verifies_on_both_lanes_cores(tiny_bundles, unrelated_draft, ar_tokens,
                                                                         draft_kind, monkeypatch):
    """lever's schedule switching every pass (overlap, turns, overlap, ...): the output is the target's,
    the draft's committed KV rows are exactly prompt + output, a turns pass drafts nothing ahead and
    verifies on the drafting lane's threads too, and each schedule keeps its own cost model."""
    import numpy as np

    from actors.npu_verify import NpuVerifier
    from lever_actors.bundle import load_bundle
    from lever_actors.model import Transformer
    from lever_actors.ortrt import LaneConfig

    alternate_schedules(monkeypatch)
    plans, started = [], []  # every plan, and the kernel threads each decode pass's layers started on
    verify, stages = NpuVerifier.verify, NpuVerifier._stages

    async def spy(self, plan):
        plans.append(plan)
        return await verify(self, plan)

    async def stages_spy(self, *a, **k):
        plan = a[5]
        if not plan.prefill:
            started.append(self.m.lane.threads)
        return await stages(self, *a, **k)

    monkeypatch.setattr(NpuVerifier, "verify", spy)
    monkeypatch.setattr(NpuVerifier, "_stages", stages_spy)
    draft, ids, toks, stats, pipe = run_lever(tiny_bundles, unrelated_draft, draft_kind, gamma=12)
    assert toks == ar_tokens
    assert stats["passes"] >= 2 and stats["turns_passes"] == stats["passes"] // 2
    assert stats["schedule"]["blocks"]["turns"] == stats["turns_passes"]
    # assumptions settled: the prefill's and those of overlap passes only (a turns pass drafts nothing ahead)
    assert stats["spec_hits"] + stats["spec_misses"] <= stats["passes"] - stats["turns_passes"] + 1
    both = pipe.target.lane.threads + pipe.drafter.threads
    assert [p.threads for p in plans if not p.prefill] == [0, both] * (stats["passes"] // 2) + [0] * (stats["passes"] % 2)
    assert started == [p.threads or pipe.target.lane.threads for p in plans if not p.prefill]  # the verifier obeys
    assert set(pipe.lever.others) == {"overlap" if pipe.lever.schedule == "turns" else "turns"}
    d = pipe.drafter
    n = d.m.kv.length
    ref = Transformer(load_bundle(draft), CONTEXT, LaneConfig(), requantize=d.m.requantize,
                      tiles=d.m.tiles)  # lever's draft is Q4_0 (in AMX tile strips where the CPU has them)
    ref.prefill((ids + toks)[:n])
    np.testing.assert_array_equal(d.m.kv.k[:, :, :n], ref.kv.k[:, :, :n])


@pytest.mark.parametrize("draft_kind", ["perturbed", "unrelated"])
def test_lever_sampling_by_rejection_draws_the_same_tokens_whichever_schedule_runs(tiny_bundles, unrelated_draft, draft_kind,
                                                                     monkeypatch):
    """Lever sampling by rejection chooses its schedule too: a tree drafted ahead under the outcome that
    held is the tree drafted after the commit (the sampled rule is timing-free, draws are seeded by step
    and node), so a seeded run draws the same tokens whether it always drafts ahead, always takes turns,
    or switches. (Coupled sampling: test_coupled_sampling_commits_the_tokens_the_target_draws_alone...)"""
    # a sampled guess ahead holds in a few of the tiny perturbed pair's ~23 passes: a seed whose run with
    # overlap verifies some with either draft arithmetic (AMX tile strips, 3 of 22; the pairs, 4 of 23)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=4)

    def run(flags=""):  # (tokens, stats)
        return run_lever(tiny_bundles, unrelated_draft, draft_kind, 12, flags + "+no-coupled", params)[2:4]

    overlap, turns = run("+no-auto-schedule"), run("+no-overlap")
    alternate_schedules(monkeypatch)
    switching = run()
    assert overlap[0] == turns[0] == switching[0]
    assert overlap[1]["spec_hits"] > 0 or draft_kind == "unrelated"  # trees drafted ahead were verified
    assert overlap[1]["turns_passes"] == 0 and switching[1]["passes"] >= 2
    assert switching[1]["turns_passes"] == switching[1]["passes"] // 2


@pytest.mark.parametrize("draft_kind", ["perturbed", "exact", "unrelated"])
def test_coupled_sampling_commits_the_tokens_the_target_draws_alone_in_every_mode(tiny_bundles, unrelated_draft,
                                                                                   draft_kind, monkeypatch):
    """Sampled runs sample coupled by default: every mode, every schedule and every tree commit the
    tokens resident-ar draws with the same seed, token for token; and a draft that is the target,
    drafting under the same noise, has every token of its chains accepted."""
    target = tiny_bundles[0]
    draft = {"perturbed": tiny_bundles[1], "exact": target, "unrelated": unrelated_draft}[draft_kind]
    ids = tokenizer(target).encode(PROMPT)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5)
    ref = trio.run(generate, EngineConfig(mode="resident-ar", context=CONTEXT), target, None, ids, params)[0]
    from lever_actors.bundle import load_bundle
    from lever_actors.decode import decode_resident
    from lever_actors.model import Transformer
    from lever_actors.ortrt import LaneConfig

    plain = Transformer(load_bundle(target), CONTEXT, LaneConfig())  # plain decoding, outside the pipeline
    assert decode_resident(plain, ids, TOKENS, params, set(tokenizer(target).eos_ids)).token_ids == ref
    assert ref != trio.run(generate, EngineConfig(mode="resident-ar", context=CONTEXT), target, None, ids,
                           SamplingParams(temperature=0.8, top_p=0.95, seed=6))[0]
    base = EngineConfig(context=CONTEXT, dram_budget=24 * 2**20)
    for mode in ("flash-ar", "flash-chain:4", "flash-chain:4+no-overlap", "flash-tree:10", "lever:12",
                 "lever:12+no-overlap", "lever:12+no-auto-schedule", "lever:12+fixed-tree"):
        toks, stats, _ = trio.run(generate, base.with_mode(mode), target, draft, ids, params)
        assert toks == ref, mode
        if draft_kind == "exact" and mode.startswith("flash-chain"):
            assert stats["draft_n_accepted"] == stats["draft_n"] > 0, mode
            # and every next token assumed ahead (the draft's best under that position's noise) held
            assert "no-overlap" in mode or (stats["spec_misses"] == 0 and stats["spec_hits"] > 0), mode
    alternate_schedules(monkeypatch)
    toks, stats = run_lever(tiny_bundles, unrelated_draft, draft_kind, 12, "", params)[2:4]
    assert toks == ref and stats["turns_passes"] == stats["passes"] // 2
    # rejection sampling draws another sequence (valid too: tests/test_sampling.py)
    assert trio.run(generate, base.with_mode("lever:12+no-coupled"), target, draft, ids, params)[0] != ref


def test_lever_without_auto_schedule_always_drafts_ahead(tiny_bundles, ar_tokens):
    target, draft = tiny_bundles
    ids = tokenizer(target).encode(PROMPT)
    cfg = EngineConfig(mode="lever", gamma=12, context=CONTEXT, dram_budget=24 * 2**20).with_mode("lever:12+no-auto-schedule")
    assert cfg.mode_string() == "lever:12+no-auto-schedule"
    toks, stats, pipe = trio.run(generate, cfg, target, draft, ids)
    assert toks == ar_tokens and stats["turns_passes"] == 0 and "schedule" not in stats


def test_greedy_and_coupled_requests_on_one_pipeline_keep_their_own_acceptance_records(tiny_bundles, ar_tokens):
    """A daemon's pipeline serves greedy and sampled requests in turn: each is planned with its own
    sampler's records, and neither changes the other's output."""
    target, draft = tiny_bundles
    ids = tokenizer(target).encode(PROMPT)
    cfg = EngineConfig(mode="lever", gamma=12, context=CONTEXT, dram_budget=24 * 2**20)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=5)

    async def main():
        async with open_pipeline(cfg, target, draft, set(tokenizer(target).eos_ids)) as pipe:
            async def emit(_):
                return False
            out, seen = [], []
            for p in (SamplingParams(), sampled, SamplingParams()):
                out.append((await pipe.generate(ids, TOKENS, p, emit))[0])
                records = {pipe.lever.sampler: pipe.lever.calibration}
                records.update({k: v[0] for k, v in pipe.lever.other_calibrations.items()})
                seen.append({k: cal.seen.sum() for k, cal in records.items()})
            return out, pipe.lever, seen

    (greedy, coupled, again), lever, seen = trio.run(main)
    # each request wrote only its own sampler's record (how much it wrote depends on timings: a
    # slow host may plan drafts of no node at all for a while)
    assert seen[0]["greedy"] > 0 and seen[1]["greedy"] == seen[0]["greedy"]
    assert seen[1]["coupled"] > 0 and seen[2]["coupled"] == seen[1]["coupled"]
    alone = trio.run(generate, EngineConfig(mode="resident-ar", context=CONTEXT), target, None, ids, sampled)[0]
    assert greedy == again == ar_tokens and coupled == alone
    assert lever.sampler == "greedy"


def test_a_sampled_lever_pass_verifies_no_more_nodes_than_the_budget_plans_for(tiny_bundles, monkeypatch):
    """A sampled pass holds its rows' whole logits, and the DRAM budget plans SAMPLED_MAX_NODES of them
    (runtime.verify_rows): coupled lever's planned trees stay inside that, where greedy ones with the
    same sure draft grow past it."""
    import lever_actors.driver
    from lever_actors.runtime import verify_rows
    from protocols import VerifyPlan

    target = tiny_bundles[0]
    ids = tokenizer(target).encode(PROMPT)
    cfg = EngineConfig(mode="lever", gamma=32, context=CONTEXT, dram_budget=24 * 2**20)
    cap = lever_actors.driver.SAMPLED_MAX_NODES
    assert verify_rows(cfg) == (33, cap + 1)
    rows = {}
    for name, params in (("greedy", SamplingParams()), ("coupled", SamplingParams(0.8, 0.95, 5))):
        plans = _recording(monkeypatch, VerifyPlan, lever_actors.driver)
        trio.run(generate, cfg, target, target, ids, params)  # the draft is the target: every node pays
        rows[name] = max(len(p.tokens) for p in plans if not p.prefill)
    assert rows["coupled"] <= cap + 1 < rows["greedy"]


def on_one_pipeline(cfg, target, draft, body):
    """``await body(pipe)`` on one pipeline, failing rather than hanging when a request never ends."""
    async def main():
        with trio.fail_after(120):
            async with open_pipeline(cfg, target, draft, set(tokenizer(target).eos_ids)) as pipe:
                return await body(pipe)

    return trio.run(main)


async def never_stop(_):
    return False


async def stop_at_once(_):
    return True


@pytest.mark.parametrize("mode", ["lever:16", "flash-chain:3", "flash-chain:3+no-overlap"])
@pytest.mark.parametrize("ending", ["length", "caller stop"])
def test_generations_that_end_at_their_first_token_leave_the_drafter_free(tiny_bundles, ar_tokens, mode, ending):
    """A generation whose prefill commit already ends it (max_tokens 1, or a stop string in the first
    token) still collects the drafter's answer to the prefill: left in the one-message channels, three
    such requests in a row held the drafter in a send and the fourth request waited for ever."""
    target, draft = tiny_bundles
    ids = tokenizer(target).encode(PROMPT)

    async def body(pipe):
        for _ in range(6):
            n, emit = (1, never_stop) if ending == "length" else (TOKENS, stop_at_once)
            assert (await pipe.generate(ids, n, SamplingParams(), emit))[0] == ar_tokens[:1]
        return (await pipe.generate(ids, TOKENS, SamplingParams(), never_stop))[0], pipe.stale

    toks, stale = on_one_pipeline(EngineConfig(context=CONTEXT, dram_budget=24 * 2**20).with_mode(mode),
                                  target, draft, body)
    assert toks == ar_tokens
    assert stale == 0  # every answer was taken by the generation that asked for it


def test_a_request_refused_for_its_length_does_not_abort_the_next_one(tiny_bundles, ar_tokens):
    """The context check comes before the session begins: an Abort for a refused request named the
    next session, whose prefill the verifier then dropped, and its caller waited for ever."""
    from lever_actors.driver import request_room
    from lever_actors.errors import ContextOverflow

    target, draft = tiny_bundles
    ids = tokenizer(target).encode(PROMPT)
    cfg = EngineConfig(context=CONTEXT, dram_budget=24 * 2**20).with_mode("lever:16")
    room = request_room(cfg)

    async def body(pipe):
        with pytest.raises(ContextOverflow, match=f"{room} left for a request"):
            await pipe.generate(ids, room - len(ids) + 1, SamplingParams(), never_stop)
        toks = (await pipe.generate(ids, TOKENS, SamplingParams(), never_stop))[0]
        # the room the daemon admits is room the pipeline runs
        return toks, len((await pipe.generate(ids, room - len(ids), SamplingParams(), never_stop))[0])

    toks, full = on_one_pipeline(cfg, target, draft, body)
    assert toks == ar_tokens
    assert 1 <= full <= room - len(ids)

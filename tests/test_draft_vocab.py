"""The draft's vocabulary subset: exact logits on its columns, lossless speculation, exact sampling."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import trio

from lever_actors.bundle import load_bundle
from lever_actors.draft_vocab import BUNDLE_FILE, SubsetHead, coverage, load_subset, save_subset, subset_for
from lever_actors.engine import EngineConfig
from lever_actors.model import Transformer
from lever_actors.ortrt import LaneConfig
from lever_actors.sampling import SamplingParams, accept_sampled
from lever_actors.tokenizer import load_tokenizer

PROMPT = "def add(left, right):\n    return"
CONTEXT = 160


@pytest.fixture(scope="module")
def trimmed_draft(tiny_bundles, tmp_path_factory):
    """The tiny draft with a subset of half its vocabulary: its top choice is often missing."""
    out = tmp_path_factory.mktemp("trimmed") / "draft.bundle"
    shutil.copytree(tiny_bundles[1], out)
    b = load_bundle(out)
    vocab = b.dims["vocab_size"]
    ids = np.arange(0, vocab, 2, dtype=np.int32)
    save_subset(out / BUNDLE_FILE, ids, vocab, {"coverage_generated": 0.5})
    return out


def test_subset_round_trips_through_its_file(tmp_path):
    ids = np.array([0, 5, 17, 999], np.int32)
    save_subset(tmp_path / "s.npz", ids, 1000, {"size": 4})
    back, meta = load_subset(tmp_path / "s.npz")
    np.testing.assert_array_equal(back, ids)
    assert meta == {"size": 4}
    assert coverage(ids, [0, 5, 6, 7]) == 0.5


def test_subset_logits_equal_the_full_heads_bit_for_bit(trimmed_draft):
    b = load_bundle(trimmed_draft)
    ids, _, _ = subset_for(b)
    full = Transformer(b, 32, LaneConfig())
    head = SubsetHead(b, ids, LaneConfig())
    h = np.random.default_rng(0).normal(0, 1, (3, b.dims["hidden"])).astype(np.float32)
    ref = full.logits(h)
    np.testing.assert_array_equal(head.logits(h), ref[:, ids])
    head.set_prompt([1, 3, 3, 4, 2**31 - 1])  # odd ids are outside the subset; out-of-vocabulary ids are ignored
    assert list(head.ids[len(ids):]) == [1, 3]
    np.testing.assert_array_equal(head.logits(h), ref[:, head.ids])
    head.set_prompt([0, 2])  # all inside: no extra rows
    assert head.extra is None and len(head.ids) == len(ids)
    assert head.nbytes <= b.head_bytes()  # the subset and the largest prompt extra: at most the whole head


def test_a_requantized_subset_head_scores_its_rows_as_q4_0(trimmed_draft):
    """Lever's Q4_0 draft: the subset's rows and the prompt's extra rows are requantized (and repacked
    where the build reads Q4_0 in pairs), giving the same bits as the Q4_0 rows of the stored head,
    in the DRAM its plan charges."""
    from lever_actors import kernels

    b = load_bundle(trimmed_draft)
    ids, _, _ = subset_for(b)
    stored, q4 = SubsetHead(b, ids, LaneConfig()), SubsetHead(b, ids, LaneConfig(), requantize=True)
    assert stored.base.qtype == "Q8_0" and q4.base.qtype in ("Q4_0", "Q4_0R")
    tiled = SubsetHead(b, ids, LaneConfig(), requantize=True, tiles=True)  # AMX strips (any build computes them)
    assert tiled.base.qtype == ("Q4_0T" if len(ids) % kernels.TILE_ROWS == 0 else q4.base.qtype)
    h = np.random.default_rng(1).normal(0, 1, (3, b.dims["hidden"])).astype(np.float32)
    for prompt in ([0, 2], [1, 3, 3, 4]):  # no extra rows, then two
        stored.set_prompt(prompt)
        q4.set_prompt(prompt)
        assert list(q4.ids) == list(stored.ids)
        ref = SubsetHead.__new__(SubsetHead)  # the stored rows, requantized but never repacked
        ref.__dict__.update(stored.__dict__, base=kernels.requantized_q4_0(stored.base),
                            extra=stored.extra and kernels.requantized_q4_0(stored.extra))
        np.testing.assert_array_equal(q4.logits(h), ref.logits(h))
        tiled.set_prompt(prompt)
        ref.__dict__.update(base=kernels.for_draft_cpu(ref.base, True))  # the tiles' own arithmetic
        np.testing.assert_array_equal(tiled.logits(h), ref.logits(h))
        assert not np.array_equal(q4.logits(h), stored.logits(h))  # the rows did change
    q4_rows = len(ids) + min(4096, b.dims["vocab_size"] - len(ids))
    assert q4.columns == stored.columns == q4_rows
    assert q4.nbytes == q4_rows * kernels.row_bytes("Q4_0", b.dims["hidden"]) + q4.norm.nbytes < stored.nbytes


async def _generate(cfg, target, draft, ids, params):
    from lever_actors.runtime import open_pipeline

    eos = set(load_tokenizer(target).eos_ids)
    async with open_pipeline(cfg, target, draft, eos) as pipe:
        async def emit(_):
            return False
        toks, _, stats = await pipe.generate(ids, 40, params, emit)
        return toks, stats, pipe.describe(), pipe.drafter


def test_the_baselines_keep_the_full_head(tiny_bundles, trimmed_draft):
    target = tiny_bundles[0]
    ids = load_tokenizer(target).encode(PROMPT)
    cfg = EngineConfig(mode="flash-chain", gamma=3, context=CONTEXT, dram_budget=24 * 2**20)
    _, _, plan, drafter = trio.run(_generate, cfg, target, trimmed_draft, ids, SamplingParams())
    assert drafter.head.ids is None and plan["draft_vocab"].startswith("full (the baselines")


def test_a_baseline_whose_full_head_does_not_fit_drafts_over_the_subset(tiny_bundles, trimmed_draft):
    """A long context can leave no room for the draft's full head (the real pair at --context 4096
    in 768 MiB): the baselines then run with the subset, say so in the plan, and stay lossless."""
    from lever_actors.errors import BudgetError

    target = tiny_bundles[0]
    ids = load_tokenizer(target).encode(PROMPT)
    cfg = EngineConfig(mode="flash-chain", gamma=3, context=CONTEXT, dram_budget=1)
    with pytest.raises(BudgetError) as full:  # the same draft without a subset: the full head's minimum
        trio.run(_generate, cfg, target, tiny_bundles[1], ids, SamplingParams())
    with pytest.raises(BudgetError) as trimmed:
        trio.run(_generate, cfg, target, trimmed_draft, ids, SamplingParams())
    assert trimmed.value.minimum < full.value.minimum
    ref = trio.run(_generate, EngineConfig(mode="resident-ar", context=CONTEXT), target, None, ids, SamplingParams())[0]
    tight = EngineConfig(mode="flash-chain", gamma=3, context=CONTEXT, dram_budget=full.value.minimum - 1)
    toks, stats, plan, drafter = trio.run(_generate, tight, target, trimmed_draft, ids, SamplingParams())
    assert toks == ref and stats["draft_n"] > 0
    assert isinstance(drafter.head, SubsetHead) and plan["draft_vocab"].startswith("the full head does not fit")
    roomy = EngineConfig(mode="flash-chain", gamma=3, context=CONTEXT, dram_budget=full.value.minimum + 2**20)
    assert trio.run(_generate, roomy, target, trimmed_draft, ids, SamplingParams())[3].head.ids is None


def test_levers_q4_0_draft_takes_its_subset_head_along_and_its_plan_charges_it(tiny_bundles, trimmed_draft):
    """With a subset head, lever's Q4_0 draft (AVX-512 builds) requantizes the head's rows as well as
    its layers; the plan charges both at Q4_0, and the drafter's logits over the head's columns,
    not the whole vocabulary. The output stays the target's."""
    from lever_actors import kernels
    from lever_actors.model import requantized_bytes
    from lever_actors.runtime import DRAFT_CALL_ROWS, draft_activation_bytes, open_pipeline

    target = tiny_bundles[0]
    ids = load_tokenizer(target).encode(PROMPT)
    ref = trio.run(_generate, EngineConfig(mode="resident-ar", context=CONTEXT), target, None, ids, SamplingParams())[0]
    b = load_bundle(trimmed_draft)

    async def run(mode):
        cfg = EngineConfig(context=CONTEXT, dram_budget=24 * 2**20).with_mode(mode)
        async with open_pipeline(cfg, target, trimmed_draft, set(load_tokenizer(target).eos_ids)) as pipe:
            async def emit(_):
                return False
            toks, _, _ = await pipe.generate(ids, 40, SamplingParams(), emit)
            return toks, dict(pipe.plan.items), pipe.drafter.head

    # a draft call's logits span the head's columns (the tiny subset and its extras cover the whole vocabulary)
    full = draft_activation_bytes(b.dims, CONTEXT)
    assert full - draft_activation_bytes(b.dims, CONTEXT, 10) == DRAFT_CALL_ROWS * (b.dims["vocab_size"] - 10) * 4
    got = {mode: trio.run(run, mode) for mode in ("lever", "lever+no-draft-q4")}
    for toks, items, head in got.values():
        assert toks == ref
        assert items["draft_activations"] == draft_activation_bytes(b.dims, CONTEXT, head.columns)
    (_, q4_items, q4_head), (_, items, head) = got["lever"], got["lever+no-draft-q4"]
    assert head.base.qtype == "Q8_0"
    if kernels.simd() != "avx512-vnni":
        assert q4_head.base.qtype == "Q8_0" and q4_items["draft_weights"] == items["draft_weights"]
        return
    assert q4_head.base.qtype == ("Q4_0T" if kernels.amx() else "Q4_0R")  # AMX tile strips where the CPU has them
    layers = sum(r.nbytes - requantized_bytes(r) for r in b.layers)
    assert items["draft_weights"] - q4_items["draft_weights"] == layers + head.nbytes - q4_head.nbytes > layers


@pytest.mark.parametrize("mode", ["lever:12", "lever:5+no-adaptive-depth", "lever:8+fixed-tree", "lever:8+no-core-borrow"])
def test_greedy_speculation_with_a_subset_head_equals_resident_ar(tiny_bundles, trimmed_draft, mode):
    target = tiny_bundles[0]
    ids = load_tokenizer(target).encode(PROMPT)
    ref = trio.run(_generate, EngineConfig(mode="resident-ar", context=CONTEXT), target, None, ids, SamplingParams())[0]
    cfg = EngineConfig(context=CONTEXT, dram_budget=24 * 2**20).with_mode(mode)
    toks, stats, plan, drafter = trio.run(_generate, cfg, target, trimmed_draft, ids, SamplingParams())
    assert toks == ref
    assert isinstance(drafter.head, SubsetHead) and "tokens + the prompt's" in plan["draft_vocab"]
    assert stats["draft_n"] > 0
    full = trio.run(_generate, cfg.with_mode(mode + "+no-vocab-trim"), target, trimmed_draft, ids, SamplingParams())
    assert full[0] == ref and full[2]["draft_vocab"].startswith("full")


def test_the_subset_drafter_proposes_only_subset_and_prompt_tokens(tiny_bundles, trimmed_draft):
    from lever_actors.runtime import open_pipeline
    from protocols import DraftRequest

    target = tiny_bundles[0]
    ids = load_tokenizer(target).encode(PROMPT)
    cfg = EngineConfig(mode="lever", gamma=12, context=CONTEXT, dram_budget=24 * 2**20)

    async def main():
        async with open_pipeline(cfg, target, trimmed_draft, set()) as pipe:
            d = pipe.drafter
            (exp,) = d.draft(DraftRequest(session_id=1, step=1, epoch=0, root_token=ids[-1], position=len(ids) - 1,
                                       max_nodes=12, max_depth=3, top_k=3, committed=tuple(ids), reset=True))
            return exp, set(d.head.ids.tolist())

    exp, allowed = trio.run(main)
    assert len(exp.tokens) > 0
    assert set(exp.tokens.tolist()) <= allowed
    assert set(ids) <= allowed  # the prompt's own tokens are scored too


def test_sampled_speculation_with_a_subset_head_is_reproducible_and_valid(tiny_bundles, trimmed_draft):
    target = tiny_bundles[0]
    ids = load_tokenizer(target).encode(PROMPT)
    cfg = EngineConfig(mode="lever", gamma=6, context=CONTEXT, dram_budget=24 * 2**20)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3)
    a = trio.run(_generate, cfg, target, trimmed_draft, ids, params)
    b = trio.run(_generate, cfg, target, trimmed_draft, ids, params)
    assert a[0] == b[0] and len(a[0]) > 0


def test_a_draft_without_mass_off_its_subset_still_gives_the_target_distribution():
    """The subset draft reports zero probability off the subset and samples from exactly that:
    rejection sampling then hands the target's whole distribution back, off-subset tokens included."""
    rng = np.random.default_rng(5)
    vocab = 6
    q = rng.dirichlet(np.ones(vocab))  # target: mass on every token
    p = np.zeros(vocab)
    p[[0, 2, 3]] = rng.dirichlet(np.ones(3))  # draft: the subset {0, 2, 3} only
    firsts = []
    for step in range(20000):
        x = int(np.random.default_rng([7, step]).choice(vocab, p=p))
        _, committed = accept_sampled(np.array([-1, 0]), np.array([0, x]), [p, None], [q, q], seed=8, step=step)
        firsts.append(committed[0])
    hist = np.bincount(firsts, minlength=vocab) / len(firsts)
    assert 0.5 * np.abs(hist - q).sum() < 0.015
    assert hist[1] > 0 and hist[4] > 0  # tokens the draft can never propose still come out

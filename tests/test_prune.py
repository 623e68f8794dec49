"""Early-exit pruning: the mask's invariants, the score against a float64 reference, exact miss
counting, and lossless lever output through the real pruner actor at any threshold."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from lever_actors.engine import EngineConfig
from lever_actors.errors import ConfigError
from lever_actors.prune import HeadRows, directly_pruned, lens_margins, misses, predict_outcome, prune_mask
from lever_actors.sampling import accept_greedy
from test_runtime import CONTEXT, PROMPT, generate, tokenizer


@st.composite
def trees(draw, max_nodes: int = 24):
    n = draw(st.integers(1, max_nodes))
    parents = np.array([-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)], np.int64)
    margins = {i: draw(st.floats(-5, 5)) for i in range(1, n) if draw(st.booleans())}
    alive = np.ones(n, bool)  # what earlier exits left: a mask is itself ancestor-closed
    return parents, margins, alive


def _ancestor_closed(parents, keep) -> bool:
    return bool(keep[0]) and all(not keep[i] or keep[parents[i]] for i in range(1, len(parents)))


@given(trees(), st.floats(-6, 6) | st.none())
def test_mask_keeps_the_root_is_ancestor_closed_and_drops_low_margins(tree, threshold):
    parents, margins, alive = tree
    keep = prune_mask(parents, alive, margins, threshold)
    assert _ancestor_closed(parents, keep)
    if threshold is None:
        assert keep.all()  # scoring only (calibration) never prunes
        return
    for i in range(1, len(parents)):
        if keep[parents[i]]:
            assert keep[i] == (margins.get(i, np.inf) >= threshold)
        else:
            assert not keep[i]  # a pruned node takes its subtree along


@given(trees(), st.floats(-6, 6), st.floats(-6, 6))
def test_a_higher_threshold_prunes_a_superset(tree, t1, t2):
    parents, margins, alive = tree
    lo, hi = sorted((t1, t2))
    assert np.all(prune_mask(parents, alive, margins, hi) <= prune_mask(parents, alive, margins, lo))


@given(trees(), st.floats(-6, 6), st.floats(-6, 6))
def test_a_second_exit_never_revives_a_node(tree, t1, t2):
    parents, margins, alive = tree
    first = prune_mask(parents, alive, margins, t1)
    second = prune_mask(parents, first, {k: -v for k, v in margins.items()}, t2)
    assert np.all(second <= first) and _ancestor_closed(parents, second)


@given(trees(), st.floats(-6, 6))
def test_directly_pruned_nodes_are_the_roots_of_the_dropped_subtrees(tree, threshold):
    parents, margins, alive = tree
    keep = prune_mask(parents, alive, margins, threshold)
    direct = set(directly_pruned(parents, alive, keep).tolist())
    for i in range(1, len(parents)):
        if not keep[i]:  # every dropped node has exactly one directly pruned ancestor-or-self
            chain, v = [], i
            while v > 0 and not keep[v]:
                chain.append(v)
                v = parents[v]
            assert len(direct.intersection(chain)) == 1 and chain[-1] in direct


def test_misses_count_only_pruned_nodes_the_target_would_have_taken():
    # root 0 -> 1 -> 3 (accepted path 0, 1), 0 -> 2, 1 -> 4
    parents = np.array([-1, 0, 0, 1, 1])
    tokens = np.array([10, 11, 12, 13, 14])
    argmax = np.array([11, 14, -1, -1, -1])  # after node 1 the target wants 14 (node 4)
    assert misses(parents, tokens, argmax, [0, 1], [4]) == 1  # node 4 would have been accepted
    assert misses(parents, tokens, argmax, [0, 1], [2, 3]) == 0  # 2 is off-path, 3 is not the target's token
    # node 5 under the rejected node 2 carries the token the target wanted after 2: not a miss,
    # since 2 itself was not accepted
    parents, tokens = np.append(parents, 2), np.append(tokens, 15)
    argmax = np.array([11, 14, 15, -1, -1, -1])
    assert misses(parents, tokens, argmax, [0, 1], [5]) == 0


def test_lens_margins_match_a_float64_reference(tiny_bundles):
    from lever_actors.bundle import load_bundle
    from lever_actors.quant import dequantize_rows

    bundle = load_bundle(tiny_bundles[0])
    rows = HeadRows(bundle, cache_rows=3)  # a tiny cache: evictions are exercised too
    try:
        # the full head, dequantized independently, slice by slice
        full = []
        for region in bundle.head_chunks:
            from lever_actors.bundle import read_region
            from gguf import GGMLQuantizationType as QT

            spec = region.mats["output"]
            full.append(dequantize_rows(region.views(read_region(bundle, region))["output.data"], QT[spec["qtype"]],
                                        spec["k"]))
        head = np.concatenate(full).astype(np.float64)
        vocab = head.shape[0]
        rng = np.random.default_rng(0)
        hidden = rng.standard_normal((4, head.shape[1])).astype(np.float32)
        parents = np.array([-1, 0, 0, 1])
        tokens = rng.integers(0, vocab, 4)
        alts = rng.integers(0, vocab, (4, 3)).astype(np.int32)
        alts[0, 0] = tokens[1]  # a node that is one of its parent's alternatives is not its own rival
        nodes = np.array([1, 2, 3])
        got = lens_margins(hidden, {0: 0, 1: 1, 2: 2, 3: 3}, parents, tokens, alts, rows, rows.norm, 1e-6, nodes)
        h = hidden.astype(np.float64)
        z = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6) * rows.norm.astype(np.float64)
        for j, v in enumerate(nodes):
            lens = head @ z[parents[v]]
            rivals = [c for c in alts[parents[v]] if c != tokens[v]]
            assert got[j] == pytest.approx(lens[tokens[v]] - max(lens[c] for c in rivals), rel=1e-9, abs=1e-9)
        # a parent whose only alternative is the node's own token offers no rival: never pruned
        lone = alts.copy()
        lone[1] = tokens[3]
        got = lens_margins(hidden, {0: 0, 1: 1, 2: 2, 3: 3}, parents, tokens, lone, rows, rows.norm, 1e-6, nodes)
        assert got[2] == np.inf and np.isfinite(got[:2]).all()
        assert len(rows.cache) <= 3
        with pytest.raises(ValueError, match="outside the vocabulary"):
            rows([vocab])
    finally:
        rows.close()


@st.composite
def lens_trees(draw):
    """A drafted tree (unique tokens per parent), the draft's top tokens after each node (a leaf
    never expanded lists only its own token), exit hidden rows and LM-head rows."""
    n = draw(st.integers(1, 10))
    vocab, width = 12, 6
    parents = np.array([-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)], np.int64)
    tokens = np.zeros(n, np.int32)
    tokens[0] = draw(st.integers(0, vocab - 1))
    used: dict[int, set] = {}
    for i in range(1, n):
        free = sorted(set(range(vocab)) - used.setdefault(int(parents[i]), set()))
        tokens[i] = draw(st.sampled_from(free))
        used[int(parents[i])].add(int(tokens[i]))
    alts = np.zeros((n, 3), np.int32)
    for i in range(n):
        expanded = i in used or draw(st.booleans())
        alts[i] = draw(st.lists(st.integers(0, vocab - 1), min_size=3, max_size=3, unique=True)) if expanded \
            else tokens[i]
    seed = draw(st.integers(0, 2**16))
    return parents, tokens, alts, seed, vocab, width


@settings(max_examples=200, deadline=None)
@given(lens_trees())
def test_the_predicted_outcome_is_greedy_acceptance_under_the_lens(tree):
    """The prediction walks the tree as greedy acceptance would if the target's choice after each node
    were the lens's best token among that node's candidates (its children and the draft's top tokens):
    checked against ``accept_greedy``, the acceptor's own rule."""
    parents, tokens, alts, seed, vocab, width = tree
    rng = np.random.default_rng(seed)
    n = len(parents)
    hidden = rng.normal(size=(n, width)).astype(np.float32)
    head = rng.normal(size=(vocab, width)).astype(np.float32)
    norm_w = rng.uniform(0.5, 1.5, width).astype(np.float32)
    path, nxt = predict_outcome(hidden, {i: i for i in range(n)}, parents, tokens, alts, lambda ids: head[list(ids)],
                                norm_w, 1e-6, np.ones(n, bool))
    z = hidden.astype(np.float64)
    z = z / np.sqrt(np.mean(z * z, axis=-1, keepdims=True) + 1e-6) * norm_w
    lens = z @ head.astype(np.float64).T
    argmax = np.full(n, -1)
    for i in range(n):
        kids = [int(tokens[c]) for c in range(1, n) if parents[c] == i]
        expanded = any(int(t) != int(tokens[i]) for t in alts[i])
        cands = kids + ([int(t) for t in alts[i]] if expanded else [])
        if cands:
            argmax[i] = max(cands, key=lambda t: lens[i, t])
    accepted, committed = accept_greedy(parents, tokens, argmax)
    assert path == tuple(committed[:-1])
    end = accepted[-1]
    expanded = any(int(t) != int(tokens[end]) for t in alts[end])
    assert nxt == (committed[-1] if expanded else -1)


def test_head_rows_need_a_native_head(tiny_ort_draft):
    from lever_actors.bundle import load_bundle

    with pytest.raises(ConfigError, match="native layout"):
        HeadRows(load_bundle(tiny_ort_draft))


@pytest.fixture(scope="module")
def ar_tokens(tiny_bundles):
    target = tiny_bundles[0]
    cfg = EngineConfig(mode="resident-ar", context=CONTEXT)
    return trio.run(generate, cfg, target, None, tokenizer(target).encode(PROMPT))[0]


@settings(max_examples=6, deadline=None)
@given(threshold=st.floats(-3, 3) | st.sampled_from([-1e9, 1e9]), layer=st.integers(0, 1),
       fixed=st.booleans(), exact=st.booleans())
def test_lever_with_pruning_equals_resident_ar_at_any_threshold(tiny_bundles, ar_tokens, threshold, layer, fixed,
                                                                exact):
    target, draft = tiny_bundles
    cfg = EngineConfig(mode="lever", gamma=24, context=CONTEXT, dram_budget=24 * 2**20, prune_threshold=threshold,
                       prune_layer=layer, fixed_tree=fixed)
    toks, stats, pipe = trio.run(generate, cfg, target, target if exact else draft, tokenizer(target).encode(PROMPT))
    assert toks == ar_tokens
    assert pipe.prune_exits == (layer,) and "given" in pipe.prune_note
    assert stats["pruned_wrong"] <= stats["pruned_nodes"] <= stats["dropped_nodes"]
    if threshold == 1e9 and exact and fixed:  # everything pruned: only the target's own token per pass
        assert stats["mean_accepted"] == 1 and stats["prune_recall"] == 0 and stats["pruned_wrong"] > 0
    if threshold == -1e9:
        assert stats["pruned_nodes"] == 0


def test_pruning_drops_nodes_and_reports_precision_and_recall(tiny_bundles, ar_tokens):
    target, _ = tiny_bundles
    cfg = EngineConfig(mode="lever", gamma=24, context=CONTEXT, dram_budget=24 * 2**20, prune_threshold=0.0,
                       fixed_tree=True)
    toks, stats, pipe = trio.run(generate, cfg, target, target, tokenizer(target).encode(PROMPT))
    assert toks == ar_tokens
    assert stats["dropped_nodes"] > stats["pruned_nodes"] > 0
    assert 0 <= stats["prune_precision"] <= 1 and 0 < stats["prune_recall"] <= 1
    off = EngineConfig(mode="lever", gamma=24, context=CONTEXT, dram_budget=24 * 2**20, prune_threshold=0.0,
                       fixed_tree=True, prune=False)
    toks_off, stats_off, pipe_off = trio.run(generate, off, target, target, tokenizer(target).encode(PROMPT))
    assert toks_off == ar_tokens and stats_off["dropped_nodes"] == 0 and pipe_off.prune_note == "off"
    assert stats_off["mean_accepted"] >= stats["mean_accepted"]  # pruning can only lose accepted nodes


def test_calibration_scores_every_node_and_prunes_none(tiny_bundles, ar_tokens):
    target, draft = tiny_bundles
    record: list = []
    cfg = EngineConfig(mode="lever", gamma=24, context=CONTEXT, dram_budget=24 * 2**20, fixed_tree=True)
    run = functools.partial(generate, cfg, target, target, tokenizer(target).encode(PROMPT), prune_exits=(0, 1),
                            prune_record=record)
    toks, stats, pipe = trio.run(run)
    assert toks == ar_tokens and stats["dropped_nodes"] == 0
    layers = {r[2] for r in record}
    assert layers == {0, 1}
    # every drafted node of every pass is scored at both layers
    per_layer = {layer: sum(1 for r in record if r[2] == layer) for layer in layers}
    assert per_layer[0] == per_layer[1] == stats["draft_n"]


@pytest.mark.parametrize("kw,match", [({"prune_layer": 2, "prune_threshold": 0.0}, "exit layer 2"),
                                      ({"prune_layer": -1, "prune_threshold": 0.0}, "exit layer -1"),
                                      ({"prune_threshold": float("nan")}, "finite")])
def test_bad_prune_settings_are_refused(tiny_bundles, kw, match):
    target, draft = tiny_bundles
    cfg = EngineConfig(mode="lever", gamma=8, context=CONTEXT, dram_budget=24 * 2**20, **kw)
    with pytest.raises(ConfigError, match=match):
        trio.run(generate, cfg, target, draft, [1, 2, 3])


def test_an_uncalibrated_target_runs_lever_without_pruning(tiny_bundles, ar_tokens):
    target, draft = tiny_bundles
    cfg = EngineConfig(mode="lever", gamma=8, context=CONTEXT, dram_budget=24 * 2**20)
    toks, stats, pipe = trio.run(generate, cfg, target, draft, tokenizer(target).encode(PROMPT))
    assert toks == ar_tokens and pipe.prune_exits == () and "no calibration" in pipe.prune_note


def test_no_prune_mode_flag_round_trips():
    cfg = EngineConfig().with_mode("lever:16+no-prune")
    assert not cfg.prune and cfg.mode_string() == "lever:16+no-prune"
    assert EngineConfig().with_mode("lever:16").prune


def _samples(tmp_path, separable: bool):
    """A samples file of 40 passes: root -> 1 (accepted) -> 3 (accepted), root -> 2 (rejected)."""
    import json

    # separable: the rejected node 2 scores lowest; not: it scores highest and accepted node 3 lowest
    margins = {"1": 5.0, "2": -5.0, "3": 5.0} if separable else {"1": 5.0, "2": 6.0, "3": 3.0}
    passes = [[[-1, 0, 0, 1], [0, 1, 3], {"20": margins}] for _ in range(40)]
    path = tmp_path / f"samples-{separable}.json"
    path.write_text(json.dumps({"a": 0, "b": 8, "max_tokens": 16, "mode": "lever:16", "passes": passes}))
    return path


@pytest.mark.parametrize("separable", [True, False])
def test_calibration_tool_fits_from_samples(tmp_path, separable):
    import json

    from tools.calibrate_prune import main

    out = tmp_path / "fit.json"
    # a loose recall target, so only the estimated speed-up (tokens lost vs compute saved) decides
    assert main(["--from-samples", str(_samples(tmp_path, separable)), "--json", str(out), "--recall", "0.5"]) == 0
    fit = json.loads(out.read_text())
    if separable:  # the rejected sibling goes, nothing accepted is lost
        assert fit["exit_layer"] == 20 and -5.0 < fit["threshold"] <= 5.0
        assert fit["recall"] == 1.0 and fit["precision"] == 1.0 and fit["est_speedup"] > 1.0
    else:  # pruning node 3 keeps half the recall but loses a third of the tokens: it does not pay
        assert fit["exit_layer"] is None and "no threshold" in fit["verdict"]


@pytest.mark.parametrize("args", [["--humaneval", "70:90"], ["--exits", "4,x"], ["--recall", "1.5"],
                                  ["--from-samples", "/nonexistent/samples.json"]])
def test_calibration_tool_refuses_bad_input(args, capsys):
    from tools.calibrate_prune import main

    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2 and "error:" in capsys.readouterr().err


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 64), st.data())
def test_ghost_rows_after_a_prune_stay_inside_the_passs_bucket(n, data):
    """After a prune the survivors are padded to their own bucket. The ghosts take the pruned nodes'
    slots and then the plan's padding, never a slot past the plan's bucket: at the end of the
    context (the slack planned is the plan's bucket) that slot does not exist."""
    from actors.npu_verify import NpuVerifier
    from lever_actors.planner import bucket_for

    buckets = (1, 2, 4, 8, 16, 32, 64)
    room = bucket_for(n, buckets)
    pruned = data.draw(st.sets(st.integers(1, n - 1), max_size=n - 1))  # the root survives every prune
    nodes = np.array([i for i in range(n) if i not in pruned])
    v = NpuVerifier.__new__(NpuVerifier)
    v.base, v.padded_rows = 100, 0
    v.m = type("M", (), {"kv": type("KV", (), {"context": 100 + room})()})()  # the pass ends the context
    slots = v.base + nodes
    feeds = [{"kv_index": np.stack([np.zeros(len(nodes), np.int64), slots], -1)[None], "pos": nodes.copy()}]
    ghosts = bucket_for(len(nodes), buckets) - len(nodes)
    x, feeds, slots_list = v._pad(np.zeros((len(nodes), 4)), feeds, [slots], room, ghosts)
    taken = slots_list[0]
    assert len(x) == len(taken) == bucket_for(len(nodes), buckets)
    assert len(set(taken.tolist())) == len(taken) and taken.max() < v.base + room
    assert (feeds[0]["kv_index"][0, :, 1] == taken).all()

"""Acceptance rules: greedy walks the tree; sampled acceptance reproduces the target distribution."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.draft import keep_level
from lever_actors import sampling
from lever_actors.sampling import SamplingParams, accept_greedy, accept_sampled, nucleus, probs_from_logits


@st.composite
def trees(draw, vocab=6, max_nodes=12):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [draw(st.integers(0, vocab - 1)) for _ in range(n)]
    argmax = [draw(st.integers(0, vocab - 1)) for _ in range(n)]
    return np.array(parents), np.array(tokens), np.array(argmax)


@given(trees())
def test_greedy_accepts_exactly_the_path_the_target_would_decode(tree):
    parents, tokens, argmax = tree
    path, committed = accept_greedy(parents, tokens, argmax)
    assert path[0] == 0 and len(committed) == len(path) >= 1
    for a, b in zip(path, path[1:]):  # a parent-child chain whose tokens are the target's choices
        assert parents[b] == a and tokens[b] == argmax[a]
    last = path[-1]
    assert committed[-1] == argmax[last]
    assert not any(parents[c] == last and tokens[c] == argmax[last] for c in range(len(parents)))


def _tv(samples: list[int], q: np.ndarray) -> float:
    hist = np.bincount(samples, minlength=len(q)) / len(samples)
    return 0.5 * float(np.abs(hist - q).sum())


def test_sampled_chain_reproduces_the_target_distribution():
    rng = np.random.default_rng(0)
    vocab = 5
    p = rng.dirichlet(np.ones(vocab))  # draft
    q = rng.dirichlet(np.ones(vocab))  # target
    firsts = []
    for step in range(20000):
        x = int(np.random.default_rng([1, step]).choice(vocab, p=p))  # the draft proposes from p
        parents, tokens = np.array([-1, 0]), np.array([0, x])
        _, committed = accept_sampled(parents, tokens, [p, None], [q, q], seed=3, step=step)
        firsts.append(committed[0])
    assert _tv(firsts, q) < 0.015


def test_sampled_tree_siblings_reproduce_the_target_distribution():
    rng = np.random.default_rng(1)
    vocab = 5
    p = rng.dirichlet(np.ones(vocab))
    q = rng.dirichlet(np.ones(vocab))
    firsts = []
    for step in range(20000):
        r = np.random.default_rng([2, step])
        a = int(r.choice(vocab, p=p))  # two siblings drawn without replacement from p
        p2 = p.copy()
        p2[a] = 0
        b = int(r.choice(vocab, p=p2 / p2.sum()))
        parents, tokens = np.array([-1, 0, 0]), np.array([0, a, b])
        _, committed = accept_sampled(parents, tokens, [p, None, None], [q, q, q], seed=4, step=step)
        firsts.append(committed[0])
    assert _tv(firsts, q) < 0.015


def test_a_broken_acceptance_rule_is_caught():
    """Mutation check of the statistical test: always accepting the draft gives p, not q."""
    rng = np.random.default_rng(0)
    p, q = rng.dirichlet(np.ones(5)), rng.dirichlet(np.ones(5))
    firsts = [int(np.random.default_rng([1, s]).choice(5, p=p)) for s in range(20000)]
    assert _tv(firsts, q) > 0.05


@settings(max_examples=50)
@given(st.lists(st.floats(-20, 20), min_size=2, max_size=30), st.floats(0.05, 2.0), st.floats(0.05, 1.0))
def test_top_p_keeps_a_nucleus_that_reaches_p(logits, temperature, top_p):
    probs = probs_from_logits(np.array(logits), SamplingParams(temperature, top_p))
    assert abs(probs.sum() - 1) < 1e-9
    full = probs_from_logits(np.array(logits), SamplingParams(temperature, 1.0))
    kept = probs > 0
    assert full[kept].sum() >= top_p - 1e-9 or kept.all()
    assert full[kept].min() >= full[~kept].max(initial=0) - 1e-12



@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-6, 6), min_size=1, max_size=300), st.floats(0.01, 1.0), st.sampled_from([1, 3, 16]))
def test_nucleus_is_the_full_stable_sorts_prefix(levels, top_p, first_guess):
    """The nucleus sorted from a few candidates is, id for id, the prefix a stable sort of the whole
    vocabulary gives, with many ties at the cut and candidate sets that must grow (first guesses of
    1 to 16 ids)."""
    z = np.array(levels, np.float64) / 2
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    want = order[: int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)]
    old = sampling.NUCLEUS_FIRST_GUESS
    try:
        sampling.NUCLEUS_FIRST_GUESS = first_guess
        assert np.array_equal(nucleus(p, top_p), want)
    finally:
        sampling.NUCLEUS_FIRST_GUESS = old

def _draft_level(frontier, path_p, dists, draws, room, greedy):
    """One level the way the drafter grows it: each frontier node's candidates (its draws, in
    order), then the ones ``keep_level`` keeps."""
    cands = [(path_p[n] * float(dists[n][x]), n, x, float(dists[n][x])) for n in frontier for x in draws[n]]
    return keep_level(cands, room, greedy, {n: path_p[n] for n in frontier})


def test_a_sampled_tree_narrower_than_its_draws_still_reproduces_the_target_distribution():
    """Sampled lever draws 3 children per node and keeps 2 nodes a level: which draws it keeps must
    not depend on their probabilities (keeping the likeliest two gave [.19, .02, .07, .72] for a target
    of [.1, .2, .3, .4]). Two levels, so the room also decides between parents."""
    vocab = 4
    p = np.array([0.5, 0.3, 0.15, 0.05])  # draft, the same after every token
    q = np.array([0.1, 0.2, 0.3, 0.4])  # target, likewise
    firsts, seconds = [], []  # the second token too, wherever the first was a draft node: q again
    for step in range(30000):
        r = np.random.default_rng([5, step])
        parents, tokens, path_p = [-1], [0], {0: 1.0}
        frontier = [0]
        for _ in range(2):
            draws = {n: [int(x) for x in r.choice(vocab, size=3, replace=False, p=p)] for n in frontier}
            level = []
            for pp, parent, tok, _ in _draft_level(frontier, path_p, {n: p for n in frontier}, draws, 2, False):
                parents.append(parent)
                tokens.append(tok)
                path_p[len(tokens) - 1] = pp
                level.append(len(tokens) - 1)
            frontier = level
        n = len(tokens)
        _, committed = accept_sampled(np.array(parents), np.array(tokens), [p] * n, [q] * n, seed=9, step=step)
        firsts.append(committed[0])
        seconds += committed[1:2]
    assert _tv(firsts, q) < 0.015 and _tv(seconds, q) < 0.02


@given(st.lists(st.tuples(st.sampled_from([0.1, 0.15, 0.3]), st.lists(st.floats(0.01, 1.0), min_size=1, max_size=3)),
                min_size=1, max_size=4),
       st.integers(0, 12), st.booleans())
def test_kept_sampled_children_are_the_first_draws_of_their_parent_in_order(parents, room, greedy):
    """Sampled: each parent keeps the first of its draws in the order drawn, whatever their
    probabilities, and how many it keeps depends on the parents' own probabilities only (parents
    often tie here). Greedy: the likeliest paths."""
    def level(draw_ps):
        cands, i = [], 0
        for n, (base_p, _) in enumerate(parents):
            for p in draw_ps[n]:  # the draws of parent n, in order
                cands.append((base_p * p, n, i, p))
                i += 1
        return cands, keep_level(cands, room, greedy, {n: base_p for n, (base_p, _) in enumerate(parents)})

    cands, kept = level([ps for _, ps in parents])
    assert len(kept) == min(room, len(cands))
    if greedy:
        assert [c[0] for c in kept] == sorted((c[0] for c in cands), reverse=True)[:len(kept)]
        return
    counts = {}
    for n in {c[1] for c in cands}:
        mine, got = [c for c in cands if c[1] == n], [c for c in kept if c[1] == n]
        assert got == mine[:len(got)]  # a prefix of its draws, in the order drawn
        counts[n] = len(got)
    # the same parents with other draws (as many, other probabilities) keep as many each
    _, again = level([[0.5 / (j + 1) for j in range(len(ps))] for _, ps in parents])
    assert {n: sum(c[1] == n for c in again) for n in counts} == counts


@settings(max_examples=60, deadline=None)
@given(trees(vocab=5, max_nodes=8), st.integers(0, 2**31 - 1), st.integers(0, 50))
def test_the_acceptor_computes_each_target_distribution_only_where_the_walk_looks(tree, seed, step):
    """decide() hands accept_sampled the target's distributions lazily (one float64 vocabulary row at
    a time, so a pass's acceptance never holds all of them): the same commit as every row up front."""
    from actors.accept import decide
    from protocols import VerifyDone

    parents, tokens, _ = tree
    n = len(parents)
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, 5)).astype(np.float32)
    dists = rng.dirichlet(np.ones(5), size=n).astype(np.float32)
    params = SamplingParams(0.8, 0.9, seed)
    done = VerifyDone(session_id=1, step=step, epoch=0, node_ids=np.arange(n, dtype=np.int32), handle=0,
                      compute_s=0.0, io_wait_s=0.0, tokens=tokens.astype(np.int32), parents=parents.astype(np.int32),
                      argmax=np.zeros(n, np.int32), logits=logits, draft_dists=dists, temperature=0.8, top_p=0.9,
                      seed=seed, coupled=False)
    eager = accept_sampled(parents, tokens, list(dists), [probs_from_logits(row, params) for row in logits], seed, step)
    assert decide(done) == eager


# ---------------------------------------------------------------- coupled sampling (Gumbel noise by position)

def _coupled(temperature=0.8, top_p=1.0, seed=0) -> SamplingParams:
    return SamplingParams(temperature, top_p, seed, coupled=True)


def test_coupled_draws_reproduce_the_target_distribution_over_seeds_and_over_positions():
    """argmax(log p + Gumbel noise) is a draw from p: across seeds at one position, and across the
    positions of one seed (the noise of two positions is independent), with and without a nucleus."""
    from lever_actors.sampling import next_token

    logits = np.random.default_rng(4).normal(size=6).astype(np.float32) * 2
    for top_p in (1.0, 0.8):
        p = probs_from_logits(logits, SamplingParams(0.8, top_p))
        by_seed = [next_token(logits, _coupled(top_p=top_p, seed=s), 0, 7) for s in range(20000)]
        by_position = [next_token(logits, _coupled(top_p=top_p, seed=11), 0, i) for i in range(20000)]
        assert _tv(by_seed, p) < 0.015 and _tv(by_position, p) < 0.015
        assert set(by_seed) == set(np.flatnonzero(p))  # outside the nucleus never, inside every token


def test_gumbel_noise_of_a_token_does_not_depend_on_the_vocabulary_size_asked_for():
    """A draft's subset head asks for the noise of its ids in a vocabulary of its own size: each id
    gets the very value the target's full row gives it."""
    from lever_actors.sampling import coupled_scores, gumbel_noise

    full = gumbel_noise(9, 40, 1000)
    np.testing.assert_array_equal(gumbel_noise(9, 40, 300), full[:300])
    assert not np.array_equal(gumbel_noise(9, 41, 1000), full) and not np.array_equal(gumbel_noise(8, 40, 1000), full)
    logits = np.random.default_rng(1).normal(size=1000).astype(np.float32)
    ids = np.array([3, 17, 998, 500])
    np.testing.assert_array_equal(coupled_scores(logits[ids], _coupled(), 40, ids, 1000),
                                  coupled_scores(logits, _coupled(), 40)[ids])


def _prefix_logits(prefix: tuple, vocab: int) -> np.ndarray:
    """A made-up target: its logits after a prefix, a pure function of the prefix."""
    return np.random.default_rng([hash(prefix) & 0xFFFFFFFF, len(prefix)]).normal(size=vocab).astype(np.float32) * 1.5


@settings(max_examples=80, deadline=None)
@given(trees(vocab=4, max_nodes=10), st.integers(0, 2**31 - 1), st.integers(0, 40), st.sampled_from([1.0, 0.9]))
def test_coupled_acceptance_commits_what_the_target_alone_draws(tree, seed, root_position, top_p):
    """Lossless token for token: whatever tree was drafted, the committed tokens are the first tokens
    the target draws alone, one position at a time, with the same seed."""
    from actors.accept import decide
    from lever_actors.sampling import next_token
    from protocols import VerifyDone

    parents, tokens, _ = tree
    n, vocab, prompt = len(parents), 4, (1, 2)
    params = _coupled(top_p=top_p, seed=seed)
    prefixes = []
    for i in range(n):  # node i's prefix: the prompt, then the tokens of its path below the root
        path, v = [], i
        while v > 0:
            path.append(int(tokens[v]))
            v = int(parents[v])
        prefixes.append(prompt + tuple(reversed(path)))
    logits = np.stack([_prefix_logits(p, vocab) for p in prefixes])
    done = VerifyDone(session_id=1, step=3, epoch=0, node_ids=np.arange(n, dtype=np.int32), handle=0,
                      compute_s=0.0, io_wait_s=0.0, tokens=tokens.astype(np.int32), parents=parents.astype(np.int32),
                      argmax=np.zeros(n, np.int32), logits=logits, temperature=0.8, top_p=top_p, seed=seed,
                      coupled=True, position=root_position)
    _, committed = decide(done)
    alone, prefix = [], prompt
    for k in range(len(committed)):
        alone.append(next_token(_prefix_logits(prefix, vocab), params, 99, root_position + 1 + k))
        prefix += (alone[-1],)
    assert committed == alone

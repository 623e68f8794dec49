"""Prompt caching: a request that shares a prefix with the last one prefills only the rest, in
both models, and its output is the cold run's, token for token, in every mode."""
from __future__ import annotations

import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from lever_actors.engine import EngineConfig, parse_mode
from lever_actors.model import KVCache, common_prefix
from lever_actors.runtime import open_pipeline
from lever_actors.sampling import SamplingParams
from lever_actors.tokenizer import TextTokenizer

PROMPT = "def add(left, right):\n    return"
CONTEXT = 256
MODES = ["flash-ar", "flash-chain:3", "lever:6", "lever:6+no-overlap"]


def turns(tok: TextTokenizer) -> list[list[int]]:
    """Three requests that grow like a conversation: each is the last prompt, its answer so far
    and a new line (filled in as the answers come)."""
    return [tok.encode(PROMPT), tok.encode("\n# next\ndef sub(a, b):"), tok.encode("\n# and\n")]


async def conversation(cfg: EngineConfig, target, draft, *, cache: bool, tokens: int = 12):
    tok = TextTokenizer.from_file(target / "tokenizer.json")
    out, history = [], []
    async with open_pipeline(cfg, target, draft, set(tok.eos_ids)) as pipe:
        async def emit(_):
            return False
        for extra in turns(tok):
            prompt = history + extra
            ids, _, stats = await pipe.generate(prompt, tokens, SamplingParams(), emit, cache_prompt=cache)
            assert pipe.verifier.taken == set()
            out.append((ids, stats["cache_n"], stats["prompt_n"]))
            history = prompt + ids
    return out


@pytest.mark.parametrize("mode", MODES)
def test_warm_turns_equal_cold_ones_and_skip_the_shared_prefix(tiny_bundles, mode):
    target, draft = tiny_bundles
    name, gamma = parse_mode(mode)
    cfg = EngineConfig(mode=name, gamma=gamma, context=CONTEXT, dram_budget=12 << 20,
                       overlap="+no-overlap" not in mode)
    warm = trio.run(lambda: conversation(cfg, target, draft if cfg.drafted else None, cache=True))
    cold = trio.run(lambda: conversation(cfg, target, draft if cfg.drafted else None, cache=False))
    assert [w[0] for w in warm] == [c[0] for c in cold]
    assert all(c[1] == 0 for c in cold) and warm[0][1] == 0
    for (ids, cache_n, prompt_n), (prev_ids, prev_cache, prev_prompt) in zip(warm[1:], warm):
        # the whole last prompt at least, and most of its answer (the last pass's rows are not
        # committed until the next pass, so its tokens are computed again)
        assert cache_n >= prev_cache + prev_prompt, (cache_n, prev_cache, prev_prompt)


def test_a_prompt_that_diverges_keeps_only_the_common_rows(tiny_bundles):
    target, draft = tiny_bundles
    tok = TextTokenizer.from_file(target / "tokenizer.json")
    cfg = EngineConfig(mode="lever", gamma=6, context=CONTEXT, dram_budget=12 << 20)
    first = tok.encode(PROMPT + " left + right\n\ndef mul(a, b):")
    second = first[:5] + tok.encode(" something else entirely")

    async def run(cache: bool):
        async with open_pipeline(cfg, target, draft, set(tok.eos_ids)) as pipe:
            async def emit(_):
                return False
            await pipe.generate(first, 8, SamplingParams(), emit, cache_prompt=cache)
            ids, _, stats = await pipe.generate(second, 12, SamplingParams(), emit, cache_prompt=cache)
            return ids, stats["cache_n"]

    warm, cold = trio.run(run, True), trio.run(run, False)
    assert warm[0] == cold[0] and warm[1] == common_prefix(first, second) and cold[1] == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=12),
       st.integers(0, 12))
def test_kv_rows_know_their_tokens_and_reuse_stops_short_of_the_last(first, second, cut):
    kv = KVCache(1, 1, 64, 2)
    kv.commit(list(range(len(first))), first)
    kv.truncate(cut)
    kept = first[:cut]
    assert kv.tokens == kept
    n = kv.reusable(second)
    assert n == common_prefix(kept, second[:-1]) and n < max(len(second), 1)
    kv.commit([kv.length], None)  # a commit that does not say its tokens: no reuse until reset
    assert kv.reusable(second) == 0
    kv.truncate(0)
    assert kv.tokens == []


# ---------------------------------------------------------------- several conversations (PrefixStore)

def _kv_with(tokens, context=96, dim=3):
    """A KV cache whose row i is filled with a value derived from tokens[:i+1] (as real rows depend on their prefix)."""
    kv = KVCache(2, 1, context, dim, np.float16)
    for i in range(len(tokens)):
        kv.k[:, :, i] = hash(tuple(tokens[:i + 1])) % 1000
        kv.v[:, :, i] = -(hash(tuple(tokens[:i + 1])) % 997)
    kv.commit(list(range(len(tokens))), tokens)
    return kv


def _rows_match_their_prefix(kv) -> bool:
    return all(kv.k[0, 0, i, 0] == np.float16(hash(tuple(kv.tokens[:i + 1])) % 1000)
               and kv.v[1, 0, i, 2] == np.float16(-(hash(tuple(kv.tokens[:i + 1])) % 997)) for i in range(kv.length))


def test_a_conversation_interrupted_by_another_gets_its_rows_back():
    from lever_actors.prefix_cache import PrefixStore, row_bytes

    a = [1] * 20 + [2] * 10
    b = [7] * 25
    kv = _kv_with(a)
    store = PrefixStore(capacity=10 * 40 * row_bytes(kv))
    assert store.resume(kv, b + [8]) == 0  # B is new: A's rows are copied away first
    assert len(store.entries) == 1
    kv2 = _kv_with(b)  # B's rows as its prefill would leave them
    kv.k[:], kv.v[:], kv.length, kv.tokens = kv2.k, kv2.v, kv2.length, list(b)
    assert store.resume(kv, a + [3, 4]) == len(a)  # A again: from the copy, not the live rows (B's)
    assert kv.tokens == a and _rows_match_their_prefix(kv) and store.restored == 1
    assert any(e.tokens == tuple(b) for e in store.entries.values())  # and B was kept in turn
    assert store.resume(kv, a + [3, 4], reuse=False) == 0 and kv.length == 0  # opting out keeps nothing


def test_resuming_from_a_copy_never_holds_more_than_the_cap():
    """Two sequences that do not fit the cap together: the live one is not copied in at the cost of the
    copy being resumed from (that copy, still read from, would have outlived its eviction: about 1.7x
    the cap at once). Traced, the resume allocates no copy."""
    import tracemalloc

    from lever_actors.prefix_cache import PrefixStore, row_bytes

    x, y = [1] * 100, [2] * 100
    kv = _kv_with(x, context=128, dim=512)  # 4 KiB a row: a copy would stand out of the traced noise
    store = PrefixStore(capacity=150 * row_bytes(kv))
    assert store.store(kv) and store.nbytes == 100 * row_bytes(kv)
    fresh = _kv_with(y, context=128, dim=512)  # another conversation is live now
    kv.k[:], kv.v[:], kv.length, kv.tokens = fresh.k, fresh.v, fresh.length, list(y)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        assert store.resume(kv, x + [5]) == 100  # x again, from its copy
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < 20 * row_bytes(kv), peak
    assert kv.tokens == x and _rows_match_their_prefix(kv)
    assert [e.tokens for e in store.entries.values()] == [tuple(x)] and store.nbytes <= store.capacity


# prompts like conversations: one of a few openings (longer than a stored sequence's minimum), then a tail
CONVERSATION_PROMPTS = st.lists(st.tuples(st.sampled_from([[1] * 18, [2] * 17 + [1], [1] * 9 + [3] * 12]),
                                          st.lists(st.integers(0, 3), max_size=24)).map(lambda t: t[0] + t[1]),
                                min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(CONVERSATION_PROMPTS, st.integers(0, 6), st.booleans())
def test_the_store_stays_in_its_cap_and_hands_out_exact_rows(sequences, cap_rows, reuse):
    """Whatever the order of prompts: never more than its capacity, and every kept row is the row of its own
    prefix (restored rows are what a prefill computes), the longest prefix available is taken."""
    from lever_actors.prefix_cache import PrefixStore, row_bytes

    kv = _kv_with([])
    store = PrefixStore(capacity=cap_rows * 16 * row_bytes(kv))
    for seq in sequences:
        best = max([kv.reusable(seq) if reuse else 0] + [common_prefix(list(e.tokens), seq[:-1])
                                                         for e in store.entries.values()] * reuse)
        kept = store.resume(kv, seq, reuse)
        assert kept == best and kv.length == kept and kv.tokens == seq[:kept]
        assert _rows_match_their_prefix(kv)
        assert store.nbytes <= store.capacity
        fresh = _kv_with(seq)  # the "prefill" of the rest
        kv.k[:], kv.v[:], kv.length, kv.tokens = fresh.k, fresh.v, fresh.length, list(seq)


def test_two_interleaved_conversations_both_stay_warm_and_exact(tiny_bundles):
    """Chat A, chat B, A again, B again on one pipeline: each later turn reuses its own conversation's
    rows from the store (the live rows are the other chat's), in both models, and equals a cold run."""
    target, draft = tiny_bundles
    tok = TextTokenizer.from_file(target / "tokenizer.json")

    async def run(cache: bool, store: int | None):
        cfg = EngineConfig(mode="lever", gamma=6, context=CONTEXT, dram_budget=24 << 20, prompt_cache=store)
        history = {"a": tok.encode(PROMPT), "b": tok.encode("class Stack:\n    def push(self, item):")}
        out = []
        async with open_pipeline(cfg, target, draft, set(tok.eos_ids)) as pipe:
            async def emit(_):
                return False
            for chat in ("a", "b", "a", "b"):
                prompt = history[chat]
                ids, _, stats = await pipe.generate(prompt, 10, SamplingParams(), emit, cache_prompt=cache)
                out.append((chat, len(prompt), ids, stats["cache_n"]))
                history[chat] = prompt + ids + tok.encode("\n# more\n")
            return out, pipe.drafter.prefix_store.restored, pipe.verifier.prefix_store.restored

    warm, d_restored, t_restored = trio.run(run, True, None)
    cold, _, _ = trio.run(run, False, None)
    off, _, _ = trio.run(run, True, 0)
    assert [w[2] for w in warm] == [c[2] for c in cold] == [o[2] for o in off]
    assert t_restored == 2 and d_restored == 2
    for (chat, n_prompt, _, cache_n), earlier in zip(warm[2:], warm[:2]):
        assert cache_n >= earlier[1]  # at least that chat's whole last prompt came back
    assert all(o[3] < 8 for o in off[2:])  # without the store only the few tokens the chats share


def test_the_prompt_cache_is_a_line_of_the_budget(tiny_bundles):
    from lever_actors.errors import BudgetError, ConfigError

    target, draft = tiny_bundles

    async def plan(size):
        cfg = EngineConfig(mode="lever", gamma=6, context=CONTEXT, dram_budget=24 << 20, prompt_cache=size)
        async with open_pipeline(cfg, target, draft, set()) as pipe:
            return pipe.plan, pipe.verifier.prefix_store.capacity + pipe.drafter.prefix_store.capacity

    auto, auto_bytes = trio.run(plan, None)
    assert auto.items["prompt_cache"] == auto_bytes > 0 and auto.total <= auto.budget
    assert "prompt_cache" in auto.describe()
    fixed, fixed_bytes = trio.run(plan, 1 << 20)
    assert fixed_bytes <= 1 << 20 and fixed.total <= fixed.budget
    # a size asked for beyond what the pinned layers leave is planned before them: they make room
    more = auto_bytes + int(auto.layer_bytes[auto.pinned[-1]] * auto.weight_factor) // 2
    roomy, roomy_bytes = trio.run(plan, more)
    assert auto.pinned and len(roomy.pinned) < len(auto.pinned) and roomy.total <= roomy.budget
    assert more - 1 <= roomy_bytes <= more and roomy.items["prompt_cache"] == roomy_bytes
    with pytest.raises(ConfigError, match="--prompt-cache 1024 MiB does not fit"):
        trio.run(plan, 1 << 30)

    async def too_small(size):
        cfg = EngineConfig(mode="lever", gamma=6, context=CONTEXT, dram_budget=1 << 20, prompt_cache=size)
        async with open_pipeline(cfg, target, draft, set()):
            pass

    # a budget too small for the pair even without a cache is refused as such, not blamed on the cache
    with pytest.raises(BudgetError) as refused:
        trio.run(too_small, 1 << 10)
    assert "--prompt-cache" not in str(refused.value)

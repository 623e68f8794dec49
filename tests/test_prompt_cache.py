"""Prompt caching: a request that shares a prefix with the last one prefills only the rest, in
both models, and its output is the cold run's, token for token, in every mode."""
from __future__ import annotations

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

"""The real Qwen2.5-Coder pair: one layer against float64, real generation, lossless speculation."""
from __future__ import annotations

import os

import numpy as np
import pytest
import trio

from lever_actors.bundle import load_bundle
from lever_actors.engine import EngineConfig
from lever_actors.model import Transformer, causal_layout
from lever_actors.ortrt import LaneConfig
from lever_actors.runtime import open_pipeline
from lever_actors.sampling import SamplingParams
from lever_actors.tokenizer import TextTokenizer

PROMPT = 'def truncate_number(number: float) -> float:\n    """Return the decimal part of number."""\n'


def test_one_real_target_layer_matches_float64(real_bundles):
    from tests.reference import ReferenceModel

    ref = ReferenceModel(os.environ["LEVER_TEST_TARGET_GGUF"], layers=1)
    bundle = load_bundle(real_bundles[0])
    model = Transformer(bundle, 32, LaneConfig(precision="fp32"), resident_layers=[0], load_head=False)
    tokens = [750, 912, 2877, 11, 293, 1648, 198, 262]
    x = model.embedding.lookup(tokens)
    n = len(tokens)
    slots = np.arange(n)
    y = model.run_layer(0, model.resident[0], x, model.feeds(slots, slots, causal_layout(32, 0, n)), slots)
    want = ref.layer(0, ref.embed(tokens))
    assert np.abs(y - want).max() / np.abs(want).max() <= 1e-3


def test_real_draft_and_target_vocabularies_match(real_bundles):
    t, d = (load_bundle(p).manifest["tokenizer"]["vocab_sha256"] for p in real_bundles)
    assert t == d


def test_flash_chain_equals_resident_ar_on_the_real_pair(real_bundles):
    target, draft = real_bundles
    tok = TextTokenizer.from_file(target / "tokenizer.json")
    ids = tok.encode(PROMPT)
    out = {}

    async def run(mode, budget, d):
        cfg = EngineConfig(mode=mode, gamma=6, context=256, dram_budget=budget)
        async with open_pipeline(cfg, target, d, set(tok.eos_ids)) as pipe:
            async def emit(_):
                return False
            toks, _, stats = await pipe.generate(ids, 24, SamplingParams(), emit)
            out[mode] = (toks, stats, pipe.plan)

    trio.run(run, "resident-ar", None, None)
    trio.run(run, "flash-chain", 2**30, draft)
    assert out["flash-chain"][0] == out["resident-ar"][0]
    assert out["flash-chain"][2].streamed  # 1 GiB really streams target layers
    assert out["flash-chain"][1]["mean_accepted"] > 2
    assert "number - int(number)" in tok.decode(out["resident-ar"][0]) or "% 1" in tok.decode(out["resident-ar"][0])

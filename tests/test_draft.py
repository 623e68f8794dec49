"""Cross-step drafting keeps the draft's KV cache exact whatever the verdict.

A speculative request commits an assumed outcome; the next request confirms it
or undoes it. Either way the cache must end up holding exactly the rows a
drafter that never speculated would hold (the draft model is batch-invariant,
so "exactly" means bit for bit), or later drafts would silently get worse.
"""
from __future__ import annotations

import numpy as np
import pytest

from actors.draft import Drafter
from lever_actors.bundle import load_bundle
from lever_actors.model import Transformer
from lever_actors.ortrt import LaneConfig
from lever_actors.trace import Tracer
from protocols import DraftRequest

CONTEXT = 128
PROMPT = [5, 9, 13, 2, 7, 11]


def _drafter(bundle) -> Drafter:
    return Drafter(Transformer(load_bundle(bundle), CONTEXT, LaneConfig()), None, None, None, Tracer(enabled=False))


def _req(step, **kw) -> DraftRequest:
    base = dict(session_id=1, step=step, epoch=0, root_token=0, position=0, max_nodes=4, max_depth=4, top_k=1)
    return DraftRequest(**(base | kw))


def _prefix(d: Drafter) -> tuple[np.ndarray, np.ndarray]:
    n = d.m.kv.length
    return d.m.kv.k[:, :, :n].copy(), d.m.kv.v[:, :, :n].copy()


@pytest.mark.parametrize("verdict", ["confirmed", "diverges-at-0", "diverges-at-2", "all-but-bonus"])
def test_speculation_then_verdict_leaves_the_exact_cache(tiny_bundles, verdict):
    spec, plain = _drafter(tiny_bundles[1]), _drafter(tiny_bundles[1])
    first = _req(0, root_token=PROMPT[-1], position=len(PROMPT) - 1, committed=tuple(PROMPT), reset=True)
    tree = spec.draft(first)
    plain.draft(first)
    chain = [int(t) for t in tree.tokens]
    guess = spec.draft(_req(1, position=len(PROMPT) - 1, speculative=True, assume=tuple(chain)))
    assumed = chain + [int(guess.root_token)]
    actual = {"confirmed": assumed,
              "diverges-at-0": [(chain[0] + 1) % 50],
              "diverges-at-2": chain[:2] + [(chain[2] + 1) % 50],
              "all-but-bonus": chain + [(int(guess.root_token) + 1) % 50]}[verdict]
    if verdict == "confirmed":
        spec.draft(_req(2, speculative=True, assume=(int(guess.tokens[0]),), confirmed=True,
                        position=len(PROMPT) + len(assumed) - 1))
        plain.draft(_req(1, root_token=actual[-1], position=len(PROMPT) + len(actual) - 1, committed=tuple(actual)))
        plain.draft(_req(2, speculative=True, assume=(int(guess.tokens[0]),), position=len(PROMPT) + len(actual) - 1))
    else:
        spec.draft(_req(2, root_token=actual[-1], position=len(PROMPT) + len(actual) - 1, committed=tuple(actual)))
        plain.draft(_req(1, root_token=actual[-1], position=len(PROMPT) + len(actual) - 1, committed=tuple(actual)))
    assert spec.m.kv.length == plain.m.kv.length
    for a, b in zip(_prefix(spec), _prefix(plain)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("hit", [True, False])
def test_speculating_on_the_first_token_during_prefill(tiny_bundles, hit):
    """The reset request may already assume the first token (the target is still prefilling)."""
    spec, plain = _drafter(tiny_bundles[1]), _drafter(tiny_bundles[1])
    first = _req(0, root_token=PROMPT[-1], position=len(PROMPT) - 1, committed=tuple(PROMPT), reset=True)
    guess = spec.draft(first.__class__(**{**_fields(first), "speculative": True}))
    assert len(guess.tokens) > 0 and guess.position == len(PROMPT)
    token = int(guess.root_token) if hit else (int(guess.root_token) + 1) % 50
    plain.draft(first.__class__(**{**_fields(first), "max_nodes": 0, "max_depth": 0}))
    nxt = _req(1, root_token=token, position=len(PROMPT), committed=(token,))
    if not hit:  # a hit needs no request: the driver verifies the tree it already has
        spec.draft(nxt)
    plain.draft(nxt)
    assert spec.m.kv.length == plain.m.kv.length
    for a, b in zip(_prefix(spec), _prefix(plain)):
        np.testing.assert_array_equal(a, b)


def _fields(msg) -> dict:
    import dataclasses

    return {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}


def test_alternatives_list_the_drafts_top_tokens_after_every_expanded_node(tiny_bundles):
    """The pruner's rivals: row 0 after the root, row i+1 after node i, best first, holding every
    child drafted there; a node never scored lists only its own token."""
    d = _drafter(tiny_bundles[1])
    exp = d.draft(_req(0, root_token=PROMPT[-1], position=len(PROMPT) - 1, committed=tuple(PROMPT), reset=True,
                       max_nodes=12, max_depth=4, top_k=3))
    alt, parents, tokens = exp.alternatives, exp.parents, exp.tokens
    assert alt.shape == (len(tokens) + 1, 4) and alt.dtype == np.int32
    expanded = {-1} | {int(p) for p in parents}
    for v, (p, t) in enumerate(zip(parents, tokens)):
        assert t in alt[p + 1][:3]  # a top-3 child is among its parent's top tokens
    for v in range(len(tokens)):
        own = (alt[v + 1] == tokens[v]).all()
        if v in expanded:
            assert len(set(alt[v + 1].tolist())) == 4  # four distinct best tokens
        else:  # a leaf: never scored (last level), or scored but none of its children kept
            assert own or len(set(alt[v + 1].tolist())) == 4
    # row 0 is the draft's own ranking after the root: its best is the first drafted child
    assert alt[0][0] == tokens[0]

"""One fixed sample per registered message kind: the source of the golden wire files.

``tools/regen_golden.py`` writes ``tests/golden/wire/<kind>.v<version>.msgpack`` from these;
``tests/test_protocols.py`` checks that encoding each sample still gives those bytes and that
decoding the bytes gives the sample back. Changing a sample is a deliberate wire change: do it
together with a version bump or a regenerated golden, never to make a test pass.
"""
from __future__ import annotations

import numpy as np

from protocols import (
    Abort,
    Commit,
    DraftExpansion,
    DraftRequest,
    DraftSteer,
    LaneGrant,
    ExitHidden,
    LayerReady,
    LayerReleased,
    Message,
    PassSchedule,
    PassStats,
    PruneMask,
    VerifyDone,
    VerifyPlan,
)

_HEADER = {"session_id": 7, "step": 42, "epoch": 3}


def _i32(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


_SAMPLE_LIST: list[Message] = [
    PassSchedule(**_HEADER, layers=(0, 1, 2, 5, 27)),
    LayerReady(**_HEADER, layer=5, slot=1, nbytes=30_015_488, io_s=0.0251, direct_io=True),
    LayerReleased(**_HEADER, layer=5, slot=1),
    Abort(**_HEADER, reason="client disconnected"),
    DraftRequest(**_HEADER, root_token=151_643, position=128, max_nodes=32, max_depth=6, top_k=4,
                 committed=(262, 151_643), reset=False, temperature=0.75, top_p=0.875, seed=11,
                 min_path_p=0.375, threads=2, reuse_prefix=True, confirmed_hypothesis=1, levels=2,
                 hypotheses=(((198, 220), (), 16, 8, 0), ((198,), (220, 262), 6, 6, 0), ((198, 220), (), 4, 4, 1)), deadline_s=1234.5,
                 coupled=False),
    DraftExpansion(
        **_HEADER, root_token=151_643, position=128,
        parents=_i32(-1, -1, 0, 0, 2), tokens=_i32(198, 220, 262, 1_000, 151_645),
        draft_probs=np.array([0.75, 0.125, 0.5, 0.25, 1.0], dtype=np.float32), draft_s=0.0875,
        dists=np.array([[0.5, 0.25, 0.25], [0.0, 1.0, 0.0]], dtype=np.float32),
        alternatives=np.array([[198, 220], [262, 1_000], [13, 11], [151_645, 5], [7, 8], [9, 10]], dtype=np.int32),
        assumed=(198, 220, 151_643), hypothesis=1, of=2, growing=True,
        fault="embedding row 750 read back changed", fault_retryable=True),
    DraftSteer(**_HEADER, path=(198, 220), next_token=262, final=True, max_depth=3, min_path_p=0.25),
    LaneGrant(**_HEADER, threads=1),
    VerifyPlan(
        **_HEADER, position=128, tokens=_i32(151_643, 198, 220, 262),
        parents=_i32(-1, 0, 0, 1), depths=_i32(0, 1, 1, 2), bucket=4, exit_layers=(8, 16),
        prev_accepted=(0, 2), want_logits=True, temperature=0.5, top_p=0.9375, seed=3,
        alternatives=np.array([[198, 220], [262, 5], [13, 11], [9, 10]], dtype=np.int32), prune_threshold=-1.5, reuse_prefix=True, threads=2),
    ExitHidden(**_HEADER, layer=8, node_ids=_i32(0, 1, 3), handle=11, tokens=_i32(151_643, 198, 220, 262),
               parents=_i32(-1, 0, 0, 1), alternatives=np.array([[198, 220], [262, 5], [13, 11], [9, 10]], dtype=np.int32),
               threshold=-1.5),
    PruneMask(**_HEADER, layer=8, keep=np.array([True, True, False, True])),
    VerifyDone(**_HEADER, node_ids=_i32(0, 1, 3), handle=12, compute_s=0.0625, io_wait_s=0.003,
               tokens=_i32(151_643, 198, 220, 262), parents=_i32(-1, 0, 0, 1), argmax=_i32(198, 262, -1, 13),
               logits=np.array([[1.5, -2.0], [0.25, 0.0], [3.0, 1.0]], dtype=np.float32), bytes_read=30_015_488,
               temperature=0.5, top_p=0.9375, seed=3, pruned=_i32(2), cache_n=17, coupled=False, position=128),
    Commit(**_HEADER, tokens=(198, 262, 13), accepted_nodes=(0, 1, 3), finished=True,
           finish_reason="stop"),
    PassStats(**_HEADER, n_nodes=4, n_accepted=2, n_pruned=1, io_s=0.71, compute_s=0.18,
              draft_s=0.0875, pass_s=0.74, bytes_read=788_800_000, n_pruned_wrong=1, n_dropped=2, cache_n=17),
]

SAMPLES: dict[str, Message] = {msg.KIND: msg for msg in _SAMPLE_LIST}
"""KIND -> the sample instance of its current VERSION."""

"""Shapes of a decoder layer and of its matrices, shared by the bundle, the model and the ONNX graphs.

Kept apart from :mod:`lever_actors.graphs` so that the native path (GGUF-block kernels)
never imports ``onnx``: that import alone held 13 MiB of the process at start-up (protobuf,
ml_dtypes), which ``--dram-budget`` counts, and took half a second.
"""
from __future__ import annotations

from dataclasses import dataclass

NEG = -1e30  # additive mask value: exp() underflows to exactly 0, no inf-inf NaN


@dataclass(frozen=True)
class Dims:
    hidden: int
    ffn: int
    n_head: int
    n_kv_head: int
    head_dim: int
    rms_eps: float
    rope_style: str  # "neox" (qwen2) or "norm" (llama, GGUF-permuted pairs)
    context: int  # KV cache slots per layer


@dataclass(frozen=True)
class MatSpec:
    """Shape and storage kind of one matrix: enough to declare its initializers (``graphs.array_shapes``)."""

    kind: str  # q4 | q8 | f32
    k: int
    n: int
    block: int = 0
    has_corr: bool = False

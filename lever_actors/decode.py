"""Plain autoregressive decoding of one resident model (the reference every mode must equal)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from lever_actors.errors import ContextOverflow
from lever_actors.model import Transformer, causal_layout
from lever_actors.sampling import SamplingParams, next_token


@dataclass
class Result:
    """One finished generation, whichever path produced it."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    load_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stats: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.decode_s if self.decode_s > 0 else 0.0


def check_context(n_prompt: int, max_tokens: int, context: int, slack: int = 0) -> None:
    if n_prompt == 0:
        raise ValueError("the prompt is empty")
    if n_prompt + max_tokens + slack > context:
        room = f"the context of {context} tokens" + (
            f" less the {slack} slots a pass's tree takes ({context - slack} left for a request)" if slack else "")
        raise ContextOverflow(
            f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds {room}; "
            "shorten the prompt, lower --max-tokens or raise --context"
        )


def decode_resident(model: Transformer, prompt_ids: list[int], max_tokens: int, params: SamplingParams,
                    stop_ids: set[int], on_token: Callable[[int], bool] | None = None) -> Result:
    """Greedy or sampled decoding; ``on_token`` may return True to stop early."""
    check_context(len(prompt_ids), max_tokens, model.context)
    gen = Result(list(prompt_ids))
    t0 = time.perf_counter()
    h = model.prefill(prompt_ids)
    tok = next_token(model.logits(h)[0], params, 0, len(prompt_ids))
    gen.prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    while True:
        gen.token_ids.append(tok)
        if tok in stop_ids:
            gen.finish_reason = "stop"
            break
        if (on_token and on_token(tok)) or len(gen.token_ids) >= max_tokens:
            gen.finish_reason = "stop" if len(gen.token_ids) < max_tokens else "length"
            break
        p = model.kv.length
        h = model.forward_resident([tok], np.array([p]), np.array([p]), causal_layout(model.context, p, 1))
        model.kv.commit([p])
        tok = next_token(model.logits(h)[0], params, len(gen.token_ids), len(prompt_ids) + len(gen.token_ids))
    gen.decode_s = time.perf_counter() - t0
    return gen

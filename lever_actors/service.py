"""The real daemon backend: one pipeline, loaded at start, serving generations one at a time."""
from __future__ import annotations

import secrets
import time

import trio

from lever_actors.backend import GenerateOutcome, GenerateParams
from lever_actors.errors import ConfigError
from lever_actors.sampling import SamplingParams
from lever_actors.stops import StopScanner


class EngineBackend:
    """Implements :class:`lever_actors.backend.Backend` over :func:`lever_actors.runtime.open_pipeline`.

    ``run()`` (started by the daemon before it listens) loads the models and
    keeps the pipeline's actors alive for the daemon's lifetime.
    """

    def __init__(self, cfg, flash_file=None) -> None:
        from lever_actors.tokenizer import load_tokenizer
        from lever_actors.models import resolve_bundle

        self.cfg = cfg
        self.flash_file = flash_file  # None: the runtime's FlashFile (tests pass one that injects faults)
        self.tdir = resolve_bundle(cfg.target, "target")
        self.ddir = resolve_bundle(cfg.draft, "draft") if cfg.drafted else None
        self.tok = load_tokenizer(self.tdir)
        self.pipe = None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from lever_actors.runtime import open_pipeline

        kw = {"flash_file": self.flash_file} if self.flash_file is not None else {}
        async with open_pipeline(self.cfg, self.tdir, self.ddir, set(self.tok.eos_ids), **kw) as pipe:
            self.pipe = pipe
            task_status.started()
            await trio.sleep_forever()

    def describe(self) -> dict:
        from lever_actors.bundle import load_bundle
        from lever_actors.driver import request_room

        models = {"target": str(self.tdir)}
        if self.ddir:
            models["draft"] = str(self.ddir)
        d = {"models": models, "mode": self.cfg.mode_string(),
             "modes": [self.cfg.mode_string()], "context_length": request_room(self.cfg),
             "dram_budget_bytes": self.cfg.dram_budget, "vocab_size": load_bundle(self.tdir).dims["vocab_size"]}
        if self.pipe is not None:
            d["plan"] = self.pipe.describe()
        return d

    def _prompt_ids(self, params: GenerateParams) -> list[int]:
        if params.messages is not None:  # the contents are plain text, whatever control texts they hold
            return self.tok.encode_chat(params.messages)
        return self.tok.encode(params.prompt or "")

    def count_prompt_tokens(self, params: GenerateParams) -> int:
        return len(self._prompt_ids(params))

    def pool_stats(self) -> dict:
        if self.pipe is None:
            return {"buffers_total": 0, "buffers_free": 0}
        pf = self.pipe.prefetcher
        return {"buffers_total": len(pf.pool), "buffers_lent": len(pf.lent),
                "bytes_read": pf.bytes_read, "reads": pf.reads}

    async def generate(self, params: GenerateParams, emit) -> GenerateOutcome:
        if params.mode and params.mode != self.cfg.mode_string():
            raise ConfigError(f"this daemon runs mode {self.cfg.mode_string()}; restart it with --mode {params.mode}")
        if self.pipe is None:
            raise RuntimeError("the pipeline is not running")
        ids = self._prompt_ids(params)
        # no seed: a fresh one, so that unseeded sampled requests differ (as OpenAI's API does); 53 bits,
        # so that a JavaScript client reads the seed it is told back exactly (its numbers are doubles)
        seed = params.seed if params.seed is not None else secrets.randbits(53)
        sampling = SamplingParams(params.temperature, params.top_p, seed)
        dec = self.tok.incremental_decoder()
        eos = set(self.tok.eos_ids)
        stops = StopScanner(params.stop)
        text_parts: list[str] = []
        emitted: list[int] = []

        async def on_tokens(toks: list[int]) -> bool:
            # token by token: how many tokens a pass commits at once depends on the drafted trees
            # (and a planner's timings), so the text and the ids must not (the ids end with the
            # token that completes a stop string, whatever else its pass committed)
            if stops.stopped:
                return True
            pieces, taken = [], []
            for t in toks:
                pieces.append(stops.feed("" if t in eos else dec.feed(t)))
                taken.append(t)
                if stops.stopped:
                    break
            piece = "".join(pieces)
            text_parts.append(piece)
            emitted.extend(taken)
            await emit(piece, taken)
            return stops.stopped

        t0 = time.perf_counter()
        _, finish, stats = await self.pipe.generate(ids, params.max_tokens, sampling, on_tokens,
                                                    cache_prompt=params.cache_prompt)
        if not stops.stopped:
            tail = stops.feed(dec.flush())
            tail += stops.flush()
            if tail:
                text_parts.append(tail)
                await emit(tail, [])
        if stops.stopped:
            finish = "stop"
        stats = dict(stats, elapsed_s=time.perf_counter() - t0, prompt_tokens=len(ids))
        if not sampling.greedy:  # the seed drawn for an unseeded request too: the text can be asked for again
            stats["seed"] = seed
        return GenerateOutcome("".join(text_parts), list(emitted), finish, stats)


def make_backend(args) -> EngineBackend:
    """The daemon's backend for ``serve``'s command-line arguments."""
    from lever_actors.engine import EngineConfig

    return EngineBackend(EngineConfig.from_args(args))

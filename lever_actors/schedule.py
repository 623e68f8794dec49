"""Which schedule lever's passes run: drafting beside the pass, or the two taking turns.

* ``overlap``: while the target verifies, the drafter drafts the trees of the pass's likely
  outcomes on its own core (cross-step drafting), then lends that core to the pass.
* ``turns``: the pass runs on every core with no drafting beside it; after the commit the
  next tree is drafted on every core, from the outcome that happened.

Which is faster depends on the host. Where flash reads bound a pass (an AVX-512 host at
the standard budget), drafting beside the pass costs nothing and hides the draft. Where
the target's compute bounds it (an AVX2 host: a verified row costs ~30 ms of one core),
the pass and the draft each run nearly twice as fast alone as beside each other. They also
share one memory bus, and the fresh draft follows the real outcome. The faster schedule
can also change with the load on a shared machine. So it is measured, not predicted.
Blocks of passes run each schedule, scored by tokens per second of their cycles. The faster
one then runs, and the other gets a block again within every ``explore_every``.

Two things keep the prompt out of the comparison. How many tokens a pass commits depends on
the prompt far more than on the schedule (8.8 to 16 tok/s across development prompts for one
schedule), so schedules are compared only between adjacent blocks of one sequence: each such
pair gives a log ratio of their rates, and the decayed mean of those ratios decides. And a
pass's tokens are the ones its tree was expected to commit (the planner's gain, 1 + the
calibrated path probabilities of its nodes), not the ones it did commit: a tree's actual
outcome swings from 1 to 10 tokens, which over blocks of three passes made the comparison
noise (a host where overlap ran 1.14x faster chose turns for 35% of its passes).

A pass's cycle runs from the moment its tree is ready to the moment the next tree is
ready: its verification and the drafting that its schedule leaves unhidden.

Pure logic, no trio: the driver reports each pass and asks which schedule the next one runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

OVERLAP, TURNS = "overlap", "turns"
SCHEDULES = (OVERLAP, TURNS)


@dataclass
class ScheduleChoice:
    """Chooses ``overlap`` or ``turns`` block by block, from their measured tokens per second."""

    block: int = 3  # passes per block: one schedule runs a whole block (its first pass inherits the last one's tree)
    warmup: int = 2  # blocks of each schedule, alternating, before the faster one is chosen
    explore_every: int = 6  # then any this many blocks in a row run each schedule at least once
    decay: float = 0.8  # weight of the earlier comparisons (and blocks) against the newest one
    current: str = OVERLAP
    tokens: dict = field(default_factory=lambda: dict.fromkeys(SCHEDULES, 0.0))  # decayed sums per schedule
    seconds: dict = field(default_factory=lambda: dict.fromkeys(SCHEDULES, 0.0))
    blocks: dict = field(default_factory=lambda: dict.fromkeys(SCHEDULES, 0))
    last_block: dict = field(default_factory=lambda: dict.fromkeys(SCHEDULES, 0))  # number of its latest block
    log_gain: float = 0.0  # decayed sum of log(turns rate / overlap rate) over adjacent blocks
    pairs: float = 0.0  # ... and their decayed count
    _previous: tuple[str, float] | None = None  # the last block of this sequence: its schedule and rate
    _passes: int = 0  # of the current block
    _block_tokens: float = 0.0
    _block_s: float = 0.0

    def __post_init__(self) -> None:
        if self.block < 1 or self.warmup < 1 or self.explore_every < 1 or not 0.0 <= self.decay < 1.0:
            raise ValueError("ScheduleChoice needs block, warmup, explore_every >= 1 and 0 <= decay < 1")
        if self.current not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.current!r}; schedules: {', '.join(SCHEDULES)}")

    def rate(self, schedule: str) -> float | None:
        """Committed tokens per second of ``schedule``'s cycles (recent blocks weigh more); None unmeasured."""
        s = self.seconds[schedule]
        return self.tokens[schedule] / s if s > 0 else None

    def gain(self) -> float | None:
        """Turns' tokens per second over overlap's, from adjacent blocks; None before any pair."""
        return float(np.exp(self.log_gain / self.pairs)) if self.pairs > 0 else None

    def new_sequence(self) -> None:
        """A new generation begins: its blocks are not compared with the last one's (another prompt)."""
        if self._passes:
            self._close_block()
        self._previous = None

    def observe(self, tokens: float, seconds: float) -> None:
        """One pass of the current schedule: ``tokens`` (expected) committed in a cycle of ``seconds``."""
        if seconds < 0 or tokens < 0:
            raise ValueError(f"a pass commits tokens >= 0 in seconds >= 0, got {tokens} in {seconds}")
        self._passes += 1
        self._block_tokens += tokens
        self._block_s += seconds
        if self._passes >= self.block:
            self._close_block()

    def _close_block(self) -> None:
        s = self.current
        if self._block_s > 1e-6:  # (a block measured as taking no time says nothing)
            rate = max(self._block_tokens, 0.5) / self._block_s  # (a block that committed nothing stays finite)
            if self._previous is not None and self._previous[0] != s:
                ratio = float(np.log(rate / self._previous[1]))
                self.log_gain = self.decay * self.log_gain + (ratio if s == TURNS else -ratio)
                self.pairs = self.decay * self.pairs + 1.0
            self._previous = (s, rate)
        self.tokens[s] = self.decay * self.tokens[s] + self._block_tokens
        self.seconds[s] = self.decay * self.seconds[s] + self._block_s
        self.blocks[s] += 1
        self.last_block[s] = sum(self.blocks.values())
        self._passes, self._block_tokens, self._block_s = 0, 0.0, 0.0
        self.current = self._next()

    def _next(self) -> str:
        short = [s for s in SCHEDULES if self.blocks[s] < self.warmup]
        if short:  # alternate until each is measured: the one with fewer blocks (overlap first)
            return min(short, key=lambda s: self.blocks[s])
        gain = self.gain()
        if gain is not None:
            best = TURNS if gain > 1.0 else OVERLAP
        else:
            best = max(SCHEDULES, key=lambda s: self.rate(s) or 0.0)
        other = next(s for s in SCHEDULES if s != best)
        if sum(self.blocks.values()) - self.last_block[other] >= self.explore_every - 1:
            return other  # measured again: the load, or the prompt's acceptance, may have changed
        return best

    def describe(self) -> dict:
        return {"current": self.current, "blocks": dict(self.blocks), "turns_gain": self.gain(),
                "tokens_per_s": {s: self.rate(s) for s in SCHEDULES}}

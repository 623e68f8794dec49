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
can also change with the load on a shared machine and with the prompt. So it is measured,
not predicted. Blocks of passes run each schedule, and each is scored by committed tokens
per second of its cycles. The faster one then runs, and the other gets one block again
every ``explore_every`` blocks.

A pass's cycle runs from the moment its tree is ready to the moment the next tree is
ready: its verification and the drafting that its schedule leaves unhidden.

Pure logic, no trio: the driver reports each pass and asks which schedule the next one runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

OVERLAP, TURNS = "overlap", "turns"
SCHEDULES = (OVERLAP, TURNS)


@dataclass
class ScheduleChoice:
    """Chooses ``overlap`` or ``turns`` block by block, from their measured tokens per second."""

    block: int = 4  # passes per block: one schedule runs a whole block (its first pass inherits the last one's tree)
    warmup: int = 2  # blocks of each schedule, alternating, before the faster one is chosen
    explore_every: int = 6  # then any this many blocks in a row run each schedule at least once
    decay: float = 0.6  # weight of a schedule's earlier blocks against its newest one
    current: str = OVERLAP
    tokens: dict = field(default_factory=lambda: dict.fromkeys(SCHEDULES, 0.0))  # decayed sums per schedule
    seconds: dict = field(default_factory=lambda: dict.fromkeys(SCHEDULES, 0.0))
    blocks: dict = field(default_factory=lambda: dict.fromkeys(SCHEDULES, 0))
    last_block: dict = field(default_factory=lambda: dict.fromkeys(SCHEDULES, 0))  # number of its latest block
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

    def observe(self, tokens: int, seconds: float) -> None:
        """One pass of the current schedule: ``tokens`` committed in a cycle of ``seconds``."""
        if seconds < 0 or tokens < 0:
            raise ValueError(f"a pass commits tokens >= 0 in seconds >= 0, got {tokens} in {seconds}")
        self._passes += 1
        self._block_tokens += tokens
        self._block_s += seconds
        if self._passes >= self.block:
            self._close_block()

    def _close_block(self) -> None:
        s = self.current
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
        best = max(SCHEDULES, key=lambda s: self.rate(s) or 0.0)
        other = next(s for s in SCHEDULES if s != best)
        if sum(self.blocks.values()) - self.last_block[other] >= self.explore_every - 1:
            return other  # measured again: the load, or the prompt's acceptance, may have changed
        return best

    def describe(self) -> dict:
        return {"current": self.current, "blocks": dict(self.blocks),
                "tokens_per_s": {s: self.rate(s) for s in SCHEDULES}}

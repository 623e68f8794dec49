"""Which schedule lever's passes run: drafting beside the pass, or the two taking turns.

* ``overlap``: while the target verifies, the drafter drafts the trees of the pass's likely
  outcomes on its own core (cross-step drafting), then lends that core to the pass.
* ``turns``: the pass runs on every core with no drafting beside it; after the commit the
  next tree is drafted on every core, from the outcome that happened.

Which is faster depends on the host. Where flash reads bound a pass (an AVX-512 host at
the standard budget), drafting beside the pass costs nothing and hides the draft. Where
the target's compute bounds it (an AVX2 host: a verified row costs ~30 ms of one core),
the pass and the draft each run nearly twice as fast alone as beside each other, and they
share one memory bus. The answer can also change with the load on a shared machine. So it
is measured, not predicted: blocks of passes run each schedule, and the schedule whose passes
cycle faster runs next; the other one gets a block again within every ``explore_every``, so
that its measure follows the host.

A pass's cycle runs from the moment its tree is ready to the moment the next tree is ready:
its verification and the drafting its schedule leaves unhidden. Seconds per cycle, not tokens
per second, decide, and only blocks next to each other in one sequence are compared: each such
pair gives the log ratio of their mean cycles, and the decayed mean of those ratios decides.
What was tried first, on a host emulated to be read-bound where overlap ran 1.14x faster:
* tokens per second of each schedule's blocks: a pass commits 1 to 10 tokens depending on the
  prompt, and this took turns for 35% of the passes (the planner's expected tokens, no better);
* the planner's cost model of each schedule: a turns model starts as a copy of the overlap one
  and learns its drafting cost a pass at a time, too slowly for a bench of 60 passes;
* a moving average of each schedule's cycle: a prompt's trees set its cycle (0.57-0.72 s for
  overlap alone, prompt to prompt) about as much as the schedule does. Still 37% turns.
Turns' fresh trees commit a few percent more tokens a pass, which this leaves out: a tie goes
to overlap.

Pure logic, no trio: the driver reports each pass and asks which schedule the next one runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

OVERLAP, TURNS = "overlap", "turns"
SCHEDULES = (OVERLAP, TURNS)


@dataclass
class ScheduleChoice:
    """Chooses ``overlap`` or ``turns`` block by block: the one whose passes cycle faster."""

    block: int = 3  # passes per block: one schedule runs a whole block (its first pass inherits the last one's tree)
    warmup: int = 2  # blocks of each schedule, alternating, before the cheaper one is chosen
    explore_every: int = 8  # then any this many blocks in a row run each schedule at least once
    decay: float = 0.8  # weight of a schedule's earlier blocks in its reported tokens per second
    alpha: float = 0.2  # weight of a schedule's newest pass in its seconds per cycle
    current: str = OVERLAP
    cycle_s: dict = field(default_factory=lambda: dict.fromkeys(SCHEDULES))  # moving average per schedule
    log_ratio: float = 0.0  # decayed sum of log(turns cycle / overlap cycle) over adjacent blocks
    pairs: float = 0.0  # ... and their decayed count
    _previous: tuple[str, float] | None = None  # the last block of this sequence: its schedule and mean cycle
    tokens: dict = field(default_factory=lambda: dict.fromkeys(SCHEDULES, 0.0))  # decayed sums per schedule
    seconds: dict = field(default_factory=lambda: dict.fromkeys(SCHEDULES, 0.0))
    blocks: dict = field(default_factory=lambda: dict.fromkeys(SCHEDULES, 0))
    last_block: dict = field(default_factory=lambda: dict.fromkeys(SCHEDULES, 0))  # number of its latest block
    _passes: int = 0  # of the current block
    _block_tokens: float = 0.0
    _block_s: float = 0.0

    def __post_init__(self) -> None:
        if self.block < 1 or self.warmup < 1 or self.explore_every < 1 or not 0.0 <= self.decay < 1.0 \
                or not 0.0 < self.alpha <= 1.0:
            raise ValueError("ScheduleChoice needs block, warmup, explore_every >= 1, 0 <= decay < 1, 0 < alpha <= 1")
        if self.current not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.current!r}; schedules: {', '.join(SCHEDULES)}")

    def rate(self, schedule: str) -> float | None:
        """Committed tokens per second of ``schedule``'s cycles (recent blocks weigh more); None unmeasured.
        Reported, not decided on (the prompt moves it more than the schedule does)."""
        s = self.seconds[schedule]
        return self.tokens[schedule] / s if s > 0 else None

    def turns_ratio(self) -> float | None:
        """A turns cycle over an overlap cycle, from adjacent blocks; None before any pair."""
        return float(np.exp(self.log_ratio / self.pairs)) if self.pairs > 0 else None

    def new_sequence(self) -> None:
        """A new generation begins: its blocks are not compared with the last one's (another prompt),
        and the last one's unfinished block ends here."""
        if self._passes:
            self._close_block()
        self._previous = None

    def observe(self, tokens: int, seconds: float) -> None:
        """One pass of the current schedule: ``tokens`` committed in a cycle of ``seconds`` (from its tree
        being ready to the next tree being ready: its verification and the drafting left unhidden)."""
        if seconds < 0 or tokens < 0:
            raise ValueError(f"a pass commits tokens >= 0 in seconds >= 0, got {tokens} in {seconds}")
        self._passes += 1
        old = self.cycle_s[self.current]
        self.cycle_s[self.current] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds
        self._block_tokens += tokens
        self._block_s += seconds
        if self._passes >= self.block:
            self._close_block()

    def _close_block(self) -> None:
        s = self.current
        mean = self._block_s / self._passes
        if mean > 1e-6:  # (a block measured as taking no time says nothing)
            if self._previous is not None and self._previous[0] != s:
                ratio = float(np.log(mean / self._previous[1]))
                self.log_ratio = self.decay * self.log_ratio + (ratio if s == TURNS else -ratio)
                self.pairs = self.decay * self.pairs + 1.0
            self._previous = (s, mean)
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
        ratio = self.turns_ratio()
        if ratio is None:
            ratio = self.cycle_s[TURNS] / self.cycle_s[OVERLAP]
        best = TURNS if ratio < 1.0 else OVERLAP
        other = next(s for s in SCHEDULES if s != best)
        if sum(self.blocks.values()) - self.last_block[other] >= self.explore_every - 1:
            return other  # measured again: the host's load may have changed
        return best

    def describe(self) -> dict:
        return {"current": self.current, "blocks": dict(self.blocks),
                "cycle_s": dict(self.cycle_s), "turns_ratio": self.turns_ratio(),
                "tokens_per_s": {s: self.rate(s) for s in SCHEDULES}}

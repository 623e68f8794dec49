"""Which schedule lever's passes run: drafting beside the pass, or the two taking turns.

* ``overlap``: while the target verifies, the drafter drafts the trees of the pass's likely
  outcomes on its own core (cross-step drafting), then lends that core to the pass.
* ``turns``: the pass runs on every core with no drafting beside it; after the commit the
  next tree is drafted on every core, from the outcome that happened.

Which is faster depends on the host. Where flash reads bound a pass (an AVX-512 host at
the standard budget), drafting beside the pass costs nothing and hides the draft. Where
the target's compute bounds it (an AVX2 host: a verified row costs ~30 ms of one core),
the pass and the draft each run nearly twice as fast alone as beside each other, and they
share one memory bus. The answer can also change with the load on a shared machine.

So the overlap passes measure it: their flash reads against their layer compute (the median of
the last ``window`` overlap passes' compute less reads). While the reads take longer, the cores
idle for them and drafting beside the pass is free: overlap. Once compute takes longer, every
core is busy and the draft beside the pass slows it: turns. Blocks of passes run one schedule;
taking turns, one block in every ``explore_every`` runs overlap again so that the measure follows
the host.

A median, not a moving average: the first passes of a request verify the large tree drafted
beside its prefill and compute up to twice as long as the rest, and a moving average seeded by
them stayed above the reads through the warm-up. On a disk reading 3.6-4 GB/s, where overlap
passes read for 0.23 s and computed for 0.15 s, lever then took turns for the next 20-50 passes
and ran 0.91x and 0.93x `+no-auto-schedule` (HumanEval 0:10, 768 MiB, 2026-12-06; in the trace of
one run the first two passes computed 0.50 and 0.31 s against 0.24 s of reads, and the average was
still 0.27 against 0.23 after six passes).

Measured (docs/measured-history.md, "The session before: lever picks its schedule by the
host"; `+no-auto-schedule` is overlap always, `+no-overlap` turns always):
* AVX2 host, 768 MiB, held-out HumanEval 100:110: overlap passes compute 1.33x their reads;
  lever took turns in 86% of its passes and ran 1.13x `+no-auto-schedule`.
* AVX2 host, 600 MiB, HumanEval 100:105: compute 1.14x the reads; 83% turns, 1.12x.
* The same host with reads capped at 1.5 GB/s (development prompts): compute 0.68x the reads;
  no pass took turns, where `+no-overlap` ran 0.85x overlap.

Turns that ran slower is not taken again for a while (``veto``; ``+no-turns-veto`` switches it off).
Compute near the reads says little about which schedule is faster: on this AVX-512 host, its disk
reading 3.1-3.3 GB/s (2026-12-06, HumanEval 10:40, 768 MiB), lever took turns on whole prompts whose
overlap passes computed about as long as they read (21-28% of its passes), and its turns blocks
committed 21.5-21.8 tokens a second against its overlap blocks' 28.5-33.6: a tree drafted after the
pass is cut where a waited-for level stops paying, shallower than one drafted beside it. So once a
turns block's rate falls below the overlap blocks' (each a decayed sum over its recent blocks), the
next blocks run overlap until ``forget`` blocks have passed, and then turns may be tried again. In
the same runs (`bench --modes lever,lever+no-turns-veto,lever+no-auto-schedule`, twice) lever took
turns in 1-3% of its passes and ran 23.51 / 22.69 tok/s against 21.98 / 22.28 without the veto
(1.07x, 1.02x; 7.26 / 7.37 against 6.93 / 6.71 tok/s per GB/s read) and level with always drafting
beside (23.54 / 23.80). A rate rests on a few prompts, so the veto can misjudge too; it only ever
holds turns back, and forgets.

Tried first, and not kept: choosing by what each schedule reached, in blocks of three passes.
A pass commits 1 to 10 tokens and takes 0.5-0.9 s depending on the prompt and its trees, about
as much as the schedule moves it. Tokens per second, the planner's expected tokens, seconds per
cycle, and the cycles of adjacent blocks of one sequence all took turns for 35-41% of the passes
where overlap ran 1.12-1.19x faster. Each schedule's own cost model converged too slowly.

Pure logic, no trio: the driver reports each pass and asks which schedule the next one runs.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

OVERLAP, TURNS = "overlap", "turns"
SCHEDULES = (OVERLAP, TURNS)


@dataclass
class ScheduleChoice:
    """Chooses ``overlap`` or ``turns`` block by block: turns once overlap passes compute longer than they read."""

    block: int = 3  # passes per block: one schedule runs a whole block (its first pass inherits the last one's tree)
    warmup: int = 2  # overlap blocks before the first choice
    explore_every: int = 8  # taking turns, any this many blocks in a row hold an overlap block
    decay: float = 0.8  # weight of a schedule's earlier blocks in its reported tokens per second
    window: int = 6  # the latest overlap passes whose reads and compute the choice rests on
    veto: bool = True  # turns that committed fewer tokens a second than overlap is not taken again until forgotten
    forget: int = 32  # blocks after which a turns block's rate no longer vetoes turns
    current: str = OVERLAP
    passes: deque = field(default_factory=deque)  # (reads_s, compute_s) of the latest overlap passes
    tokens: dict = field(default_factory=lambda: dict.fromkeys(SCHEDULES, 0.0))  # decayed sums per schedule
    seconds: dict = field(default_factory=lambda: dict.fromkeys(SCHEDULES, 0.0))
    blocks: dict = field(default_factory=lambda: dict.fromkeys(SCHEDULES, 0))
    last_block: dict = field(default_factory=lambda: dict.fromkeys(SCHEDULES, 0))  # number of its latest block
    _passes: int = 0  # of the current block
    _block_tokens: float = 0.0
    _block_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.block, self.warmup, self.explore_every, self.window, self.forget) < 1 or not 0.0 <= self.decay < 1.0:
            raise ValueError("ScheduleChoice needs block, warmup, explore_every, window, forget >= 1 and 0 <= decay < 1")
        if self.current not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.current!r}; schedules: {', '.join(SCHEDULES)}")
        self.passes = deque(self.passes, maxlen=self.window)  # the oldest pass drops out by itself

    def rate(self, schedule: str) -> float | None:
        """Committed tokens per second of ``schedule``'s cycles (recent blocks weigh more); None unmeasured.
        Not what the choice rests on (the prompt moves it more than the schedule does), only a veto:
        turns that ran slower than overlap is not taken again until ``forget`` blocks later."""
        s = self.seconds[schedule]
        return self.tokens[schedule] / s if s > 0 else None

    @property
    def reads_s(self) -> float | None:
        """The latest overlap passes' flash reads (median); None before one was measured."""
        return median(r for r, _ in self.passes) if self.passes else None

    @property
    def compute_s(self) -> float | None:
        """... and their layer compute."""
        return median(c for _, c in self.passes) if self.passes else None

    def compute_bound(self) -> bool | None:
        """Whether overlap passes compute longer than they read (the median pass); None before one was measured."""
        if not self.passes:
            return None
        return median(c - r for r, c in self.passes) > 0

    def turns_lost(self) -> bool:
        """Whether turns blocks committed fewer tokens a second than overlap blocks, measured within the
        last ``forget`` blocks (older, the host may have changed: turns may be tried again)."""
        turns, overlap = self.rate(TURNS), self.rate(OVERLAP)
        recent = sum(self.blocks.values()) - self.last_block[TURNS] < self.forget
        return turns is not None and overlap is not None and recent and turns < overlap

    def turns_vetoed(self) -> bool:
        """Whether the veto holds turns back now."""
        return self.veto and self.turns_lost()

    def observe(self, tokens: int, seconds: float, reads_s: float | None, compute_s: float) -> None:
        """One pass of the current schedule: ``tokens`` committed in a cycle of ``seconds`` (from its tree
        being ready to the next tree being ready), its flash reads (None: nothing streams) and compute."""
        if min(tokens, seconds, compute_s, reads_s or 0.0) < 0:
            raise ValueError(f"a pass's tokens and seconds are >= 0, got {tokens}, {seconds}, {reads_s}, {compute_s}")
        self._passes += 1
        if self.current == OVERLAP:
            self.passes.append((reads_s or 0.0, compute_s))
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
        if self.blocks[OVERLAP] < self.warmup or not self.compute_bound() or self.turns_vetoed():
            return OVERLAP
        if sum(self.blocks.values()) - self.last_block[OVERLAP] >= self.explore_every - 1:
            return OVERLAP  # measured again: the host's load may have changed
        return TURNS

    def describe(self) -> dict:
        return {"current": self.current, "blocks": dict(self.blocks),
                "reads_s": self.reads_s, "compute_s": self.compute_s,
                "tokens_per_s": {s: self.rate(s) for s in SCHEDULES},
                "turns_vetoed": self.turns_vetoed()}

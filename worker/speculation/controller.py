"""The cost controller: speculation stays on for a row only while its accepted tokens pay for the wider step.

Pure: no MLX, no clock (the batch passes the times it measured); Speculation (below) holds a batch's rows.
A verification step that is `c` times as costly as a plain decode step pays when the batch's B
rows accepted at least (c - 1) * B drafted tokens in it: each drafting row's share of that break-even is charged
to it. A row's rounds (steps it drafted in) are grouped in windows of `window` rounds; after `patience`
unprofitable windows in a row it is switched off, and probed again `probe` steps later (the wait doubles each
time it is switched off again, up to MAX_PROBE).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from omlx_jobs.worker.speculation.proposer import MAX_N, MIN_N, NgramProposer

WINDOW = 4
PATIENCE = 2
PROBE = 32
MAX_PROBE = 512
K_START, K_MAX = 4, 8
MIN_CHARGE = 0.05
"""Break-even charged per round at least, so that a row accepting nothing is never counted as paying."""


@dataclass
class RowController:
    """One row's speculation state: on or off, its draft length, and the window it is measured over."""

    k_max: int = K_MAX
    window: int = WINDOW
    patience: int = PATIENCE
    probe: int = PROBE
    k: int = K_START
    off_until: int = -1
    """The step from which the row drafts again (-1: on)."""
    rounds: int = 0
    accepted: int = 0
    charged: float = 0.0
    losses: int = 0
    """Unprofitable windows in a row."""
    switched_off: int = 0

    def __post_init__(self) -> None:
        self.k = min(self.k, self.k_max)

    def wants(self, step: int) -> int:
        """How many tokens the row may draft at `step` (0: it is off)."""
        if self.off_until < 0:
            return self.k
        if step >= self.off_until:  # probe again
            self.off_until = -1
            return self.k
        return 0

    def record(self, step: int, drafted: int, accepted: int, charge: float) -> None:
        """A round: `drafted` tokens verified, `accepted` of them right, `charge` its share of the break-even."""
        self.k = min(self.k_max, self.k * 2) if accepted == drafted else max(1, accepted + 1)
        self.rounds += 1
        self.accepted += accepted
        self.charged += max(charge, MIN_CHARGE)
        if self.rounds < self.window:
            return
        self.losses = 0 if self.accepted >= self.charged else self.losses + 1
        self.rounds, self.accepted, self.charged = 0, 0, 0.0
        if self.losses >= self.patience:
            self.losses = 0
            wait = min(MAX_PROBE, self.probe * 2**self.switched_off)
            self.switched_off += 1
            self.off_until = step + wait


@dataclass
class StepCosts:
    """Measured seconds of plain decode steps and of verification steps by width, as moving averages."""

    smoothing: float = 0.2
    plain: float | None = None
    wide: dict[int, float] = field(default_factory=dict)
    guess_per_position: float = 0.15
    """A width not measured yet is guessed to cost this much more per extra position."""

    def observe(self, width: int, seconds: float) -> None:
        if width <= 1:
            self.plain = seconds if self.plain is None else self.plain + self.smoothing * (seconds - self.plain)
            return
        old = self.wide.get(width)
        self.wide[width] = seconds if old is None else old + self.smoothing * (seconds - old)

    def ratio(self, width: int) -> float:
        """How many plain steps one verification step of `width` positions costs."""
        if width <= 1:
            return 1.0
        measured = self.wide.get(width)
        if measured is None or not self.plain:
            return 1.0 + self.guess_per_position * (width - 1)
        return max(1.0, measured / self.plain)

    def charges(self, width: int, rows: int, drafting: int) -> float:
        """Each drafting row's share of the tokens a verification step of `width` over `rows` rows must gain."""
        return (self.ratio(width) - 1.0) * rows / max(1, drafting)


@dataclass
class Figures:
    """What speculation did in a batch: tokens drafted and accepted, and the steps that verified drafts."""

    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    plain_steps: int = 0

    @property
    def rejected(self) -> int:
        return self.drafted - self.accepted


class Speculation:
    """A batch's speculation state: each row's proposer and controller (by row id), the step costs, the figures."""

    def __init__(self, *, k_max: int = K_MAX, min_n: int = MIN_N, max_n: int = MAX_N) -> None:
        self.k_max, self.min_n, self.max_n = k_max, min_n, max_n
        self.rows: dict[int, tuple[NgramProposer, RowController]] = {}
        self.costs, self.figures, self.step = StepCosts(), Figures(), 0

    def wants(self, row: int) -> int:
        """How many tokens `row` may draft this step (0: off)."""
        state = self.rows.get(row)
        if state is None:
            return min(K_START, self.k_max)
        return state[1].wants(self.step)

    def draft(self, row: int, tokens: Sequence[int], pending: int, k: int) -> list[int]:
        """Up to k drafts after `tokens` (what the row's cache holds) and its `pending` token (sampled, not fed)."""
        state = self.rows.get(row)
        if state is None:
            proposer = NgramProposer(min_n=self.min_n, max_n=self.max_n)
            state = self.rows[row] = (proposer, RowController(k_max=self.k_max))
        proposer = state[0]
        proposer.extend(tokens[len(proposer) :])  # the proposer mirrors the cache: it only ever grows
        proposer.extend([pending])
        drafts = proposer.propose(k)
        proposer.retract()
        return drafts

    def record(self, row: int, drafted: int, accepted: int, charge: float) -> None:
        self.rows[row][1].record(self.step, drafted, accepted, charge)
        self.figures.drafted += drafted
        self.figures.accepted += accepted

    def forget(self, live: Iterable[int]) -> None:
        """Drop the rows not in `live` (they left the batch)."""
        keep = set(live)
        for row in [r for r in self.rows if r not in keep]:
            del self.rows[row]

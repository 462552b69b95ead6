"""The contract between the runtime and an engine: what a caller says between steps (Control), what it is told
and asked during a run (Hooks), and what an engine offers (EngineLike: engine/loop.Engine, vision/serial.SerialEngine).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from omlx_jobs.jobs.formats import SamplingParams
from omlx_jobs.jobs.params import OutputParams
from omlx_jobs.worker.cache.prefix_cache import PrefixCache
from omlx_jobs.worker.engine.results import ItemResult, PlanTotals, RunStats
from omlx_jobs.worker.engine.sequence import WorkItem
from omlx_jobs.worker.models.loaded import LoadedModel


class Control(enum.Enum):
    """What the caller says between steps."""

    RUN = enum.auto()
    DRAIN = enum.auto()  # admit nothing new; let in-flight requests finish
    STOP = enum.auto()  # stop now; unfinished requests stay pending (they run again later)
    CANCEL = enum.auto()  # stop now; unfinished requests are reported for cancellation


def keep_running() -> Control:
    """The control of a run nobody stops."""
    return Control.RUN


ResultsHook = Callable[[list[ItemResult]], None]


@dataclass(frozen=True)
class Hooks:
    """What a run tells its caller and asks it, in one object (the shard runner's, through containment)."""

    results: ResultsHook
    """Gets the items that finished in a step, at once (then they are forgotten)."""
    control: Callable[[], Control] = keep_running
    """Asked between steps."""
    admit: Callable[[list[Any]], None] | None = None
    """Gets the keys of items about to start, once per refill (the store charges each an attempt)."""
    plan: Callable[[PlanTotals], None] | None = None
    """Gets the totals of each page of input as it is planned."""
    refund: Callable[[list[Any]], None] | None = None
    """Gets the keys of items whose attempt ended in an engine exception (containment hands the attempt back)."""

    @classmethod
    def of(cls, hooks: Hooks | ResultsHook) -> Hooks:
        """`hooks`, or a results callback alone as Hooks."""
        return hooks if isinstance(hooks, Hooks) else cls(hooks)


class EngineLike(Protocol):
    """What the runtime (shard, containment, the worker's context) needs of an engine."""

    loaded: LoadedModel
    cache: PrefixCache
    """The prefix cache (the serial engine's holds nothing); the shard runner reports its peak bytes."""

    def check(self, tokens: Sequence[int], params: SamplingParams, output: OutputParams | None = None) -> None:
        """Raise PromptError if this request cannot run here (it then fails alone)."""
        ...

    def run(self, items: Iterable[WorkItem], hooks: Hooks | ResultsHook, *, page_size: int | None = None) -> RunStats:
        """Generate every item; hooks.results gets each as it finishes."""
        ...

    def reset(self) -> None:
        """Drop what an exception mid-run may have left broken (shared samplers, in-memory cached prefixes)."""
        ...

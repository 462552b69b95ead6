"""What a routed attention call may use: the engine's switches as attention sees them, and its kernels.

A backend builds one `Routing` from its `defaults.Switches` (routing.py `for_backend`) and makes it active around
the model calls it runs; outside them the defaults below apply (mx ops, CPU prefill blocks, no CUDA kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from omlx_jobs import defaults
from omlx_jobs.defaults import Mode

MEMO_ENTRIES = 256
"""Compiled graphs kept per kind: batches of ever new level structures and shapes would grow the memo."""


def mode_on(mode: Mode) -> bool:
    """Whether an "auto" / "always" / "never" switch is on here: "auto" means on GPUs (Metal, CUDA)."""
    return mode == "always" or (mode == "auto" and mx.default_device() != mx.cpu)


class Graphs:
    """Compiled decode graphs and merges of one routing, by key; bounded (MEMO_ENTRIES per kind)."""

    def __init__(self) -> None:
        self.decode_steps: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self.merges: dict[tuple[Any, ...], Callable[..., Any]] = {}

    @staticmethod
    def get(
        memo: dict[tuple[Any, ...], Callable[..., Any]], key: tuple[Any, ...], build: Callable[[], Any], compiled: bool
    ) -> Any:
        """memo[key], built (and compiled shapeless when `compiled`) the first time."""
        fn = memo.get(key)
        if fn is None:
            if len(memo) >= MEMO_ENTRIES:
                memo.clear()
            fn = memo[key] = mx.compile(build(), shapeless=True) if compiled else build()
        return fn


@dataclass(frozen=True)
class CascadeOptions:
    """How cascade attention runs (cascade.py): compiled or not, through mlx's fused attention or not, and which
    CUDA kernels a decode step uses (None: mx ops). The defaults are the switches' defaults, without kernels."""

    compile: Mode = "auto"
    """OMLX_JOBS_CASCADE_COMPILE: compile the mx-ops path ("auto": on GPUs)."""
    fused_prefill: Mode = "auto"
    """OMLX_JOBS_CASCADE_FUSED_PREFILL: prefill chunks of one prefix group through fused attention (fused.py)."""
    fused_decode: bool = False
    """OMLX_JOBS_CASCADE_FUSED_DECODE=1: decode steps through fused attention (fused.py)."""
    packed: Mode = "auto"
    """OMLX_JOBS_CASCADE_PACKED: a decode step's levels in one masked call over their packed keys (packed.py)."""
    rows_per_call: int = defaults.FUSED_ROWS_PER_CALL
    """Rows per block of a fused decode call (fused.decode)."""
    score_budget: int = 1 << 26
    """Score-matrix elements per part (256 MB in float32): longer prefills are split into chunks of queries."""
    suffix_kernel: Callable[..., mx.array] | None = None
    """The rows' own suffixes of a decode step, merged with the levels (suffix_kernel.suffix_decode's contract)."""
    prefix_kernel: Callable[..., tuple[mx.array, mx.array]] | None = None
    """A decode step's prefix levels (prefix_kernel.prefix_decode's contract); only with a suffix kernel."""
    graphs: Graphs = field(default_factory=Graphs, compare=False, repr=False)
    """The compiled graphs of this routing's decode steps (cascade_decode.py)."""

    @property
    def compiling(self) -> bool:
        return mode_on(self.compile)

    @property
    def packing(self) -> bool:
        return mode_on(self.packed)


@dataclass(frozen=True)
class Routing:
    """Where routing.route sends a call of the model's attention (see routing.py)."""

    cpu_prefill: bool = True
    """OMLX_JOBS_CPU_PREFILL: prefill chunks on the CPU in causal blocks (cpu_prefill.py)."""
    ragged: Callable[..., mx.array] | None = None
    """The decode kernel for rows of a BatchKVCache (ragged.ragged_decode's contract); None: mlx-lm's path."""
    cascade: CascadeOptions = field(default_factory=CascadeOptions)

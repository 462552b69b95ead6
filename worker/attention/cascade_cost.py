"""Whether a row references a shared prefix level (cascade attention) or holds a copy of it: a pure cost model.

A decode step pays, per layer, for each level it references: a fixed cost (a call, its merge) plus its tokens read
once for all its rows. A level copied into its rows instead costs nothing of its own, but each row that holds it
reads its tokens again in its own suffix (and, where the own-suffix attention reads every row to the longest own
suffix, every row of the batch pays). So a short level, or one shared by few rows, is cheaper copied; a long level
shared by many rows is cheaper referenced. The device's costs are measured at start-up (calibrate.py) for the
model's shape; this module only compares them, with no MLX, so the choice is a pure function of its inputs.

Levels are a row's chain, shallowest first (a system prompt, then a document): the row references the first k and
holds the rest as its own tokens (a copy of a shallower level under a referenced deeper one is no layout the batch
cache has), so the choice is k, the first level not worth referencing ends the references.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

COPY_BYTES_LIMIT = 8 * 1024**3
"""Copies of one level that would take more bytes than this (across the batch, padding included) are referenced
whatever the time model says: cascade's memory saving is the reason it exists. A GPU's limit is a quarter of its
memory where that is more (calibrate.py)."""


@dataclass(frozen=True)
class DeviceCosts:
    """What one layer of a decode step costs on this device for this model shape (seconds), measured at start-up."""

    level_call_s: float
    """A referenced level's fixed cost per layer and step: its attention call and its merge with the others."""
    level_token_s: float
    """Per token of a referenced level, read once for all the rows that continue it."""
    copy_token_s: float
    """Per row and token of the rows' own suffixes (what a copied level adds to each row that holds it)."""
    padded: bool = False
    """The own-suffix attention reads every row up to the longest own suffix (mx ops with a mask; not the CUDA
    suffix kernel, which starts each row at its first real key): a copy then costs every row of the batch."""
    bytes_per_token: int = 0
    """Keys and values of one token over all layers (for COPY_BYTES_LIMIT); 0: no memory limit."""
    level_row_token_s: float = 0.0
    """Per row and token of a referenced level (compute-bound devices: the CPU; a GPU's is in level_token_s)."""
    copy_limit: int = COPY_BYTES_LIMIT
    """Bytes of copies of one level past which it is referenced (the default of `references`' limit)."""
    min_tokens: int = 0
    """Levels shorter than this are copied whatever the per-step model says (the memory limit still applies): a
    referenced level also costs its rows' prefill passes, which the per-step model does not see. On the H200
    (random Qwen3-8B, bf16) the dataset job's levels of 200-400 tokens, 32 rows each, cost 26.8 ms a step and
    4.5 s of prefill referenced against 20.5 ms and 1.7 s copied (bench/engine/dataset_job.py)."""

    @classmethod
    def always_reference(cls) -> DeviceCosts:
        """Costs under which every level is referenced (what the engine did before the cost model)."""
        return cls(level_call_s=0.0, level_token_s=0.0, copy_token_s=1.0)

    @classmethod
    def always_copy(cls) -> DeviceCosts:
        """Costs under which every level is copied (cascade off for the decode steps, levels still cut)."""
        return cls(level_call_s=1.0, level_token_s=1.0, copy_token_s=0.0)


@dataclass(frozen=True)
class LevelUse:
    """One level of a row's chain, as the batch would hold it."""

    length: int
    """Tokens of the level."""
    sharers: int
    """Rows that would reference it: the batch's rows referencing it now plus the rows admitted with this one."""
    live: bool = False
    """A row of the batch references it already: its fixed cost is paid, another row adds only its queries."""


def reference_cost(level: LevelUse, costs: DeviceCosts) -> float:
    """Seconds per layer and step that referencing `level` adds (nothing fixed if it is live)."""
    fixed = 0.0 if level.live else costs.level_call_s
    return fixed + level.length * (costs.level_token_s + level.sharers * costs.level_row_token_s)


def copy_cost(level: LevelUse, batch: int, costs: DeviceCosts) -> float:
    """Seconds per layer and step that copying `level` into its sharers' own suffixes adds."""
    readers = max(batch, level.sharers) if costs.padded else level.sharers
    return readers * level.length * costs.copy_token_s


def copy_bytes(level: LevelUse, batch: int, costs: DeviceCosts) -> int:
    """Bytes the copies take: every row of the batch is padded to the longest own suffix."""
    return max(batch, level.sharers) * level.length * costs.bytes_per_token


def references(level: LevelUse, batch: int, costs: DeviceCosts, limit: int | None = None) -> bool:
    """Whether `level` is cheaper referenced than copied (a live level always is; a tie references); `limit`:
    costs.copy_limit unless given."""
    limit = costs.copy_limit if limit is None else limit
    if level.live or (costs.bytes_per_token and copy_bytes(level, batch, costs) > limit):
        return True
    if level.length < costs.min_tokens:
        return False
    return reference_cost(level, costs) <= copy_cost(level, batch, costs)


def referenced_levels(levels: Sequence[LevelUse], batch: int, costs: DeviceCosts, limit: int = COPY_BYTES_LIMIT) -> int:
    """How many of a row's levels (shallowest first) it references; it holds the rest as copies."""
    for i, level in enumerate(levels):
        if not references(level, batch, costs, limit):
            return i
    return len(levels)

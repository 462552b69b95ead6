"""A test hook into the engine, off unless a test sets it.

`on_row(work, row)` is called as each sequence is admitted, before its row joins the batch, and may change the
row. The poison tests (tests/test_containment.py) give one request mlx-lm's own sampler with a top_k beyond the
vocabulary, so that the engine raises inside mlx-lm during a step, as issue 10's defect 2 did, and the real
containment (worker/runtime/containment.py) must deal with it. Nothing outside the tests sets it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

on_row: Callable[[Any, Any], None] | None = None
"""(WorkItem, backend.RowSpec) -> None; None (the default) is no hook."""

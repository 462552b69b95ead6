"""An output split into its thinking (reasoning_content) and its answer (content), and its reasoning tokens
counted. Pure: no MLX.

The output starts inside the thinking when the prompt opened the block (markers.opens_thinking); otherwise
thinking is there only if the output starts with the open marker. The reasoning tokens are the output's tokens
up to and including the close marker (the open marker included): every token that is not the answer's. An
output cut inside its thinking has all its text as reasoning and an empty answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from omlx_jobs.worker.reasoning.markers import CLOSE, OPEN, ThinkMarkers


@dataclass(frozen=True)
class Split:
    reasoning: str | None
    """None: the output did not think."""
    content: str
    reasoning_tokens: int


def split_text(text: str, *, opened: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of an output's text."""
    if not opened:
        stripped = text.lstrip()
        if not stripped.startswith(OPEN):
            return None, text
        text = stripped[len(OPEN) :]
    head, closed, tail = text.partition(CLOSE)
    if not closed:
        return head.strip(), ""
    return head.strip(), tail.lstrip()


def reasoning_tokens(tokens: Sequence[int], markers: ThinkMarkers, *, opened: bool) -> int:
    """How many of the output's tokens belong to its thinking (see the module docstring)."""
    if not opened and (not tokens or tokens[0] != markers.open_id):
        return 0
    for i, t in enumerate(tokens):
        if t == markers.close_id:
            return i + 1
    return len(tokens)


def split_output(text: str, tokens: Sequence[int], markers: ThinkMarkers, *, opened: bool) -> Split:
    """The thinking and the answer of one output (`tokens` are the kept ones, `text` their final text)."""
    reasoning, content = split_text(text, opened=opened)
    return Split(reasoning, content, reasoning_tokens(tokens, markers, opened=opened) if reasoning is not None else 0)

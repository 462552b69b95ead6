"""A family's think markers, found from its chat template and tokenizer. No MLX.

Qwen3, Qwen3.5, DeepSeek-R1 distills and SmolLM3 write their thinking between `<think>` and `</think>`; each
marker is one token of their vocabulary. Some templates open the block in the generation prompt themselves
(DeepSeek-R1 distills, Qwen3 thinking-only checkpoints): the output then starts inside the thinking, which
`opens_thinking` tells from the prompt's tokens. The close sequence the budget forces is the marker as the
template renders it after the thinking: `\\n</think>\\n\\n`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<think>", "</think>"
CLOSE_SEQUENCE = "\n</think>\n\n"


def single_token(tokenizer: Any, text: str) -> int | None:
    """The id of `text` when the vocabulary holds it as one token, else None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def chat_template(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else str(template)


@dataclass(frozen=True)
class ThinkMarkers:
    """The thinking block of a family: its open and close tokens, and the close sequence to force."""

    open_id: int
    close_id: int
    close_sequence: tuple[int, ...]
    """Tokens of CLOSE_SEQUENCE; the close token is among them."""
    switch: bool
    """The template reads `enable_thinking`: thinking can be turned off by rendering its no-thinking form."""

    @classmethod
    def find(cls, tokenizer: Any) -> ThinkMarkers | None:
        """The markers of a template that thinks (it writes both markers, each one token), or None."""
        template = chat_template(tokenizer)
        if OPEN not in template or CLOSE not in template:
            return None
        open_id, close_id = single_token(tokenizer, OPEN), single_token(tokenizer, CLOSE)
        if open_id is None or close_id is None:
            return None
        sequence = tuple(int(t) for t in tokenizer.encode(CLOSE_SEQUENCE, add_special_tokens=False))
        if close_id not in sequence:
            sequence = (close_id,)
        return cls(open_id, close_id, sequence, "enable_thinking" in template)

    def opens_thinking(self, prompt: Sequence[int]) -> bool:
        """The prompt ends inside an open thinking block: the output starts with thinking, not with `<think>`."""
        for t in reversed(prompt[-32:]):  # the generation prompt is at the end
            if t == self.close_id:
                return False
            if t == self.open_id:
                return True
        return False

    @property
    def tail(self) -> tuple[int, ...]:
        """The close sequence after its close token (forced after a natural close when the answer is constrained)."""
        return self.close_sequence[self.close_sequence.index(self.close_id) + 1 :]

"""Stop strings: watch a sequence's text as it grows, and cut the final text before the first stop. Pure: no MLX.

End-of-sequence tokens are the backend's (they end a row in the batch); stop strings are text, so they are
checked here on the detokenized output.
"""

from __future__ import annotations

from typing import Any

from omlx_jobs.errors import FinishReason


class StopStrings:
    """Finds a request's stop strings in one sequence's text, detokenizing one token at a time."""

    def __init__(self, stops: tuple[str, ...], detokenizer: Any) -> None:
        self.stops = stops
        self.detokenizer = detokenizer  # mlx-lm's streaming detokenizer, one per sequence
        self.detokenizer.reset()
        self._longest = max(len(s) for s in stops)
        self._scanned = 0

    def hit(self, token: int) -> bool:
        """Feed the newest token; True once a stop string appears in the text."""
        self.detokenizer.add_token(token)
        text = self.detokenizer.text
        start = max(0, self._scanned - self._longest + 1)  # only text a new token can complete
        self._scanned = len(text)
        return any(s in text[start:] for s in self.stops)


def final_text(text: str, stops: tuple[str, ...], reason: str) -> tuple[str, str]:
    """The output text, cut before the first stop string if there is one, and the finish reason then."""
    cut = min((p for p in (text.find(s) for s in stops) if p >= 0), default=-1)
    if cut >= 0:
        return text[:cut], FinishReason.STOP
    return text, reason

"""The stored form of a request's logprobs, both ways: the worker writes it, the output formats read it. Pure.

Stored (a result row's `logprobs` column): {"v": 1, "choices": [[entry, ...], ...], "prompt": [entry, ...]}, the
prompt's entries with echo only. An entry is one token, [piece, logprob] or, when alternatives were asked for
(chat's top_logprobs, completions' logprobs), [piece, logprob, [[piece, logprob], ...]] (null for a prompt's
first token: nothing precedes it). A piece is the token's text when its bytes are valid UTF-8 on their own, else
the list of its bytes (a token can hold part of a character). Results then render without a tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

VERSION = 1

Piece = str | list[int]
Entry = list[Any]
"""One token in the stored form (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class StoredToken:
    """One token of a choice (or of an echoed prompt), as stored."""

    piece: Piece
    logprob: float | None
    """None for a prompt's first token."""
    top: tuple[tuple[Piece, float], ...] | None = None
    """The most likely tokens at its position, most likely first; None when none are stored for it."""

    def encode(self, *, with_top: bool) -> Entry:
        """The entry: [piece, logprob], and with `with_top` its alternatives (null when it has none)."""
        entry: Entry = [self.piece, self.logprob]
        if with_top:
            entry.append(None if self.top is None else [[p, lp] for p, lp in self.top])
        return entry

    @classmethod
    def decode(cls, entry: Entry) -> StoredToken:
        top = entry[2] if len(entry) > 2 else None
        return cls(entry[0], entry[1], None if top is None else tuple((p, lp) for p, lp in top))


@dataclass(frozen=True)
class StoredLogprobs:
    """A request's logprobs as stored: one entry list per choice, and the prompt's with echo."""

    choices: list[list[Entry]]
    prompt: list[Entry] | None = None

    def to_json(self) -> dict[str, Any]:
        """The column's value."""
        out: dict[str, Any] = {"v": VERSION, "choices": self.choices}
        if self.prompt is not None:
            out["prompt"] = self.prompt
        return out

    @classmethod
    def from_json(cls, stored: dict[str, Any] | None) -> StoredLogprobs | None:
        """The column's value read back (None when the request asked for no logprobs)."""
        if not stored:
            return None
        return cls(list(stored["choices"]), stored.get("prompt"))


def encode(tokens: Sequence[StoredToken], *, with_top: bool) -> list[Entry]:
    """Entries of one choice (or one prompt), in the stored form."""
    return [t.encode(with_top=with_top) for t in tokens]


def decode(entries: Sequence[Entry]) -> list[StoredToken]:
    """Tokens of one choice (or one prompt) from their entries."""
    return [StoredToken.decode(e) for e in entries]

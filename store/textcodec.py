"""Text that every database stores as given: a reversible escape for the few characters some refuse.

PostgreSQL text cannot hold U+0000, and no UTF-8 database can hold a lone surrogate (U+D800-U+DFFF, which a
Python str may carry). Those are escaped behind U+FDD0, a Unicode noncharacter ("reserved for internal use"),
which is escaped itself; every other text is stored unchanged, so the column stays readable SQL text and
costs one C-level scan per value. The same code runs on every backend, so a database can move between them.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import Text
from sqlalchemy.types import TypeDecorator

MARK = "\ufdd0"
_NEEDS_ESCAPE = re.compile("[\x00\ufdd0\ud800-\udfff]")
_ESCAPE = re.compile("\ufdd0(?:([01])|s([0-9a-f]{4}))")


def _escape_one(match: re.Match[str]) -> str:
    char = match.group()
    if char == "\x00":
        return MARK + "0"
    if char == MARK:
        return MARK + "1"
    return f"{MARK}s{ord(char):04x}"


def _unescape_one(match: re.Match[str]) -> str:
    if match.group(1) is not None:
        return "\x00" if match.group(1) == "0" else MARK
    return chr(int(match.group(2), 16))


def encode(text: str | None) -> str | None:
    """`text` in a form every backend stores: unchanged unless it holds NUL, U+FDD0 or a lone surrogate."""
    if text is None or not _NEEDS_ESCAPE.search(text):
        return text
    return _NEEDS_ESCAPE.sub(_escape_one, text)


def decode(text: str | None) -> str | None:
    """The original of `encode(text)`. A stray U+FDD0 not followed by an escape is kept as it is."""
    if text is None or MARK not in text:
        return text
    return _ESCAPE.sub(_unescape_one, text)


class SafeText(TypeDecorator[str]):
    """A Text column whose values round-trip exactly on SQLite and PostgreSQL (see the module docstring)."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> str | None:
        return encode(value)

    def process_result_value(self, value: Any, dialect: Any) -> str | None:
        return decode(value)

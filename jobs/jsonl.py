"""JSON lines that every line splitter reads as one line per record. Pure logic.

JSON escapes control characters itself, but with ensure_ascii=False it writes U+0085, U+2028 and U+2029 as
they are: valid JSON, yet Python's str.splitlines() (and JavaScript before ES2019) breaks a line there. Every
JSONL the project writes goes through `dumps_line`, which escapes them as \\uXXXX, as JSON allows.
"""

from __future__ import annotations

import json
from typing import Any

# Every character str.splitlines() splits on besides \n and \r; json escapes those below U+0020 already.
LINE_BREAKS = "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
_ESCAPES = str.maketrans({c: f"\\u{ord(c):04x}" for c in LINE_BREAKS})
_encode = json.JSONEncoder(ensure_ascii=False).encode  # one encoder: json.dumps with options builds one per call


def dumps_line(obj: Any) -> str:
    """`obj` as one line of JSON (no newline), UTF-8 text kept as is, every line break character escaped."""
    return escape_line_breaks(_encode(obj))


def escape_line_breaks(text: str) -> str:
    """JSON text with U+0085, U+2028, U+2029 (and any other splitlines() break) written as \\uXXXX escapes.

    These characters can only stand inside JSON strings, where the escape means the same character.
    """
    return text.translate(_ESCAPES) if not text.isascii() else text

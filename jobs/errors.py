"""Input errors: where a line is wrong (line, field, custom_id), a typed code, and what to do. Pure logic."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any

# Every code an InputError can carry (submit adds "empty_file"): the input is wrong, retrying won't help.
INPUT_ERROR_CODES = frozenset(
    {
        "invalid_request",
        "invalid_encoding",
        "line_too_long",
        "invalid_json",
        "duplicate_key",
        "invalid_type",
        "missing_field",
        "empty_value",
        "out_of_range",
        "too_long",
        "invalid_value",
        "unknown_field",
        "unsupported_parameter",
        "unsupported_method",
        "unsupported_url",
        "endpoint_mismatch",
        "conflicting_fields",
        "invalid_role",
        "unsupported_content",
        "unsupported_schema",
        "invalid_schema",
        "duplicate_custom_id",
        "empty_file",
    }
)


@dataclass(frozen=True)
class InputError:
    """One bad line: where, which field, what is wrong and what to do. Line 0 means the whole file."""

    line: int
    message: str
    field: str | None = None
    custom_id: str | None = None
    code: str = "invalid_request"

    def __str__(self) -> str:
        where = f"line {self.line}" if self.line else "file"
        if self.custom_id is not None:
            where += f" (custom_id {self.custom_id!r})"
        if self.field:
            where += f", field {self.field!r}"
        return f"{where}: {self.message} [{self.code}]"

    def to_dict(self) -> dict[str, Any]:
        return {
            "line": self.line,
            "field": self.field,
            "custom_id": self.custom_id,
            "code": self.code,
            "message": self.message,
        }


class InvalidLine(ValueError):
    def __init__(self, error: InputError) -> None:
        super().__init__(str(error))
        self.error = error


class BadValue(Exception):
    """A value that fails validation; parse_line turns it into an InputError for its line."""

    def __init__(self, code: str, field: str | None, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.field = field
        self.message = message


def describe(value: Any) -> str:
    """A value's JSON type, with the value itself when it is short: `a string ("0.7")`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({'true' if value else 'false'})"
    if isinstance(value, (str, int, float)):
        kind = "a string" if isinstance(value, str) else "an integer" if isinstance(value, int) else "a number"
        shown = json.dumps(value, ensure_ascii=False)
        return f"{kind} ({shown})" if len(shown) <= 40 else kind
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def shown(value: Any) -> str:
    """A value as JSON, cut short: for echoing what the line said."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def did_you_mean(key: str, options: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_text(value: str, name: str) -> str:
    # A JSON escape like "\ud800" decodes to a lone surrogate, which no tokenizer can encode.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ord(value[exc.start])
        raise BadValue(
            "invalid_encoding",
            name,
            f"holds an unpaired surrogate \\u{bad:04x}, which is not valid Unicode; fix the escape",
        ) from None
    return value

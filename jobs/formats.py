"""Input lines: OpenAI batch lines and the shorthand, parsed and validated as a stream.

Pure logic: no Redis, SQL or MLX. Every error names the line, the field, a typed code and what to do.
Parameters live in params.py, errors in errors.py, line reading in lines.py; their public names are
re-exported here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.embeddings import EMBEDDINGS_URL, is_embeddings, validate_body
from omlx_jobs.jobs.errors import (
    INPUT_ERROR_CODES,
    BadValue,
    InputError,
    InvalidLine,
    check_text,
    describe,
    did_you_mean,
    shown,
)
from omlx_jobs.jobs.images import ImageAccess
from omlx_jobs.jobs.lines import MAX_LINE_BYTES, iter_lines
from omlx_jobs.jobs.params import (
    CHAT_URL,
    COMPLETIONS_URL,
    DEFAULT_MAX_TOKENS,
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKENS_LIMIT,
    PASSTHROUGH_KEYS,
    SUPPORTED_PARAMS,
    SamplingParams,
    validate_params,
)
from omlx_jobs.jobs.parts import parse_content
from omlx_jobs.jobs.tools import tool_message

ENDPOINTS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)
_URLS = f"{CHAT_URL}, {COMPLETIONS_URL} or {EMBEDDINGS_URL}"
MAX_CUSTOM_ID_CHARS = 512
ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id")
NO_FILES = ImageAccess()  # data: URIs only; no local files, no remote URLs
BATCH_KEYS = ("custom_id", "method", "url", "body")

__all__ = [
    "CHAT_URL",
    "COMPLETIONS_URL",
    "DEFAULT_MAX_TOKENS",
    "EMBEDDINGS_URL",
    "ENDPOINTS",
    "INPUT_ERROR_CODES",
    "MAX_CUSTOM_ID_CHARS",
    "MAX_LINE_BYTES",
    "MAX_N",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_TOKENS_LIMIT",
    "NO_FILES",
    "PASSTHROUGH_KEYS",
    "SUPPORTED_PARAMS",
    "InputError",
    "InvalidLine",
    "ParsedRequest",
    "SamplingParams",
    "iter_lines",
    "parse_line",
    "parse_stream",
]


@dataclass(frozen=True)
class ParsedRequest:
    """A valid request: `body` is normalized (messages, or a prompt) plus params.

    A message's content is a string, or, when it holds images, a list of text and image_url parts.
    """

    line: int
    custom_id: str
    endpoint: str
    body: dict[str, Any] = field(hash=False)


# ---- messages and prompts ---------------------------------------------------------------------------


def _messages(value: Any, where: str, images: ImageAccess) -> list[dict[str, Any]]:
    name = f"{where}messages"
    if not isinstance(value, list):
        raise BadValue(ErrorCode.INVALID_TYPE, name, f"must be a list of messages, got {describe(value)}")
    if not value:
        raise BadValue(
            ErrorCode.EMPTY_VALUE, name, 'must not be empty: give at least one message, e.g. {"role": "user", ...}'
        )
    out = []
    for i, msg in enumerate(value):
        here = f"{name}[{i}]"
        if not isinstance(msg, dict):
            raise BadValue(
                ErrorCode.INVALID_TYPE, here, f"must be an object with role and content, got {describe(msg)}"
            )
        extra = sorted(set(msg) - set(MESSAGE_KEYS))
        if extra:
            raise BadValue(
                ErrorCode.UNKNOWN_FIELD,
                f"{here}.{extra[0]}",
                f"unsupported message field; a message takes {', '.join(MESSAGE_KEYS)}",
            )
        role = msg.get("role")
        if role is None:
            raise BadValue(ErrorCode.MISSING_FIELD, f"{here}.role", f"is missing; use one of {', '.join(ROLES)}")
        if not isinstance(role, str) or role not in ROLES:
            hint = "; give a function's result as a tool message" if role == "function" else ""
            raise BadValue(
                ErrorCode.INVALID_ROLE, f"{here}.role", f"must be one of {', '.join(ROLES)}, got {describe(role)}{hint}"
            )
        calls = tool_message(msg, here)  # an assistant's tool_calls, a tool message's tool_call_id
        if msg.get("content") is None and "tool_calls" not in calls:
            raise BadValue(ErrorCode.MISSING_FIELD, f"{here}.content", "is missing or null; give the message text")
        content = parse_content(msg.get("content") or "", f"{here}.content", role, images)
        if not content and role not in ("assistant", "tool"):
            raise BadValue(
                ErrorCode.EMPTY_VALUE, f"{here}.content", "must not be empty; give the message text or drop the message"
            )
        out.append({"role": role, "content": content, **calls})
    return out


def _prompt(value: Any, where: str) -> str | list[int]:
    name = f"{where}prompt"
    if isinstance(value, str):
        if not value:
            raise BadValue(ErrorCode.EMPTY_VALUE, name, "must not be empty; give the prompt text")
        return check_text(value, name)
    if not isinstance(value, list):
        raise BadValue(ErrorCode.INVALID_TYPE, name, f"must be a string or a list of token ids, got {describe(value)}")
    if not value:
        raise BadValue(ErrorCode.EMPTY_VALUE, name, "must not be empty; give the prompt text")
    if set(map(type, value)) != {int}:  # at C speed: prompts of thousands of ids (bool, a subclass of int, is out)
        raise BadValue(
            ErrorCode.INVALID_TYPE,
            name,
            "must be a string or a list of integer token ids; for several prompts, put each on its own line",
        )
    if min(value) < 0:
        raise BadValue(ErrorCode.OUT_OF_RANGE, name, "token ids must be non-negative")
    return list(value)


# ---- lines --------------------------------------------------------------------------------------------


def _no_constants(name: str) -> Any:
    raise BadValue(
        ErrorCode.INVALID_JSON, None, f"invalid JSON: {name} is not allowed in JSON; use a finite number or null"
    )


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # rare: find the repeated key only then
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise BadValue(ErrorCode.DUPLICATE_KEY, k, "appears twice in the same object; keep one")
            seen.add(k)
    return out


# Built once; no Python hook per number (ints past Python's digit limit raise ValueError, caught below).
_DECODER = json.JSONDecoder(parse_constant=_no_constants, object_pairs_hook=_unique_keys)


def _decode(text: str) -> Any:
    try:
        value = _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        if "\x00" in text:
            hint = "the line holds NUL bytes: is the file UTF-16? Save it as UTF-8"
        elif exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string"):
            hint = "the line ends before the JSON does; each request must be one whole JSON object on one line"
        else:
            hint = "each line must be one JSON object"
        raise BadValue(
            ErrorCode.INVALID_JSON,
            None,
            f"invalid JSON at column {exc.colno}: {exc.msg.removesuffix(' starting at')}; {hint}",
        ) from None
    except ValueError as exc:  # an integer literal past Python's 4300-digit limit
        digits = re.search(r"has (\d+) digits", str(exc))
        what = f"a {digits.group(1)}-digit integer" if digits else "a number"
        raise BadValue(ErrorCode.OUT_OF_RANGE, None, f"{what} is far too large; use a 64-bit value") from None
    except RecursionError:
        raise BadValue(
            ErrorCode.INVALID_JSON, None, "invalid JSON: nested too deeply; a request needs only a few levels"
        ) from None
    return value


def parse_line(text: str, line: int, images: ImageAccess = NO_FILES) -> ParsedRequest:
    """Parse and validate one line. Raises InvalidLine with the line number, field, code and message.

    `images` says which image URLs are allowed (default: data: URIs only).
    """
    custom_id: str | None = None
    try:
        obj = _decode(text)
        if not isinstance(obj, dict):
            raise BadValue(
                ErrorCode.INVALID_TYPE, None, f"each line must be a JSON object {{...}}, got {describe(obj)}"
            )
        if isinstance(obj.get("custom_id"), str):
            custom_id = obj["custom_id"]
        if any(k in obj for k in ("body", "url", "method")):
            endpoint, body = _openai_line(obj, images)
            custom_id = obj["custom_id"]
        else:
            endpoint, body = _shorthand_line(obj, images)
            custom_id = obj.get("custom_id", str(line))
        return ParsedRequest(line=line, custom_id=custom_id, endpoint=endpoint, body=body)
    except BadValue as bad:
        raise InvalidLine(InputError(line, bad.message, bad.field, custom_id, bad.code)) from None


def _check_custom_id(obj: dict[str, Any], required: bool) -> None:
    if "custom_id" not in obj:
        if required:
            raise BadValue(
                ErrorCode.MISSING_FIELD, "custom_id", "is missing; every OpenAI batch line needs a unique custom_id"
            )
        return
    cid = obj["custom_id"]
    if not isinstance(cid, str):
        raise BadValue(
            ErrorCode.INVALID_TYPE, "custom_id", f'must be a string, got {describe(cid)}; quote it, e.g. "req-1"'
        )
    if not cid:
        raise BadValue(ErrorCode.EMPTY_VALUE, "custom_id", "must not be empty; give each line a unique id")
    if len(cid) > MAX_CUSTOM_ID_CHARS:
        raise BadValue(
            ErrorCode.TOO_LONG, "custom_id", f"is {len(cid)} characters; the limit is {MAX_CUSTOM_ID_CHARS}, shorten it"
        )
    check_text(cid, "custom_id")
    if any(ord(c) < 32 or ord(c) == 127 for c in cid):
        raise BadValue(
            ErrorCode.INVALID_VALUE, "custom_id", "must not hold control characters (newlines, tabs, NUL); remove them"
        )


def _openai_line(obj: dict[str, Any], images: ImageAccess) -> tuple[str, dict[str, Any]]:
    extra = sorted(set(obj) - set(BATCH_KEYS))
    if extra:
        raise BadValue(
            ErrorCode.UNKNOWN_FIELD,
            extra[0],
            f"unknown top-level field{did_you_mean(extra[0], BATCH_KEYS)}; a batch line has custom_id, method, url "
            "and body. Put request parameters inside body",
        )
    _check_custom_id(obj, required=True)
    method = obj.get("method")
    if method is None:
        raise BadValue(ErrorCode.MISSING_FIELD, "method", 'is missing; use "POST"')
    if method != "POST":
        raise BadValue(ErrorCode.UNSUPPORTED_METHOD, "method", f'must be "POST", got {shown(method)}')
    url = obj.get("url")
    if url is None:
        raise BadValue(ErrorCode.MISSING_FIELD, "url", f"is missing; use {_URLS}")
    if url not in ENDPOINTS:
        raise BadValue(ErrorCode.UNSUPPORTED_URL, "url", f"unsupported url {shown(url)}; use {_URLS}")
    body = obj.get("body")
    if body is None:
        raise BadValue(
            ErrorCode.MISSING_FIELD, "body", 'is missing; give the request as an object, e.g. {"messages": [...]}'
        )
    if not isinstance(body, dict):
        raise BadValue(ErrorCode.INVALID_TYPE, "body", f"must be an object, got {describe(body)}")
    if url == EMBEDDINGS_URL:
        for key in ("messages", "prompt"):
            if key in body:
                raise BadValue(ErrorCode.ENDPOINT_MISMATCH, f"body.{key}", f"{EMBEDDINGS_URL} takes input, not {key}")
        return url, validate_body(body, "body.")
    if url == CHAT_URL:
        if "prompt" in body:
            raise BadValue(
                ErrorCode.ENDPOINT_MISMATCH,
                "body.prompt",
                f"{CHAT_URL} takes messages; use {COMPLETIONS_URL} for a prompt",
            )
        if "messages" not in body:
            raise BadValue(ErrorCode.MISSING_FIELD, "body.messages", f"is missing; {CHAT_URL} needs a list of messages")
        return url, {"messages": _messages(body["messages"], "body.", images), **validate_params(body, "body.", url)}
    if "messages" in body:
        raise BadValue(
            ErrorCode.ENDPOINT_MISMATCH,
            "body.messages",
            f"{COMPLETIONS_URL} takes a prompt; use {CHAT_URL} for messages",
        )
    if "prompt" not in body:
        raise BadValue(ErrorCode.MISSING_FIELD, "body.prompt", f"is missing; {COMPLETIONS_URL} needs a prompt")
    return url, {"prompt": _prompt(body["prompt"], "body."), **validate_params(body, "body.", url)}


def _shorthand_line(obj: dict[str, Any], images: ImageAccess) -> tuple[str, dict[str, Any]]:
    _check_custom_id(obj, required=False)
    rest = {k: v for k, v in obj.items() if k != "custom_id"}
    has_messages, has_prompt = "messages" in rest, "prompt" in rest
    if "input" in rest:
        if has_messages or has_prompt:
            raise BadValue(ErrorCode.CONFLICTING_FIELDS, "input", "give input (embeddings) or prompt / messages")
        return EMBEDDINGS_URL, validate_body(rest, "")
    if has_messages and has_prompt:
        raise BadValue(ErrorCode.CONFLICTING_FIELDS, "prompt", "give either prompt or messages, not both")
    if has_messages:
        return CHAT_URL, {"messages": _messages(rest["messages"], "", images), **validate_params(rest, "", CHAT_URL)}
    if has_prompt:
        return COMPLETIONS_URL, {"prompt": _prompt(rest["prompt"], ""), **validate_params(rest, "", COMPLETIONS_URL)}
    raise BadValue(
        ErrorCode.MISSING_FIELD,
        None,
        'a line needs "prompt" or "messages" (shorthand; "input" for embeddings), or custom_id, method, url and body '
        "(OpenAI batch format)",
    )


def parse_stream(stream: IO[bytes], images: ImageAccess = NO_FILES) -> Iterator[ParsedRequest | InputError]:
    """Parse a whole JSONL stream: valid requests and errors, in file order, with duplicate custom_ids caught.

    A custom_id counts as taken even on a line that is otherwise invalid, so the output never holds it twice.
    """
    seen: dict[str, int] = {}
    kind: tuple[bool, int] | None = None  # (embeddings?, line) of the first valid request: a job is one kind
    for line_no, item in iter_lines(stream):
        if isinstance(item, InputError):
            yield item
            continue
        try:
            req = parse_line(item, line_no, images)
        except InvalidLine as bad:
            if bad.error.custom_id is not None:
                seen.setdefault(bad.error.custom_id, line_no)
            yield bad.error
            continue
        first = seen.get(req.custom_id)
        if first is not None:
            implicit = req.custom_id in (str(first), str(line_no))
            hint = " (a shorthand line without custom_id takes its line number)" if implicit else ""
            yield InputError(
                line_no,
                f"duplicate custom_id: line {first} already uses it{hint}; custom_ids must be unique, rename one",
                field="custom_id",
                custom_id=req.custom_id,
                code=ErrorCode.DUPLICATE_CUSTOM_ID,
            )
            continue
        seen[req.custom_id] = line_no
        kind = kind or (is_embeddings(req.endpoint), line_no)
        if kind[0] != is_embeddings(req.endpoint):
            yield _mixed_kinds(req, kind[1], line_no)
            continue
        yield req


def _mixed_kinds(req: ParsedRequest, first: int, line_no: int) -> InputError:
    """A job runs on one model: embeddings and generation lines go in separate jobs."""
    kinds = ("an embeddings", "a generation")
    this, other = kinds if is_embeddings(req.endpoint) else kinds[::-1]
    return InputError(
        line_no,
        f"this is {this} request but line {first} is {other} request; a job is either embeddings or generation "
        "(they need different models): submit them as two jobs",
        field="url",
        custom_id=req.custom_id,
        code=ErrorCode.ENDPOINT_MISMATCH,
    )

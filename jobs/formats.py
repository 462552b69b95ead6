"""Input lines: OpenAI batch lines and the shorthand, parsed and validated as a stream.

Pure logic: no Redis, SQL or MLX. Every error names the line, the field and what to do.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
ENDPOINTS = (CHAT_URL, COMPLETIONS_URL)

MAX_LINE_BYTES = 1024 * 1024
MAX_CUSTOM_ID_CHARS = 512
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_TOKENS_LIMIT = 131072
MAX_N = 64
DEFAULT_MAX_TOKENS = 256

ROLES = ("system", "developer", "user", "assistant")
# Accepted for compatibility with OpenAI files; the job's --model decides which model runs.
PASSTHROUGH_KEYS = ("model",)


@dataclass(frozen=True)
class InputError:
    """One bad line: where, which field, what is wrong and what to do."""

    line: int
    message: str
    field: str | None = None
    custom_id: str | None = None
    code: str = "invalid_request"

    def __str__(self) -> str:
        where = f"line {self.line}"
        if self.custom_id is not None:
            where += f" (custom_id {self.custom_id!r})"
        if self.field:
            where += f", field {self.field!r}"
        return f"{where}: {self.message}"

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


@dataclass(frozen=True)
class ParsedRequest:
    """A valid request: `body` is normalized (messages as role/content strings, or a prompt) plus params."""

    line: int
    custom_id: str
    endpoint: str
    body: dict[str, Any] = field(hash=False)


@dataclass(frozen=True)
class SamplingParams:
    """Generation parameters of one request, with defaults filled in."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int = 1

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> SamplingParams:
        """Build from a normalized body (as `parse_line` stores it)."""
        stop = body.get("stop")
        return cls(
            max_tokens=int(body.get("max_tokens") or DEFAULT_MAX_TOKENS),
            temperature=float(body["temperature"]) if body.get("temperature") is not None else 1.0,
            top_p=float(body["top_p"]) if body.get("top_p") is not None else 1.0,
            top_k=int(body.get("top_k") or 0),
            min_p=float(body.get("min_p") or 0.0),
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            seed=body.get("seed"),
            repetition_penalty=body.get("repetition_penalty"),
            presence_penalty=body.get("presence_penalty"),
            frequency_penalty=body.get("frequency_penalty"),
            n=int(body.get("n") or 1),
        )


# ---- parameters -----------------------------------------------------------------------------------


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _Bad(name, f"must be an integer, got {_describe(value)}")
    if not lo <= value <= hi:
        raise _Bad(name, f"must be between {lo} and {hi}, got {value}")
    return value


def _check_float(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if not _number(value):
        raise _Bad(name, f"must be a number, got {_describe(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise _Bad(name, "must be a finite number")
    if value < lo or value > hi or (lo_open and value == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise _Bad(name, f"must be in {interval}, got {value:g}")
    return value


def _check_stop(value: Any) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise _Bad("stop", f"must be a string or a list of strings, got {_describe(value)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise _Bad("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    for s in stops:
        if not isinstance(s, str):
            raise _Bad("stop", f"each stop sequence must be a string, got {_describe(s)}")
        if not s:
            raise _Bad("stop", "stop strings must not be empty")
        if len(s) > MAX_STOP_CHARS:
            raise _Bad("stop", f"stop strings are limited to {MAX_STOP_CHARS} characters")
    return stops


_PARAM_CHECKS: dict[str, Any] = {
    "max_tokens": lambda v: _check_int("max_tokens", v, 1, MAX_TOKENS_LIMIT),
    "max_completion_tokens": lambda v: _check_int("max_completion_tokens", v, 1, MAX_TOKENS_LIMIT),
    "temperature": lambda v: _check_float("temperature", v, 0.0, 2.0),
    "top_p": lambda v: _check_float("top_p", v, 0.0, 1.0, lo_open=True),
    "top_k": lambda v: _check_int("top_k", v, 0, 1_000_000),
    "min_p": lambda v: _check_float("min_p", v, 0.0, 1.0),
    "stop": _check_stop,
    "seed": lambda v: _check_int("seed", v, -(2**63), 2**63 - 1),
    "repetition_penalty": lambda v: _check_float("repetition_penalty", v, 0.0, 10.0, lo_open=True),
    "presence_penalty": lambda v: _check_float("presence_penalty", v, -2.0, 2.0),
    "frequency_penalty": lambda v: _check_float("frequency_penalty", v, -2.0, 2.0),
    "n": lambda v: _check_int("n", v, 1, MAX_N),
}
SUPPORTED_PARAMS = tuple(_PARAM_CHECKS)


def _params(source: dict[str, Any], where: str) -> dict[str, Any]:
    """Validate the generation parameters among `source`'s keys; returns the normalized ones."""
    out: dict[str, Any] = {}
    for key, value in source.items():
        if key in ("messages", "prompt") or key in PASSTHROUGH_KEYS:
            continue
        if key == "stream":
            if value not in (False, None):
                raise _Bad(f"{where}stream", "streaming is not available in a batch; remove it or set false")
            continue
        check = _PARAM_CHECKS.get(key)
        if check is None:
            raise _Bad(
                f"{where}{key}",
                f"unsupported parameter {key!r}; supported: {', '.join(SUPPORTED_PARAMS)}",
            )
        if value is None:
            continue
        out[key] = check(value)
    if "max_completion_tokens" in out:
        mct = out.pop("max_completion_tokens")
        if "max_tokens" in out and out["max_tokens"] != mct:
            raise _Bad(f"{where}max_tokens", "max_tokens and max_completion_tokens disagree; give one")
        out["max_tokens"] = mct
    if "stop" in out:
        out["stop"] = list(out["stop"])
    return out


# ---- messages and prompts ---------------------------------------------------------------------------


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    name = f"{where}messages"
    if not isinstance(value, list):
        raise _Bad(name, f"must be a list of messages, got {_describe(value)}")
    if not value:
        raise _Bad(name, "must not be empty: give at least one message")
    out = []
    for i, msg in enumerate(value):
        here = f"{name}[{i}]"
        if not isinstance(msg, dict):
            raise _Bad(here, f"must be an object with role and content, got {_describe(msg)}")
        extra = set(msg) - {"role", "content"}
        if extra:
            raise _Bad(f"{here}.{sorted(extra)[0]}", "unsupported message field; messages take role and content")
        role = msg.get("role")
        if role is None:
            raise _Bad(f"{here}.role", "is missing")
        if role not in ROLES:
            raise _Bad(f"{here}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        if "content" not in msg or msg["content"] is None:
            raise _Bad(f"{here}.content", "is missing")
        content = _content(msg["content"], f"{here}.content")
        if not content and role != "assistant":
            raise _Bad(f"{here}.content", "must not be empty")
        out.append({"role": role, "content": content})
    return out


def _content(value: Any, name: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _Bad(name, f"must be a string or a list of content parts, got {_describe(value)}")
    texts = []
    for j, part in enumerate(value):
        here = f"{name}[{j}]"
        if not isinstance(part, dict):
            raise _Bad(here, f"must be a content part object, got {_describe(part)}")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise _Bad(f"{here}.text", f"must be a string, got {_describe(text)}")
            texts.append(text)
        elif kind in ("image_url", "input_image", "image"):
            raise _Bad(here, "image content parts are not supported yet; send text parts only")
        else:
            raise _Bad(f"{here}.type", f"unsupported content part type {kind!r}; use 'text'")
    return "".join(texts)


def _prompt(value: Any, where: str) -> str | list[int]:
    name = f"{where}prompt"
    if isinstance(value, str):
        if not value:
            raise _Bad(name, "must not be empty")
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if any(t < 0 for t in value):
            raise _Bad(name, "token ids must be non-negative")
        return list(value)
    if isinstance(value, list) and not value:
        raise _Bad(name, "must not be empty")
    if isinstance(value, list):
        raise _Bad(name, "must be a string or a list of token ids; put one prompt on each line")
    raise _Bad(name, f"must be a string, got {_describe(value)}")


# ---- lines --------------------------------------------------------------------------------------------


class _Bad(Exception):
    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def _no_constants(name: str) -> Any:
    raise _Bad(None, f"invalid JSON: {name} is not a number JSON allows")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Bad(k, "appears twice in the same object")
        out[k] = v
    return out


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def parse_line(text: str, line: int) -> ParsedRequest:
    """Parse and validate one line. Raises InvalidLine with the line number, field and message."""
    custom_id: str | None = None
    try:
        try:
            obj = json.loads(text, parse_constant=_no_constants, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as exc:
            raise _Bad(None, f"invalid JSON: {exc.msg} at column {exc.colno}") from None
        except RecursionError:
            raise _Bad(None, "invalid JSON: nested too deeply") from None
        if not isinstance(obj, dict):
            raise _Bad(None, f"each line must be a JSON object, got {_describe(obj)}")
        if "custom_id" in obj and isinstance(obj["custom_id"], str):
            custom_id = obj["custom_id"]
        if any(k in obj for k in ("body", "url", "method")):
            endpoint, body = _openai_line(obj)
            custom_id = obj["custom_id"]
        else:
            endpoint, body = _shorthand_line(obj)
            custom_id = obj.get("custom_id", str(line))
        return ParsedRequest(line=line, custom_id=custom_id, endpoint=endpoint, body=body)
    except _Bad as bad:
        raise InvalidLine(InputError(line, bad.message, bad.field, custom_id)) from None


def _check_custom_id(obj: dict[str, Any], required: bool) -> None:
    if "custom_id" not in obj:
        if required:
            raise _Bad("custom_id", "is missing; every OpenAI batch line needs a unique custom_id")
        return
    cid = obj["custom_id"]
    if not isinstance(cid, str):
        raise _Bad("custom_id", f"must be a string, got {_describe(cid)}")
    if not cid:
        raise _Bad("custom_id", "must not be empty")
    if len(cid) > MAX_CUSTOM_ID_CHARS:
        raise _Bad("custom_id", f"is {len(cid)} characters; the limit is {MAX_CUSTOM_ID_CHARS}")


def _openai_line(obj: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    extra = set(obj) - {"custom_id", "method", "url", "body"}
    if extra:
        raise _Bad(sorted(extra)[0], "unknown top-level field; a batch line has custom_id, method, url, body")
    _check_custom_id(obj, required=True)
    method = obj.get("method")
    if method is None:
        raise _Bad("method", 'is missing; use "POST"')
    if method != "POST":
        raise _Bad("method", f'must be "POST", got {method!r}')
    url = obj.get("url")
    if url is None:
        raise _Bad("url", f"is missing; use {CHAT_URL} or {COMPLETIONS_URL}")
    if url not in ENDPOINTS:
        raise _Bad("url", f"unsupported url {url!r}; use {CHAT_URL} or {COMPLETIONS_URL}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _Bad("body", f"must be an object, got {_describe(body)}")
    if url == CHAT_URL:
        if "prompt" in body:
            raise _Bad("body.prompt", f"{CHAT_URL} takes messages; use {COMPLETIONS_URL} for a prompt")
        if "messages" not in body:
            raise _Bad("body.messages", "is missing")
        return url, {"messages": _messages(body["messages"], "body."), **_params(body, "body.")}
    if "messages" in body:
        raise _Bad("body.messages", f"{COMPLETIONS_URL} takes a prompt; use {CHAT_URL} for messages")
    if "prompt" not in body:
        raise _Bad("body.prompt", "is missing")
    return url, {"prompt": _prompt(body["prompt"], "body."), **_params(body, "body.")}


def _shorthand_line(obj: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    _check_custom_id(obj, required=False)
    rest = {k: v for k, v in obj.items() if k != "custom_id"}
    has_messages, has_prompt = "messages" in rest, "prompt" in rest
    if has_messages and has_prompt:
        raise _Bad("prompt", "give either prompt or messages, not both")
    if has_messages:
        return CHAT_URL, {"messages": _messages(rest["messages"], ""), **_params(rest, "")}
    if has_prompt:
        return COMPLETIONS_URL, {"prompt": _prompt(rest["prompt"], ""), **_params(rest, "")}
    raise _Bad(
        None,
        'a line needs "prompt" or "messages" (shorthand) or custom_id/method/url/body (OpenAI batch format)',
    )


# ---- files ----------------------------------------------------------------------------------------------


@dataclass
class ReadStats:
    lines: int = 0
    valid: int = 0
    invalid: int = 0


def iter_lines(stream: IO[bytes], max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, str | InputError]]:
    """Yield (line number, text or InputError) for each non-blank line, reading the file as a stream.

    Handles a UTF-8 BOM and CRLF endings. An over-long line is skipped in chunks, never held whole.
    """
    line_no = 0
    while True:
        raw = stream.readline(max_line_bytes + 1)
        if not raw:
            return
        line_no += 1
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            size = len(raw)
            while True:
                more = stream.readline(1024 * 1024)
                size += len(more)
                if not more or more.endswith(b"\n"):
                    break
            yield (
                line_no,
                InputError(
                    line_no,
                    f"line is {size / 1e6:.1f} MB; the limit is {max_line_bytes / 1e6:.1f} MB per line",
                    code="line_too_long",
                ),
            )
            continue
        if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield (
                line_no,
                InputError(
                    line_no,
                    f"not valid UTF-8 (byte {exc.start}); save the file as UTF-8",
                    code="invalid_encoding",
                ),
            )
            continue
        text = text.rstrip("\r\n")
        if not text.strip():
            continue
        yield line_no, text


def parse_stream(stream: IO[bytes]) -> Iterator[ParsedRequest | InputError]:
    """Parse a whole JSONL stream: valid requests and errors, in file order, with duplicate custom_ids caught."""
    seen: dict[str, int] = {}
    for line_no, item in iter_lines(stream):
        if isinstance(item, InputError):
            yield item
            continue
        try:
            req = parse_line(item, line_no)
        except InvalidLine as bad:
            yield bad.error
            continue
        first = seen.get(req.custom_id)
        if first is not None:
            yield InputError(
                line_no,
                f"duplicate custom_id; line {first} already uses it. custom_ids must be unique in a file",
                field="custom_id",
                custom_id=req.custom_id,
                code="duplicate_custom_id",
            )
            continue
        seen[req.custom_id] = line_no
        yield req

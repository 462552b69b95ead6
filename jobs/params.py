"""Generation parameters: validation of a request body's parameters, SamplingParams and OutputParams. Pure logic."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from omlx_jobs import defaults
from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs import compat, reasoning, tools
from omlx_jobs.jobs.errors import BadValue, check_text, describe, did_you_mean, shown
from omlx_jobs.jobs.response_format import ResponseFormat, validate_response_format

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_TOKENS_LIMIT = 131072
MAX_N = 64
MIN_TEMPERATURE = 1e-5
"""Temperatures below this are greedy: dividing logits by less overflows float32 and samples at random."""
DEFAULT_MAX_TOKENS = defaults.MAX_TOKENS
MAX_TOP_LOGPROBS = 20  # chat
MAX_COMPLETION_LOGPROBS = 5  # completions
MAX_LOGIT_BIAS = 1024
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
DEFAULT = object()  # a check's answer for a value that changes nothing: not stored
# Accepted for compatibility with OpenAI files; the job's --model decides which model runs.
PASSTHROUGH_KEYS = ("model",)


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
            max_tokens=int(body["max_tokens"]) if body.get("max_tokens") is not None else DEFAULT_MAX_TOKENS,
            temperature=greedy_below(float(body["temperature"])) if body.get("temperature") is not None else 1.0,
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


@dataclass(frozen=True)
class OutputParams:
    """What a request asks for beyond sampling: a constrained format, logit biases, logprobs, echo."""

    response_format: ResponseFormat | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token: chat's top_logprobs, completions' logprobs
    echo: bool = False

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> OutputParams:
        """Build from a normalized body (as `parse_line` stores it)."""
        lp = body.get("logprobs")
        is_count = lp is not None and not isinstance(lp, bool)  # completions: the number of alternatives
        return cls(
            response_format=ResponseFormat.from_body(body),
            logit_bias=tuple(sorted((int(k), float(v)) for k, v in (body.get("logit_bias") or {}).items())),
            logprobs=lp is not None and lp is not False,
            top_logprobs=int(lp) if is_count else int(body.get("top_logprobs") or 0),
            echo=bool(body.get("echo")),
        )


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadValue(ErrorCode.INVALID_TYPE, name, f"must be an integer, got {describe(value)}")
    if not lo <= value <= hi:
        raise BadValue(ErrorCode.OUT_OF_RANGE, name, f"must be between {lo} and {hi}, got {value}")
    return value


MAX_SEED = 2**63 - 1


def _check_seed(name: str, value: Any) -> int:
    # MLX's random key takes an unsigned 64-bit integer (mx.random.key(-1) raises); choice i of a request
    # uses seed + i, so seeds up to 2**63 - 1 leave room for n and fit a signed 64-bit column too.
    if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= MAX_SEED:
        raise BadValue(
            ErrorCode.OUT_OF_RANGE,
            name,
            f"must be between 0 and {MAX_SEED} (MLX seeds are unsigned 64-bit integers), got {value}; "
            "use a non-negative seed, or leave it out for a random one",
        )
    return _check_int(name, value, 0, MAX_SEED)


def _check_float(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadValue(ErrorCode.INVALID_TYPE, name, f"must be a number, got {describe(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise BadValue(ErrorCode.OUT_OF_RANGE, name, f"must be a finite number, got {value}")
    if value < lo or value > hi or (lo_open and value == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise BadValue(ErrorCode.OUT_OF_RANGE, name, f"must be in {interval}, got {value:g}")
    return value


def _check_stop(name: str, value: Any) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise BadValue(ErrorCode.INVALID_TYPE, name, f"must be a string or a list of strings, got {describe(value)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise BadValue(
            ErrorCode.OUT_OF_RANGE, name, f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}"
        )
    for i, s in enumerate(stops):
        here = f"{name}[{i}]" if isinstance(value, list) else name
        if not isinstance(s, str):
            raise BadValue(ErrorCode.INVALID_TYPE, here, f"each stop sequence must be a string, got {describe(s)}")
        if not s:
            raise BadValue(ErrorCode.EMPTY_VALUE, here, "stop strings must not be empty; remove it")
        if len(s) > MAX_STOP_CHARS:
            raise BadValue(
                ErrorCode.TOO_LONG, here, f"is {len(s)} characters; stop strings are limited to {MAX_STOP_CHARS}"
            )
        check_text(s, here)
    return list(stops)


def _check_max_tokens(name: str, value: Any) -> int:
    # 0 passes here and is refused by _cross_checks unless echo asks to score the prompt.
    return 0 if value == 0 and type(value) is int else _check_int(name, value, 1, MAX_TOKENS_LIMIT)


def greedy_below(temperature: float) -> float:
    """A temperature under MIN_TEMPERATURE as 0 (greedy): logits divided by 1e-38 overflow and sample at random."""
    return 0.0 if temperature < MIN_TEMPERATURE else temperature


_PARAM_CHECKS: dict[str, Any] = {
    "max_tokens": _check_max_tokens,
    "max_completion_tokens": _check_max_tokens,
    "temperature": lambda n, v: greedy_below(_check_float(n, v, 0.0, 2.0)),
    "top_p": lambda n, v: _check_float(n, v, 0.0, 1.0, lo_open=True),
    "top_k": lambda n, v: _check_int(n, v, 0, 1_000_000),
    "min_p": lambda n, v: _check_float(n, v, 0.0, 1.0),
    "stop": _check_stop,
    "seed": lambda n, v: _check_seed(n, v),
    "repetition_penalty": lambda n, v: _check_float(n, v, 0.0, 10.0, lo_open=True),
    "presence_penalty": lambda n, v: _check_float(n, v, -2.0, 2.0),
    "frequency_penalty": lambda n, v: _check_float(n, v, -2.0, 2.0),
    "n": lambda n, v: _check_int(n, v, 1, MAX_N),
}
SUPPORTED_PARAMS = tuple(_PARAM_CHECKS)

# Parameters of one endpoint only; each check returns the normalized value, or DEFAULT for a no-op value.
CHAT_CHECKS: dict[str, Any] = {
    "response_format": validate_response_format,
    "logprobs": lambda n, v: _check_bool(n, v, hint="; give the number of alternatives as top_logprobs"),
    "top_logprobs": lambda n, v: _check_int(n, v, 0, MAX_TOP_LOGPROBS),
    "logit_bias": lambda n, v: _check_logit_bias(n, v),
    # Reasoning and tool calls (issue 24): jobs/reasoning.py and jobs/tools.py.
    "tools": tools.validate_tools,
    "tool_choice": tools.validate_tool_choice,
    "parallel_tool_calls": tools.validate_parallel,
    "reasoning_effort": reasoning.validate_effort,
    "chat_template_kwargs": reasoning.validate_template_kwargs,
    "thinking_token_budget": reasoning.validate_budget,
}
COMPLETION_CHECKS: dict[str, Any] = {
    "logprobs": lambda n, v: _check_completion_logprobs(n, v),
    "echo": lambda n, v: _check_bool(n, v),
    "logit_bias": lambda n, v: _check_logit_bias(n, v),
}
_ENDPOINT_CHECKS = {CHAT_URL: (CHAT_CHECKS, compat.CHAT), COMPLETIONS_URL: (COMPLETION_CHECKS, compat.COMPLETIONS)}
_ELSEWHERE = {
    "response_format": f"response_format is a {CHAT_URL} parameter",
    "top_logprobs": f"top_logprobs is a {CHAT_URL} parameter; on {COMPLETIONS_URL} give the number as logprobs",
    "echo": f"echo is a {COMPLETIONS_URL} parameter (a chat reply cannot echo its prompt)",
    "suffix": f"suffix is a {COMPLETIONS_URL} parameter",
    "best_of": f"best_of is a {COMPLETIONS_URL} parameter",
    "max_reasoning_tokens": "the thinking budget is called thinking_token_budget here (vLLM's name): rename it",
}


def _check_bool(name: str, value: Any, hint: str = "") -> bool | object:
    if not isinstance(value, bool):
        raise BadValue(ErrorCode.INVALID_TYPE, name, f"must be true or false, got {describe(value)}{hint}")
    return value or DEFAULT


def _check_completion_logprobs(name: str, value: Any) -> int | object:
    if value is False:  # written by tools that share one default between endpoints: off
        return DEFAULT
    if isinstance(value, bool):
        raise BadValue(
            ErrorCode.INVALID_TYPE, name, f"on {COMPLETIONS_URL} logprobs is the number of alternatives, 0-5; got true"
        )
    return _check_int(name, value, 0, MAX_COMPLETION_LOGPROBS)


def _check_logit_bias(name: str, value: Any) -> dict[str, float] | object:
    if not isinstance(value, dict):
        raise BadValue(
            ErrorCode.INVALID_TYPE,
            name,
            f'must be an object of token id -> bias, e.g. {{"50256": -100}}, got {describe(value)}',
        )
    if len(value) > MAX_LOGIT_BIAS:
        raise BadValue(
            ErrorCode.OUT_OF_RANGE, name, f"holds {len(value)} token ids; at most {MAX_LOGIT_BIAS} are allowed"
        )
    out: dict[str, float] = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12:
            raise BadValue(
                ErrorCode.INVALID_VALUE,
                f"{name}.{key}",
                f'keys are token ids written as strings of digits, like "50256"; got {shown(key)}',
            )
        token = str(int(key))
        if token in out:  # "7" and "007": one would silently replace the other
            raise BadValue(ErrorCode.INVALID_VALUE, f"{name}.{key}", f"names token id {token} twice; give each id once")
        out[token] = _check_float(f"{name}.{key}", bias, -100.0, 100.0)
    return out or DEFAULT


def validate_params(source: dict[str, Any], where: str, endpoint: str) -> dict[str, Any]:
    """Validate the generation parameters among `source`'s keys; returns the normalized ones.

    Fields that change nothing (OpenAI clients' defaults, see compat.py) are checked and dropped, and so are
    parameters at their default value, so a body stores only what affects the result.
    """
    checks, no_ops = _ENDPOINT_CHECKS[endpoint]
    out: dict[str, Any] = {}
    for key, value in source.items():
        name = f"{where}{key}"
        if key in ("messages", "prompt"):
            continue
        if key in PASSTHROUGH_KEYS:
            if value is not None and not isinstance(value, str):
                raise BadValue(ErrorCode.INVALID_TYPE, name, f"must be a string, got {describe(value)}")
            continue
        if key == "stream":
            if value not in (False, None):
                raise BadValue(
                    ErrorCode.UNSUPPORTED_PARAMETER,
                    name,
                    "streaming is not available in a batch; remove it or set false",
                )
            continue
        if key in no_ops:
            if value is not None:
                no_ops[key](name, value)
            continue
        check = _PARAM_CHECKS.get(key) or checks.get(key)
        if check is None:
            raise BadValue(ErrorCode.UNSUPPORTED_PARAMETER, name, _unsupported_message(key, endpoint, checks))
        if value is not None:  # null means "the default", as in the OpenAI API
            normalized = check(name, value)
            if normalized is not DEFAULT and normalized is not None:
                out[key] = normalized
    return _cross_checks(out, where)


def _unsupported_message(key: str, endpoint: str, checks: dict[str, Any]) -> str:
    if key in _ELSEWHERE:
        return f"{_ELSEWHERE[key]}; remove it from this {endpoint} request"
    known = (*SUPPORTED_PARAMS, *checks)
    return f"unsupported parameter {key!r}{did_you_mean(key, known)}; remove it. Supported: {', '.join(known)}"


def _cross_checks(out: dict[str, Any], where: str) -> dict[str, Any]:
    tokens_field = "max_tokens" if "max_tokens" in out else "max_completion_tokens"
    if "max_completion_tokens" in out:
        mct = out.pop("max_completion_tokens")
        if "max_tokens" in out and out["max_tokens"] != mct:
            raise BadValue(
                ErrorCode.CONFLICTING_FIELDS,
                f"{where}max_tokens",
                f"max_tokens ({out['max_tokens']}) and max_completion_tokens ({mct}) disagree; give only one",
            )
        out["max_tokens"] = mct
    if out.get("max_tokens") == 0 and not out.get("echo"):
        raise BadValue(
            ErrorCode.OUT_OF_RANGE,
            f"{where}{tokens_field}",
            f"must be between 1 and {MAX_TOKENS_LIMIT}, got 0; 0 is allowed only with echo: true on "
            f"{COMPLETIONS_URL}, to score a prompt without generating",
        )
    if out.get("top_logprobs") and not out.get("logprobs"):
        raise BadValue(
            ErrorCode.CONFLICTING_FIELDS, f"{where}top_logprobs", "needs logprobs: true; set it, or drop top_logprobs"
        )
    if out.get("response_format") and out.get("stop"):
        raise BadValue(
            ErrorCode.CONFLICTING_FIELDS,
            f"{where}stop",
            "a stop string would cut the JSON of response_format short; remove stop (the grammar ends the output)",
        )
    if "top_logprobs" in out and not out["top_logprobs"]:
        del out["top_logprobs"]  # 0 is the default
    tools.cross_check(out, where)
    return out

"""Generation parameters: validation of a request body's parameters, and SamplingParams. Pure logic."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from omlx_jobs.jobs.errors import BadValue, check_text, describe, did_you_mean

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_TOKENS_LIMIT = 131072
MAX_N = 64
DEFAULT_MAX_TOKENS = 256
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


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadValue("invalid_type", name, f"must be an integer, got {describe(value)}")
    if not lo <= value <= hi:
        raise BadValue("out_of_range", name, f"must be between {lo} and {hi}, got {value}")
    return value


MAX_SEED = 2**63 - 1


def _check_seed(name: str, value: Any) -> int:
    # MLX's random key takes an unsigned 64-bit integer (mx.random.key(-1) raises); choice i of a request
    # uses seed + i, so seeds up to 2**63 - 1 leave room for n and fit a signed 64-bit column too.
    if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= MAX_SEED:
        raise BadValue(
            "out_of_range",
            name,
            f"must be between 0 and {MAX_SEED} (MLX seeds are unsigned 64-bit integers), got {value}; "
            "use a non-negative seed, or leave it out for a random one",
        )
    return _check_int(name, value, 0, MAX_SEED)


def _check_float(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadValue("invalid_type", name, f"must be a number, got {describe(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise BadValue("out_of_range", name, f"must be a finite number, got {value}")
    if value < lo or value > hi or (lo_open and value == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise BadValue("out_of_range", name, f"must be in {interval}, got {value:g}")
    return value


def _check_stop(name: str, value: Any) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise BadValue("invalid_type", name, f"must be a string or a list of strings, got {describe(value)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise BadValue("out_of_range", name, f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    for i, s in enumerate(stops):
        here = f"{name}[{i}]" if isinstance(value, list) else name
        if not isinstance(s, str):
            raise BadValue("invalid_type", here, f"each stop sequence must be a string, got {describe(s)}")
        if not s:
            raise BadValue("empty_value", here, "stop strings must not be empty; remove it")
        if len(s) > MAX_STOP_CHARS:
            raise BadValue("too_long", here, f"is {len(s)} characters; stop strings are limited to {MAX_STOP_CHARS}")
        check_text(s, here)
    return list(stops)


_PARAM_CHECKS: dict[str, Any] = {
    "max_tokens": lambda n, v: _check_int(n, v, 1, MAX_TOKENS_LIMIT),
    "max_completion_tokens": lambda n, v: _check_int(n, v, 1, MAX_TOKENS_LIMIT),
    "temperature": lambda n, v: _check_float(n, v, 0.0, 2.0),
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


def validate_params(source: dict[str, Any], where: str) -> dict[str, Any]:
    """Validate the generation parameters among `source`'s keys; returns the normalized ones."""
    out: dict[str, Any] = {}
    for key, value in source.items():
        name = f"{where}{key}"
        if key in ("messages", "prompt"):
            continue
        if key in PASSTHROUGH_KEYS:
            if value is not None and not isinstance(value, str):
                raise BadValue("invalid_type", name, f"must be a string, got {describe(value)}")
            continue
        if key == "stream":
            if value not in (False, None):
                raise BadValue(
                    "unsupported_parameter", name, "streaming is not available in a batch; remove it or set false"
                )
            continue
        check = _PARAM_CHECKS.get(key)
        if check is None:
            raise BadValue(
                "unsupported_parameter",
                name,
                f"unsupported parameter {key!r}{did_you_mean(key, SUPPORTED_PARAMS)}; remove it. "
                f"Supported: {', '.join(SUPPORTED_PARAMS)}",
            )
        if value is not None:  # null means "the default", as in the OpenAI API
            out[key] = check(name, value)
    if "max_completion_tokens" in out:
        mct = out.pop("max_completion_tokens")
        if "max_tokens" in out and out["max_tokens"] != mct:
            raise BadValue(
                "conflicting_fields",
                f"{where}max_tokens",
                f"max_tokens ({out['max_tokens']}) and max_completion_tokens ({mct}) disagree; give only one",
            )
        out["max_tokens"] = mct
    return out

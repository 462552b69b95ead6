"""Embedding requests, the client side: `/v1/embeddings` bodies validated and normalized (their output bodies are
jobs/output.py's, from the stored vectors of store/vectors.py). Pure: no Redis, SQL or MLX.

A normalized body is {"input": [item, ...]} (each item a string or a list of token ids, whatever form the line
used), plus "encoding_format": "base64" and "dimensions": N when given. Item limits that need the model (its
context, its vocabulary, whether it declares Matryoshka dimensions) are checked by the worker, per item.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.errors import BadValue, InputError, check_text, describe
from omlx_jobs.jobs.model_names import resolved

EMBEDDINGS_URL = "/v1/embeddings"
MAX_INPUTS = 2048
"""OpenAI's limit on the items of one request."""
MAX_DIMENSIONS = 65536
ENCODING_FORMATS = ("float", "base64")
BODY_KEYS = ("input", "model", "encoding_format", "dimensions", "user")


def is_embeddings(endpoint: str) -> bool:
    return endpoint == EMBEDDINGS_URL


def validate_body(body: dict[str, Any], where: str) -> dict[str, Any]:
    """The normalized body of an embeddings request (`where` is "body." or "" for a shorthand line)."""
    extra = sorted(set(body) - set(BODY_KEYS) - {"custom_id"})
    if extra:
        raise BadValue(
            ErrorCode.UNSUPPORTED_PARAMETER,
            f"{where}{extra[0]}",
            f"is not a parameter of {EMBEDDINGS_URL}; it takes {', '.join(BODY_KEYS)}",
        )
    if "input" not in body:
        raise BadValue(ErrorCode.MISSING_FIELD, f"{where}input", f"is missing; {EMBEDDINGS_URL} needs an input")
    out: dict[str, Any] = {"input": _items(body["input"], f"{where}input")}
    for key in ("model", "user"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise BadValue(ErrorCode.INVALID_TYPE, f"{where}{key}", f"must be a string, got {describe(body[key])}")
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ENCODING_FORMATS:
        raise BadValue(
            ErrorCode.INVALID_VALUE, f"{where}encoding_format", f"must be float or base64, got {describe(fmt)}"
        )
    if fmt == "base64":
        out["encoding_format"] = "base64"
    dims = body.get("dimensions")
    if dims is not None:
        if not isinstance(dims, int) or isinstance(dims, bool):
            raise BadValue(ErrorCode.INVALID_TYPE, f"{where}dimensions", f"must be an integer, got {describe(dims)}")
        if not 1 <= dims <= MAX_DIMENSIONS:
            raise BadValue(ErrorCode.OUT_OF_RANGE, f"{where}dimensions", f"must be at least 1, got {dims}")
        out["dimensions"] = dims
    return out


def _items(value: Any, name: str) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids -> a list of items."""
    if isinstance(value, str):
        return [_text(value, name)]
    if not isinstance(value, list):
        raise BadValue(
            ErrorCode.INVALID_TYPE,
            name,
            f"must be a string, a list of strings, a list of token ids or a list of lists, got {describe(value)}",
        )
    if not value:
        raise BadValue(ErrorCode.EMPTY_VALUE, name, "must not be empty; give at least one text to embed")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [_ids(value, name)]  # one tokenized input
    if len(value) > MAX_INPUTS:
        raise BadValue(
            ErrorCode.TOO_LONG, name, f"holds {len(value)} items; the limit is {MAX_INPUTS}, split it over lines"
        )
    items: list[str | list[int]] = []
    for i, item in enumerate(value):
        here = f"{name}[{i}]"
        if isinstance(item, str):
            items.append(_text(item, here))
        elif isinstance(item, list):
            if not item:
                raise BadValue(ErrorCode.EMPTY_VALUE, here, "must not be empty; give at least one token id")
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in item):
                raise BadValue(ErrorCode.INVALID_TYPE, here, "must be a list of integer token ids")
            items.append(_ids(item, here))
        else:
            raise BadValue(
                ErrorCode.INVALID_TYPE,
                here,
                f"must be a string or a list of token ids, got {describe(item)}; every item the same kind",
            )
    if len({isinstance(i, str) for i in items}) > 1:
        raise BadValue(ErrorCode.INVALID_TYPE, name, "mixes strings and token lists; give all of one kind")
    return items


def _text(value: str, name: str) -> str:
    if not value:
        raise BadValue(ErrorCode.EMPTY_VALUE, name, "must not be empty; give the text to embed, or drop the item")
    return check_text(value, name)


def _ids(value: list[int], name: str) -> list[int]:
    if min(value) < 0:
        raise BadValue(ErrorCode.OUT_OF_RANGE, name, "token ids must be non-negative")
    return list(value)


def canonical_text(body: dict[str, Any]) -> str:
    """The embedding request as sort-key text (jobs/sharding.py): "e", then its items."""
    return "e\x1d" + "\x1e".join(i if isinstance(i, str) else ",".join(map(str, i)) for i in body.get("input") or [])


_MATRYOSHKA = re.compile(r"matryoshka|\bMRL\b", re.IGNORECASE)


def declares_matryoshka(path: Path) -> bool:
    """Whether a model directory declares Matryoshka dimensions: `"matryoshka_dims"` in
    config_sentence_transformers.json, or Matryoshka (a MatryoshkaLoss tag, "MRL") named in its README.md."""
    try:
        st = json.loads((path / "config_sentence_transformers.json").read_text())
    except (OSError, ValueError):
        st = None
    if isinstance(st, dict) and st.get("matryoshka_dims"):
        return True
    try:
        return bool(_MATRYOSHKA.search((path / "README.md").read_text(errors="replace")[:200_000]))
    except OSError:
        return False


def dimensions_refusal(model: str) -> str | None:
    """Why `dimensions` cannot run on `model`, when submit can tell: it is a local sentence-transformers model
    directory (modules.json) that declares no Matryoshka dimensions. None when it may, or nobody knows here."""
    path = Path(os.path.expanduser(resolved(model)))
    if not (path / "modules.json").is_file() or declares_matryoshka(path):
        return None
    return (
        f"{model} declares no Matryoshka dimensions, so its vectors cannot be truncated; drop dimensions "
        "(or use a model whose config_sentence_transformers.json lists matryoshka_dims)"
    )


def refuse_dimensions(line: int, custom_id: str, body: dict[str, Any], why: str | None) -> InputError | None:
    """The line error of an embeddings request asking for dimensions that submit already knows it cannot get."""
    if why is None or "dimensions" not in body:
        return None
    return InputError(line, why, field="dimensions", custom_id=custom_id, code=ErrorCode.DIMENSIONS_NOT_SUPPORTED)

"""Which model a batch runs: the model its lines name (body.model), resolved to a model that is served.

OpenAI's Batch API runs one model per file. A name resolves through the server's aliases (`serve --model
NAME=MODEL`), else to a model a live worker serves (its queue `omlx:<model>`); anything else is an error when
the batch is created, never a batch that waits for a worker that will not come.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omlx_jobs.api.errors import BadRequest, clip
from omlx_jobs.jobs.lines import MAX_LINE_BYTES

MAX_SCANNED_NAMES = 2
"""Distinct models (and urls) a scan keeps: one is the answer, a second is the error; more say nothing new."""
MAX_NAME_CHARS = 1024  # the jobs.model column


@dataclass(frozen=True)
class Scan:
    """What a quick pass over an uploaded file found: its non-blank lines and the models they name, bounded."""

    lines: int
    models: dict[str, int]
    """model name -> the first line that names it (at most MAX_SCANNED_NAMES, each cut to MAX_NAME_CHARS)."""
    urls: dict[str, int]
    """url of OpenAI batch lines -> the first line that gives it (at most MAX_SCANNED_NAMES, each cut short)."""
    model_count: int = 0
    """How many distinct models the file names in all."""

    def to_dict(self) -> dict[str, Any]:
        return {"models": self.models, "urls": self.urls, "model_count": self.model_count}


def scan_file(path: Path) -> Scan:
    """Count non-blank lines; collect body.model (or a shorthand line's model) and url per line, streaming.

    Lines that are not valid JSON are skipped here: validation at batch creation reports them with their line.
    Memory stays bounded: a line is read at most MAX_LINE_BYTES at a time (uploads cap lines there anyway), and
    only a few names, cut short, are kept.
    """
    lines = 0
    models: dict[str, int] = {}
    urls: dict[str, int] = {}
    seen_models: set[str] = set()
    with path.open("rb") as fh:
        for line_no, raw in enumerate(_lines(fh), start=1):
            if not raw.strip():
                continue
            lines += 1
            obj = _object(raw)
            if obj is None:
                continue
            body = obj.get("body")
            model = body.get("model") if isinstance(body, dict) else obj.get("model")
            if isinstance(model, str) and model:
                name = _cut(model)
                if name not in seen_models and len(seen_models) < 1_000:
                    seen_models.add(name)
                if len(models) < MAX_SCANNED_NAMES:
                    models.setdefault(name, line_no)
            url = obj.get("url")
            if isinstance(url, str) and len(urls) < MAX_SCANNED_NAMES:
                urls.setdefault(clip(url), line_no)
    return Scan(lines, models, urls, len(seen_models))


def _lines(fh: Any) -> Iterator[bytes]:
    """Lines of at most MAX_LINE_BYTES + 2 bytes; the rest of a longer one is skipped, not held."""
    while raw := fh.readline(MAX_LINE_BYTES + 2):
        if not raw.endswith(b"\n"):
            while (rest := fh.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                pass
        yield raw


def _object(raw: bytes) -> dict[str, Any] | None:
    if b'"model"' not in raw and b'"url"' not in raw:  # shorthand lines mostly: skip the decode
        return None
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _cut(name: str) -> str:
    return name if len(name) <= MAX_NAME_CHARS else clip(name)


def resolve_model(
    file_models: dict[str, int], aliases: dict[str, str], live: Iterable[str], count: int = 0
) -> tuple[str, str]:
    """(the name the batch reports, the model workers serve) for a file naming `file_models`.

    Raises BadRequest for a file naming several models, or a model nothing serves.
    """
    live = set(live)
    known = sorted(set(aliases) | live)
    shown = ", ".join(repr(k) for k in known) if known else "none (start `omlx-jobs worker --model MODEL`)"
    if len(file_models) > 1:
        (a, la), (b, lb), *_ = sorted(file_models.items(), key=lambda kv: kv[1])
        raise BadRequest(
            f"the input file names {max(count, len(file_models))} models: {clip(a)!r} (line {la}) and {clip(b)!r} "
            f"(line {lb}); "
            "a batch runs one model, as in OpenAI's API. Split the file by model",
            param="input_file_id",
            code="mixed_models",
        )
    if not file_models:
        if len(known) == 1:
            name = known[0]
            return name, aliases.get(name, name)
        raise BadRequest(
            f"no line of the input file names a model (body.model); name one of the served models: {shown}",
            param="input_file_id",
            code="model_not_found",
        )
    ((name, line),) = file_models.items()
    if name in aliases:
        return name, aliases[name]
    if name in live:
        return name, name
    raise BadRequest(
        f"model {clip(name)!r} (line {line}) is not served here. Served models: {shown}. Start a worker with "
        f"`omlx-jobs worker --model {clip(name)}`, or give the server an alias with "
        f"`omlx-jobs serve --model {clip(name)}=MODEL`",
        param="model",
        code="model_not_found",
    )

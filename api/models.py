"""Which model a batch runs: the model its lines name (body.model), resolved to a model that is served.

OpenAI's Batch API runs one model per file. A name resolves through the server's aliases (`serve --model
NAME=MODEL`), else to a model a live worker serves (its queue `omlx:<model>`); anything else is an error when
the batch is created, never a batch that waits for a worker that will not come.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from omlx_jobs.api.errors import BadRequest


@dataclass(frozen=True)
class Scan:
    """What a quick pass over an uploaded file found: its non-blank lines and the models they name."""

    lines: int
    models: dict[str, int]
    """model name -> the first line that names it."""
    urls: dict[str, int]
    """url of OpenAI batch lines -> the first line that gives it."""

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {"models": self.models, "urls": self.urls}


def scan_file(path: Path) -> Scan:
    """Count non-blank lines; collect body.model (or a shorthand line's model) and url per line, streaming.

    Lines that are not valid JSON are skipped here: validation at batch creation reports them with their line.
    """
    lines = 0
    models: dict[str, int] = {}
    urls: dict[str, int] = {}
    with path.open("rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            lines += 1
            if b'"model"' not in raw and b'"url"' not in raw:  # shorthand lines mostly: skip the decode
                continue
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(obj, dict):
                continue
            body = obj.get("body")
            model = body.get("model") if isinstance(body, dict) else obj.get("model")
            if isinstance(model, str) and model and model not in models:
                models[model] = line_no
            url = obj.get("url")
            if isinstance(url, str) and url not in urls:
                urls[url] = line_no
    return Scan(lines, models, urls)


def resolve_model(file_models: dict[str, int], aliases: dict[str, str], live: Iterable[str]) -> tuple[str, str]:
    """(the name the batch reports, the model workers serve) for a file naming `file_models`.

    Raises BadRequest for a file naming several models, or a model nothing serves.
    """
    live = set(live)
    known = sorted(set(aliases) | live)
    shown = ", ".join(repr(k) for k in known) if known else "none (start `omlx-jobs worker --model MODEL`)"
    if len(file_models) > 1:
        (a, la), (b, lb), *_ = sorted(file_models.items(), key=lambda kv: kv[1])
        raise BadRequest(
            f"the input file names {len(file_models)} models: {a!r} (line {la}) and {b!r} (line {lb}); "
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
        f"model {name!r} (line {line}) is not served here. Served models: {shown}. Start a worker with "
        f"`omlx-jobs worker --model {name}`, or give the server an alias with `omlx-jobs serve --model {name}=MODEL`",
        param="model",
        code="model_not_found",
    )

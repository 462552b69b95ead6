"""OpenAI batch output lines from stored requests. Pure logic."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from omlx_jobs.jobs.formats import CHAT_URL

# Failures of ours (the engine, a lost worker): retrying can help. Every other code means the request itself
# is wrong (input validation, a prompt over the context), reported as a 400 like OpenAI does.
SERVER_ERROR_CODES = frozenset({"server_error", "engine_error", "too_many_attempts", "worker_lost", "timeout"})


# The request columns an output line reads: export asks the store for these only (never the prompt bodies).
OUTPUT_COLUMNS = (
    "id",
    "idx",
    "custom_id",
    "endpoint",
    "status",
    "output_text",
    "more_choices",
    "finish_reason",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "error_code",
    "error_message",
    "finished_at",
)

# One encoder for every line: json.dumps with options builds a new one per call.
_encode = json.JSONEncoder(ensure_ascii=False).encode


def _usage(row: Any) -> dict[str, Any]:
    prompt = row.prompt_tokens or 0
    completion = row.completion_tokens or 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": row.cached_tokens or 0},
    }


def _choices(row: Any) -> list[tuple[str, str | None]]:
    first = (row.output_text or "", row.finish_reason)
    if not row.more_choices:
        return [first]
    return [first, *((c.get("text", ""), c.get("finish_reason")) for c in row.more_choices)]


def response_body(row: Any, model: str) -> dict[str, Any]:
    """The `chat.completion` or `text_completion` object of a completed request."""
    created = int(row.finished_at or 0)
    if row.endpoint == CHAT_URL:
        return {
            "id": f"chatcmpl-{row.id}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": reason,
                }
                for i, (text, reason) in enumerate(_choices(row))
            ],
            "usage": _usage(row),
        }
    return {
        "id": f"cmpl-{row.id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": i, "text": text, "logprobs": None, "finish_reason": reason}
            for i, (text, reason) in enumerate(_choices(row))
        ],
        "usage": _usage(row),
    }


def output_line(row: Any, job_id: str, model: str) -> tuple[dict[str, Any], bool]:
    """One output line for a final request, and whether it is an error line."""
    line_id = f"batch_req_{job_id}_{row.idx}"
    if row.status == "completed":
        return (
            {
                "id": line_id,
                "custom_id": row.custom_id,
                "response": {
                    "status_code": 200,
                    "request_id": f"req_{row.id}",
                    "body": response_body(row, model),
                },
                "error": None,
            },
            False,
        )
    if row.status == "cancelled":
        return (
            {
                "id": line_id,
                "custom_id": row.custom_id,
                "response": None,
                # An expired batch's unfinished requests carry code batch_expired (store/batches.py).
                "error": {
                    "code": row.error_code or "batch_cancelled",
                    "message": row.error_message or "the job was cancelled before this request ran",
                },
            },
            True,
        )
    code = row.error_code or "server_error"
    client = code not in SERVER_ERROR_CODES
    return (
        {
            "id": line_id,
            "custom_id": row.custom_id,
            "response": {
                "status_code": 400 if client else 500,
                "request_id": f"req_{row.id}",
                "body": {
                    "error": {
                        "message": row.error_message or code,
                        "type": "invalid_request_error" if client else "server_error",
                        "param": None,
                        "code": code,
                    }
                },
            },
            "error": None,
        },
        True,
    )


def output_lines(rows: Iterable[Any], job_id: str, model: str) -> Iterator[tuple[str, bool]]:
    """Serialized output lines (without newline) for the final rows, in the order given; pending rows skipped."""
    for row in rows:
        if row.status == "pending":
            continue
        obj, is_error = output_line(row, job_id, model)
        yield _encode(obj), is_error

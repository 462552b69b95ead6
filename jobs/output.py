"""OpenAI batch output lines from stored requests. Pure logic."""

from __future__ import annotations

import base64
from collections.abc import Iterable, Iterator
from typing import Any

from omlx_jobs.errors import SERVER_ERROR_CODES, ErrorCode
from omlx_jobs.jobs import embeddings
from omlx_jobs.jobs.formats import CHAT_URL
from omlx_jobs.jobs.jsonl import dumps_line
from omlx_jobs.jobs.logprobs import choice_logprobs
from omlx_jobs.store.models import RequestStatus
from omlx_jobs.store.rows import RESULT_COLUMNS
from omlx_jobs.store.vectors import StoredVectors

# The request columns an output line reads: export asks the store for these only (never the prompt bodies).
# A new result column (store/rows.py) is read without a change here.
OUTPUT_COLUMNS = (
    "id",
    "idx",
    "custom_id",
    "endpoint",
    "status",
    *RESULT_COLUMNS,
    "error_code",
    "error_message",
    "finished_at",
    "run_id",
)


def _usage(row: Any) -> dict[str, Any]:
    prompt = row.prompt_tokens or 0
    completion = row.completion_tokens or 0
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": row.cached_tokens or 0},
    }
    extras = getattr(row, "chat_extras", None)
    if extras:
        thought = sum((e or {}).get("reasoning_tokens", 0) for e in extras)
        usage["completion_tokens_details"] = {"reasoning_tokens": thought}
    return usage


def _message(row: Any, i: int, text: str) -> dict[str, Any]:
    """A chat choice's message: the answer, and its thinking and tool calls where it has them (issue 24)."""
    extras = getattr(row, "chat_extras", None)
    extra = extras[i] if extras and i < len(extras) else None
    if not extra:
        return {"role": "assistant", "content": text}
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if extra.get("reasoning_content") is not None:
        message["reasoning_content"] = extra["reasoning_content"]
    calls = extra.get("tool_calls")
    if calls:
        message["content"] = text or None
        message["tool_calls"] = [
            {"id": f"call_{row.id}_{i}_{j}", "type": "function", "function": dict(call)} for j, call in enumerate(calls)
        ]
    return message


def _choices(row: Any) -> list[tuple[str, str | None]]:
    first = (row.output_text or "", row.finish_reason)
    if not row.more_choices:
        return [first]
    return [first, *((c.get("text", ""), c.get("finish_reason")) for c in row.more_choices)]


def embeddings_body(row: Any, model: str) -> dict[str, Any]:
    """OpenAI's embeddings response of a completed request, its vectors as floats or base64 as it asked."""
    stored = StoredVectors.decode(row.vectors)
    data = []
    for i in range(stored.count):
        vector: Any = base64.b64encode(stored.vector_bytes(i)).decode("ascii") if stored.base64 else stored.vector(i)
        data.append({"object": "embedding", "index": i, "embedding": vector})
    prompt = row.prompt_tokens or 0
    usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt}
    if getattr(row, "cached_tokens", None):  # a shared prefix computed once (as completions report it)
        usage["prompt_tokens_details"] = {"cached_tokens": row.cached_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


_FLOAT32 = "%.9g".__mod__  # 9 significant digits: every float32 reads back exactly, in ~60% of repr's text


def _embeddings_text(obj: dict[str, Any], row: Any) -> str:
    """The output line of a completed float embeddings request: each vector written as float32 text (2x faster
    than json's float repr). Each `"embedding"` holds its index as a stand-in here, replaced by its vector's text:
    `"embedding": 3}` cannot occur inside a JSON string (a quote there is escaped), so only ours match."""
    stored = StoredVectors.decode(row.vectors)
    for d in obj["response"]["body"]["data"]:
        d["embedding"] = d["index"]
    text = dumps_line(obj)
    for i in range(stored.count):
        values = ",".join(map(_FLOAT32, stored.vector(i)))
        text = text.replace(f'"embedding": {i}}}', f'"embedding": [{values}]}}', 1)
    return text


def response_body(row: Any, model: str) -> dict[str, Any]:
    """The `chat.completion`, `text_completion` or embeddings `list` object of a completed request."""
    if embeddings.is_embeddings(row.endpoint):
        return embeddings_body(row, model)
    created = int(row.finished_at or 0)
    # Stored logprobs (worker/logprobs.py) only where they were asked for; every other choice says null.
    # getattr: rows read without that column (older exports, tests' stand-ins) have none.
    logprobs = choice_logprobs(getattr(row, "logprobs", None), chat=row.endpoint == CHAT_URL)

    def lp(i: int) -> dict[str, Any] | None:
        return logprobs[i] if i < len(logprobs) else None

    if row.endpoint == CHAT_URL:
        return {
            "id": f"chatcmpl-{row.id}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": i,
                    "message": _message(row, i, text),
                    "logprobs": lp(i),
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
            {"index": i, "text": text, "logprobs": lp(i), "finish_reason": reason}
            for i, (text, reason) in enumerate(_choices(row))
        ],
        "usage": _usage(row),
    }


def output_line(row: Any, job_id: str, model: str) -> tuple[dict[str, Any], bool]:
    """One output line for a final request, and whether it is an error line."""
    line_id = f"batch_req_{job_id}_{row.idx}"
    if row.status == RequestStatus.COMPLETED:
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
    if row.status == RequestStatus.CANCELLED:
        return (
            {
                "id": line_id,
                "custom_id": row.custom_id,
                "response": None,
                # An expired batch's unfinished requests carry code batch_expired (store/batches.py).
                "error": {
                    "code": row.error_code or ErrorCode.BATCH_CANCELLED.value,
                    "message": row.error_message or "the job was cancelled before this request ran",
                },
            },
            True,
        )
    code = row.error_code or ErrorCode.SERVER_ERROR.value
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
                        "type": "invalid_request_error" if client else ErrorCode.SERVER_ERROR,
                        "param": None,
                        "code": code,
                    }
                },
            },
            "error": None,
        },
        True,
    )


def output_lines(
    rows: Iterable[Any], job_id: str, model: str, models: dict[int, str] | None = None
) -> Iterator[tuple[str, bool]]:
    """Serialized output lines (without newline) for the final rows, in the order given; pending rows skipped.

    `models` maps a row's run_id to the model that run served: a result names the model that actually ran
    (the job's `model` for rows without a run).
    """
    models = models or {}
    for row in rows:
        if row.status == RequestStatus.PENDING:
            continue
        run_id = getattr(row, "run_id", None)
        obj, is_error = output_line(row, job_id, models.get(run_id, model) if run_id is not None else model)
        if not is_error and embeddings.is_embeddings(row.endpoint) and not StoredVectors.decode(row.vectors).base64:
            yield _embeddings_text(obj, row), False
            continue
        yield dumps_line(obj), is_error

"""One base error class and one enum of error codes (omlx_jobs/errors.py). Pure: no MLX."""

from __future__ import annotations

import json

import pytest

from omlx_jobs.errors import INPUT_ERROR_CODES, SERVER_ERROR_CODES, ErrorCode, OmlxError
from omlx_jobs.jobs.errors import BadValue, InputError, InvalidLine
from omlx_jobs.jobs.export import OutputExists
from omlx_jobs.jobs.queue import RedisUnavailable
from omlx_jobs.store.errors import JobNotFound, StoreError
from omlx_jobs.store.models import FINAL_REQUEST_STATUSES, JobStatus, RequestStatus


def test_a_code_reads_and_serializes_as_its_value() -> None:
    code = ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert code == "context_length_exceeded" and str(code) == "context_length_exceeded"
    assert f"[{code}]" == "[context_length_exceeded]"
    assert json.dumps({"code": code}) == '{"code": "context_length_exceeded"}'
    assert "context_length_exceeded" in {code} and ErrorCode("timeout") is ErrorCode.TIMEOUT


@pytest.mark.parametrize("member", [*JobStatus, *RequestStatus, ErrorCode.BATCH_EXPIRED])
def test_statuses_read_and_serialize_as_their_value(member: JobStatus | RequestStatus) -> None:
    assert member == member.value and str(member) == member.value and f"{member:>12}" == f"{member.value:>12}"
    assert json.dumps({"status": member}) == json.dumps({"status": member.value})
    assert {member.value: 1}[member] == 1 and type(member)(member.value) is member


def test_job_statuses_keep_openais_names() -> None:
    assert [s.value for s in JobStatus] == [
        "validating", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled", "expired"
    ]  # fmt: skip
    assert set(FINAL_REQUEST_STATUSES) == {"completed", "failed", "cancelled"} and RequestStatus.PENDING == "pending"


def test_code_sets_partition_what_users_can_see() -> None:
    assert not INPUT_ERROR_CODES & SERVER_ERROR_CODES
    assert {
        "engine_error",
        "too_many_attempts",
        "worker_lost",
        "timeout",
        "server_error",
        "shard_failed",
        "unstorable_result",
    } == SERVER_ERROR_CODES
    assert "empty_file" in INPUT_ERROR_CODES and "context_length_exceeded" not in INPUT_ERROR_CODES


def test_unknown_codes_fail_loudly() -> None:
    with pytest.raises(ValueError):
        InputError(3, "bad", code="no_such_code")
    with pytest.raises(ValueError):
        BadValue("no_such_code", "field", "bad")


def test_input_errors_keep_their_printed_and_stored_forms() -> None:
    err = InputError(5, "invalid JSON", code="invalid_json")
    assert err.code is ErrorCode.INVALID_JSON
    assert str(err) == "line 5: invalid JSON [invalid_json]"
    assert err.to_dict() == {
        "line": 5,
        "field": None,
        "custom_id": None,
        "code": "invalid_json",
        "message": "invalid JSON",
    }
    assert type(err.to_dict()["code"]) is str  # plain text for JSON columns and drivers


def test_every_error_type_derives_from_the_base() -> None:
    from omlx_jobs.worker.entry import UnknownJob
    from omlx_jobs.worker.models.gguf_file import GGUFError
    from omlx_jobs.worker.models.paths import ModelLoadError
    from omlx_jobs.worker.prompts import PromptError
    from omlx_jobs.worker.runtime.rq_worker import RefusedPayload

    types = [
        BadValue,
        InvalidLine,
        OutputExists,
        RedisUnavailable,
        StoreError,
        JobNotFound,
        UnknownJob,
        GGUFError,
        ModelLoadError,
        PromptError,
        RefusedPayload,
    ]
    assert all(issubclass(t, OmlxError) for t in types)
    # The builtin bases stay, so existing `except ValueError` / `except RuntimeError` handlers still catch them.
    assert issubclass(StoreError, RuntimeError) and issubclass(OutputExists, FileExistsError)
    assert PromptError("invalid_prompt", "x").code is ErrorCode.INVALID_PROMPT

"""The hostile-input corpus in tests/data/bad/: each file against its expectation in cases.json.

Submit-time cases run through parse_stream and through load_job into a real SQLite store; runtime cases
(only the model can judge them) run through the tiny model's Engine and run_shard.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omlx_jobs.jobs import lifecycle
from omlx_jobs.jobs.formats import INPUT_ERROR_CODES, MAX_LINE_BYTES, InputError, ParsedRequest, parse_stream
from omlx_jobs.jobs.images import ImageAccess
from omlx_jobs.jobs.params import OutputParams
from omlx_jobs.jobs.submit import load_job
from omlx_jobs.store import RequestStatus, Store, open_store

DATA = Path(__file__).parent / "data" / "bad"
CASES: list[dict[str, Any]] = json.loads((DATA / "cases.json").read_text(encoding="utf-8"))["cases"]
RUNTIME_CODES = {"context_length_exceeded", "invalid_prompt", "invalid_logit_bias"}
MODEL = "tiny"


def _cases(outcome: str) -> list[Any]:
    return [pytest.param(c, id=c["file"].removesuffix(".jsonl")) for c in CASES if c["outcome"] == outcome]


def _input(case: dict[str, Any], tmp_path: Path) -> Path:
    """The case's file; a generated case (too big or too odd to commit) is written here first."""
    gen = case.get("generate")
    if gen is None:
        return DATA / case["file"]
    path = tmp_path / case["file"]
    with open(path, "wb") as f:
        if gen["kind"] == "long_line":
            f.write(gen["before"].encode() + b"\n")
            f.write(b'{"prompt": "' + b"a" * gen["bytes"] + b'"}\n')
            f.write(gen["after"].encode() + b"\n")
        elif gen["kind"] == "deep_nesting":
            f.write(b"[" * gen["depth"] + b"\n" + gen["after"].encode() + b"\n")
        else:
            raise AssertionError(f"unknown generator {gen['kind']!r}")
    return path


def _access(case: dict[str, Any]) -> ImageAccess:
    """Where the case's images may come from: data: URIs only, unless it says remote images are on."""
    return ImageAccess.create(allow_remote=bool(case.get("allow_remote_images")))


def _assert_error(got: InputError | dict[str, Any], want: dict[str, Any]) -> None:
    """The error names the line, the field (where there is one), the code, and says what is wrong."""
    err = got if isinstance(got, InputError) else InputError(**got)
    assert (err.line, err.field, err.code) == (want["line"], want["field"], want["code"]), str(err)
    assert want["message"] in err.message, str(err)
    text = str(err)
    assert text.startswith(f"line {err.line}" if err.line else "file"), text
    if err.field:
        assert repr(err.field) in text, text
    assert err.code in text, text


@pytest.fixture
def store(sqlite_url: str) -> Iterator[Store]:
    s = open_store(url=sqlite_url)
    yield s
    s.close()


# ---- the corpus itself ----------------------------------------------------------------------------


def test_corpus_is_complete() -> None:
    assert len(CASES) >= 40
    names = [c["file"] for c in CASES]
    assert len(names) == len(set(names)), "each file is listed once"
    on_disk = {p.name for p in DATA.glob("*.jsonl")}
    generated = {c["file"] for c in CASES if "generate" in c}
    assert on_disk == set(names) - generated, "every committed file has an expectation, and vice versa"
    for name in on_disk:
        assert (DATA / name).stat().st_size < 4096, f"{name}: keep corpus files tiny; generate big ones"
    for case in CASES:
        assert case["outcome"] in ("rejected", "accepted", "runtime"), case["file"]
        codes = {e["code"] for e in case.get("errors", [])}
        allowed = RUNTIME_CODES if case["outcome"] == "runtime" else INPUT_ERROR_CODES
        assert codes <= allowed, (case["file"], codes - allowed)
        assert case["outcome"] == "accepted" or codes, case["file"]


def test_long_line_is_over_the_limit(tmp_path: Path) -> None:
    case = next(c for c in CASES if c.get("generate", {}).get("kind") == "long_line")
    assert _input(case, tmp_path).stat().st_size > 2 * MAX_LINE_BYTES


# ---- submit time: rejected files ---------------------------------------------------------------------


@pytest.mark.parametrize("case", _cases("rejected"))
def test_parse_stream_reports_each_bad_line(case: dict[str, Any], tmp_path: Path) -> None:
    with open(_input(case, tmp_path), "rb") as f:
        items = list(parse_stream(f, _access(case)))
    errors = [i for i in items if isinstance(i, InputError)]
    expected = [e for e in case["errors"] if e["line"] > 0]  # line 0 (the whole file) is load_job's verdict
    assert [e.line for e in errors] == [e["line"] for e in expected], [str(e) for e in errors]
    for got, want in zip(errors, expected, strict=True):
        _assert_error(got, want)
    assert sum(isinstance(i, ParsedRequest) for i in items) == case["valid"]


@pytest.mark.parametrize("case", _cases("rejected"))
def test_load_job_rejects_the_whole_file(case: dict[str, Any], tmp_path: Path, store: Store) -> None:
    result = load_job(store, _input(case, tmp_path), MODEL, images=_access(case))
    assert result.rejected
    assert [e.line for e in result.errors] == [e["line"] for e in case["errors"]]
    job = store.get_job(result.job_id)
    assert job.status == lifecycle.FAILED
    assert job.total == 0
    assert list(store.iter_requests(result.job_id)) == [], "nothing of a rejected file is stored"
    assert job.errors is not None and len(job.errors) == len(case["errors"])
    for stored, want in zip(job.errors, case["errors"], strict=True):
        _assert_error(stored, want)


@pytest.mark.parametrize("case", _cases("rejected"))
def test_skip_invalid_keeps_good_lines(case: dict[str, Any], tmp_path: Path, store: Store) -> None:
    result = load_job(store, _input(case, tmp_path), MODEL, skip_invalid=True, images=_access(case))
    if case["valid"] == 0:  # nothing left to run: rejected even with skip_invalid
        assert result.rejected
        assert store.get_job(result.job_id).status == lifecycle.FAILED
        assert list(store.iter_requests(result.job_id)) == []
        return
    assert not result.rejected
    rows = list(store.iter_requests(result.job_id))
    assert sum(r.status == RequestStatus.PENDING for r in rows) == case["valid"]
    failed = {r.line: r.error_code for r in rows if r.status == RequestStatus.FAILED}
    assert failed == {e["line"]: e["code"] for e in case["errors"]}
    for row in rows:
        if row.status == RequestStatus.FAILED:
            assert row.body is None
            assert f"line {row.line}" in row.error_message
    job = store.get_job(result.job_id)
    assert job.total == len(rows)
    assert [e["line"] for e in job.errors or []] == [e["line"] for e in case["errors"]]


# ---- submit time: files that must be accepted ------------------------------------------------------------


@pytest.mark.parametrize("case", _cases("accepted"))
def test_accepted_files(case: dict[str, Any], tmp_path: Path, store: Store) -> None:
    path = _input(case, tmp_path)
    with open(path, "rb") as f:
        items = list(parse_stream(f))
    assert all(isinstance(i, ParsedRequest) for i in items), [str(i) for i in items]
    assert [i.custom_id for i in items] == case["custom_ids"]
    result = load_job(store, path, MODEL)
    assert not result.rejected and result.errors == []
    rows = list(store.iter_requests(result.job_id))
    assert [r.custom_id for r in rows] == case["custom_ids"]
    assert all(r.status == RequestStatus.PENDING for r in rows)
    for row in rows:  # "stored": what the normalized body must hold (the worker reads only that)
        want = case.get("stored", {}).get(row.custom_id, {})
        assert {k: row.body.get(k) for k in want} == want, (row.custom_id, row.body)


# ---- run time: only the model can judge ------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_loaded):  # type: ignore[no-untyped-def]
    from omlx_jobs.worker.engine.config import EngineConfig
    from omlx_jobs.worker.engine.loop import Engine

    return Engine(tiny_loaded, EngineConfig(completion_batch_size=4, prefill_batch_size=4))


@pytest.mark.parametrize("case", _cases("runtime"))
def test_runtime_check_names_the_request(case: dict[str, Any], tmp_path: Path, engine) -> None:  # type: ignore[no-untyped-def]
    from omlx_jobs.jobs.formats import SamplingParams
    from omlx_jobs.worker.prompts import PromptError

    with open(_input(case, tmp_path), "rb") as f:
        requests = list(parse_stream(f))
    assert all(isinstance(r, ParsedRequest) for r in requests), "runtime cases pass submit-time validation"
    failures = {}
    for req in requests:
        try:
            tokens = engine.loaded.encode(req.endpoint, req.body)
            engine.check(tokens, SamplingParams.from_body(req.body), OutputParams.from_body(req.body))
        except PromptError as exc:
            failures[req.line] = exc
    assert sorted(failures) == [e["line"] for e in case["errors"]]
    for want in case["errors"]:
        assert failures[want["line"]].code == want["code"]
        assert want["message"] in failures[want["line"]].message


@pytest.mark.parametrize("case", _cases("runtime"))
def test_runtime_error_fails_only_its_request(case: dict[str, Any], tmp_path: Path, store: Store, engine) -> None:  # type: ignore[no-untyped-def]
    from omlx_jobs.worker.runtime.shard import run_shard

    result = load_job(store, _input(case, tmp_path), MODEL)
    assert not result.rejected, [str(e) for e in result.errors]
    outcome = run_shard(store, engine, result.job_id)
    rows = {r.line: r for r in store.iter_requests(result.job_id)}
    for want in case["errors"]:
        row = rows.pop(want["line"])
        assert row.status == RequestStatus.FAILED
        assert row.error_code == want["code"]
        assert want["message"] in row.error_message
    assert [r.status for r in rows.values()] == [RequestStatus.COMPLETED] * case["completed"]
    assert (outcome.failed, outcome.completed) == (len(case["errors"]), case["completed"])
    assert store.get_job(result.job_id).status == lifecycle.COMPLETED

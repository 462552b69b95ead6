"""Every JSONL the project writes is one line per record for str.splitlines() (issue 21, 9): U+0085, U+2028,
U+2029 and the other characters it splits on come out as \\uXXXX escapes, in custom ids, echoed prompts, model
output and error messages: the results file, the errors file and the API's output and error files. A real job
on the tiny model, a real SQLite store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from omlx_jobs.jobs.export import write_results
from omlx_jobs.jobs.jsonl import LINE_BREAKS, dumps_line
from omlx_jobs.jobs.submit import load_job
from omlx_jobs.store import Store, open_store
from omlx_jobs.store.models import Request

BREAKS = LINE_BREAKS + "\n\r"  # with the two that JSON escapes anyway


def test_dumps_line_escapes_every_line_break() -> None:
    splitters = [chr(c) for c in range(0x110000) if len(f"a{chr(c)}b".splitlines()) > 1]
    assert set(splitters) == set(BREAKS)  # LINE_BREAKS is exactly what str.splitlines adds to \n and \r
    obj = {f"k{BREAKS}": [f"v{BREAKS}", {"deep": BREAKS * 3}], "plain": "é 中 😀"}
    line = dumps_line(obj)
    assert line.splitlines() == [line] and line.isprintable()
    assert json.loads(line) == obj
    assert "é 中 😀" in line  # other text stays as it is (UTF-8, not escaped)


@pytest.fixture
def store(sqlite_url: str) -> Any:
    s = open_store(url=sqlite_url)
    yield s
    s.close()


def _job(tmp_path: Path, store: Store) -> tuple[str, list[str], list[str]]:
    """Custom ids with the Unicode breaks (control characters make a custom_id invalid: error lines), and echoed
    prompts holding every break. Returns the job, the ids of the output lines and of the error lines."""
    unicode_breaks = "\x85\u2028\u2029"
    lines: list[dict[str, Any]] = [
        {"custom_id": f"id{c}{i}", "prompt": "Once upon a time", "max_tokens": 2} for i, c in enumerate(unicode_breaks)
    ]
    lines += [
        {"custom_id": f"p{i}", "prompt": f"Once{c}upon a time", "max_tokens": 2, "echo": True, "temperature": 0}
        for i, c in enumerate(BREAKS)
    ]
    errors = [{"custom_id": f"bad{unicode_breaks}", "prompt": "x", "max_tokens": -1}, {"custom_id": "ctl\x0b\x1c"}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines + errors))
    result = load_job(store, src, "tiny", skip_invalid=True)
    assert not result.rejected
    return result.job_id, [x["custom_id"] for x in lines], [x["custom_id"] for x in errors]


def _records(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    return [json.loads(x) for x in text.splitlines()]  # the README's way of reading results


def test_results_and_errors_files_split_into_one_line_per_record(
    tmp_path: Path, store: Store, tiny_loaded: Any
) -> None:
    from omlx_jobs.worker.engine.config import EngineConfig
    from omlx_jobs.worker.engine.loop import Engine
    from omlx_jobs.worker.runtime.shard import run_shard

    job_id, ok_ids, error_ids = _job(tmp_path, store)
    run_shard(store, Engine(tiny_loaded, EngineConfig(completion_batch_size=4, prefill_batch_size=4)), job_id)
    counts = write_results(store, job_id, tmp_path / "out.jsonl", tmp_path / "err.jsonl")
    out, err = _records(tmp_path / "out.jsonl"), _records(tmp_path / "err.jsonl")
    assert (len(out), len(err)) == (counts.written, counts.errors) == (len(ok_ids), len(error_ids))
    assert [r["custom_id"] for r in out] == ok_ids and [r["custom_id"] for r in err] == error_ids
    for record, c in zip(out[3:], BREAKS, strict=True):
        assert f"Once{c}upon a time" in record["response"]["body"]["choices"][0]["text"]  # echo kept the break

    # Model output holding them too (what a model may emit), through the same export.
    row = next(r for r in store.iter_requests(job_id) if r.status == "completed")
    with store.engine.begin() as conn:
        conn.execute(update(Request).where(Request.id == row.id).values(output_text=f"out{BREAKS}put"))
    write_results(store, job_id, tmp_path / "again.jsonl", force=True)
    again = _records(tmp_path / "again.jsonl")
    assert len(again) == len(ok_ids) + len(error_ids)
    assert any(r["response"] and r["response"]["body"]["choices"][0]["text"] == f"out{BREAKS}put" for r in again)


def test_api_output_files_split_into_one_line_per_record(
    tmp_path: Path, store: Store, sqlite_url: str, redis_url: str, tiny_loaded: Any
) -> None:
    from omlx_jobs.api import ServeConfig
    from omlx_jobs.api.files import job_file_chunks
    from omlx_jobs.api.state import AppState
    from omlx_jobs.store.files import ERRORS, OUTPUT
    from omlx_jobs.worker.engine.config import EngineConfig
    from omlx_jobs.worker.engine.loop import Engine
    from omlx_jobs.worker.runtime.shard import run_shard

    job_id, ok_ids, error_ids = _job(tmp_path, store)
    run_shard(store, Engine(tiny_loaded, EngineConfig(completion_batch_size=4, prefill_batch_size=4)), job_id)
    state = AppState(ServeConfig(db_url=sqlite_url, redis_url=redis_url, files_dir=tmp_path / "files"))
    try:
        got = []
        for n, kind in enumerate((OUTPUT, ERRORS)):
            info = state.files.add_job_file(id=f"file-{n:024x}", purpose="batch_output", kind=kind,
                                            filename=f"{kind}.jsonl", job_id=job_id)  # fmt: skip
            text = b"".join(job_file_chunks(state, info)).decode()
            got += [json.loads(x)["custom_id"] for x in text.splitlines()]
        assert got == ok_ids + error_ids
    finally:
        state.close()

"""`/v1/embeddings` input lines (pure: no MLX, no store): every form of `input`, the shorthand, the limits, and a
file that mixes embeddings with generation."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.embeddings import MAX_INPUTS
from omlx_jobs.jobs.formats import EMBEDDINGS_URL, InputError, InvalidLine, parse_line, parse_stream
from omlx_jobs.jobs.sharding import request_key


def line(body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": "c", "method": "POST", "url": EMBEDDINGS_URL, "body": body})


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("one text", ["one text"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_every_form_of_input_normalizes_to_a_list_of_items(given: Any, stored: Any) -> None:
    req = parse_line(line({"model": "m", "input": given, "user": "u-1", "encoding_format": "float"}), 1)
    assert req.endpoint == EMBEDDINGS_URL and req.body == {"input": stored}
    short = parse_line(json.dumps({"input": given, "encoding_format": "base64", "dimensions": 8}), 4)
    assert (short.custom_id, short.endpoint) == ("4", EMBEDDINGS_URL)
    assert short.body == {"input": stored, "encoding_format": "base64", "dimensions": 8}


@pytest.mark.parametrize(
    ("body", "code", "field"),
    [
        ({"input": ""}, ErrorCode.EMPTY_VALUE, "body.input"),
        ({"input": []}, ErrorCode.EMPTY_VALUE, "body.input"),
        ({"input": ["ok", ""]}, ErrorCode.EMPTY_VALUE, "body.input[1]"),
        ({"input": ["x"] * (MAX_INPUTS + 1)}, ErrorCode.TOO_LONG, "body.input"),
        ({"input": ["a", [1]]}, ErrorCode.INVALID_TYPE, "body.input"),
        ({"input": [[1], [True]]}, ErrorCode.INVALID_TYPE, "body.input[1]"),
        ({"input": [-1]}, ErrorCode.OUT_OF_RANGE, "body.input"),
        ({"input": 5}, ErrorCode.INVALID_TYPE, "body.input"),
        ({"input": "a", "encoding_format": "int8"}, ErrorCode.INVALID_VALUE, "body.encoding_format"),
        ({"input": "a", "dimensions": 0}, ErrorCode.OUT_OF_RANGE, "body.dimensions"),
        ({"input": "a", "dimensions": "8"}, ErrorCode.INVALID_TYPE, "body.dimensions"),
        ({"input": "a", "temperature": 0}, ErrorCode.UNSUPPORTED_PARAMETER, "body.temperature"),
        ({"input": "a", "messages": []}, ErrorCode.ENDPOINT_MISMATCH, "body.messages"),
        ({}, ErrorCode.MISSING_FIELD, "body.input"),
    ],
)
def test_bad_embeddings_lines_name_the_field(body: dict[str, Any], code: ErrorCode, field: str) -> None:
    with pytest.raises(InvalidLine) as exc:
        parse_line(line(body), 3)
    assert (exc.value.error.code, exc.value.error.field, exc.value.error.line) == (code, field, 3)


def test_a_shorthand_line_with_input_and_prompt_conflicts() -> None:
    with pytest.raises(InvalidLine) as exc:
        parse_line(json.dumps({"input": "a", "prompt": "b"}), 1)
    assert exc.value.error.code is ErrorCode.CONFLICTING_FIELDS


def test_a_file_is_embeddings_or_generation_not_both() -> None:
    text = "\n".join([json.dumps({"input": "a"}), json.dumps({"prompt": "b"}), json.dumps({"input": ["c"]})])
    out = list(parse_stream(io.BytesIO(text.encode())))
    assert [type(x).__name__ for x in out] == ["ParsedRequest", "InputError", "ParsedRequest"]
    bad = out[1]
    assert isinstance(bad, InputError) and bad.code is ErrorCode.ENDPOINT_MISMATCH and bad.line == 2
    assert "line 1" in bad.message and "two jobs" in bad.message


def test_embeddings_sort_apart_from_prompts_of_the_same_text() -> None:
    assert request_key(EMBEDDINGS_URL, {"input": ["same"]}) != request_key("/v1/completions", {"prompt": "same"})


def test_float_output_lines_hold_every_float32_exactly() -> None:
    import math
    from array import array
    from types import SimpleNamespace

    from omlx_jobs.jobs.output import output_lines, response_body
    from omlx_jobs.store.vectors import StoredVectors

    vectors = [[0.1, -1e-7, 3.4e38, 0.0], [1 / 3, -2.5, 1e-30, 7.0]]
    stored = StoredVectors.from_floats(vectors)
    hostile = 'x"embedding": 0}\\"embedding": 1}'  # our stand-in's text inside a user string stays as it is
    row = SimpleNamespace(
        id=1, idx=0, custom_id=hostile, endpoint=EMBEDDINGS_URL, status="completed", vectors=stored.encode(),
        prompt_tokens=3, run_id=None, finished_at=0,
    )  # fmt: skip
    ((text, is_error),) = output_lines([row], "job", "m")
    line = json.loads(text)
    assert not is_error and line["custom_id"] == hostile
    generic = response_body(row, "m")
    for i in range(2):  # the same object as the generic path, each value the same float32
        got = line["response"]["body"]["data"][i].pop("embedding")
        assert array("f", got).tolist() == generic["data"][i].pop("embedding") == stored.vector(i)
        assert all(math.isfinite(v) for v in got)
    assert line["response"]["body"] == generic


def test_submit_refuses_dimensions_for_a_local_model_that_declares_none(tmp_path: Any) -> None:
    from omlx_jobs.jobs.submit import load_job
    from omlx_jobs.store import open_store

    model = tmp_path / "model"
    model.mkdir()
    (model / "modules.json").write_text("[]")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"input": "a"}) + "\n" + json.dumps({"input": "b", "dimensions": 8}) + "\n")
    store = open_store(url=f"sqlite:///{tmp_path / 'db.sqlite'}")
    refused = load_job(store, src, str(model))
    assert refused.rejected and [(e.line, e.code, e.field) for e in refused.errors] == [
        (2, ErrorCode.DIMENSIONS_NOT_SUPPORTED, "dimensions")
    ]
    (model / "config_sentence_transformers.json").write_text(json.dumps({"matryoshka_dims": [8]}))
    assert not load_job(store, src, str(model)).rejected  # it declares them now
    assert not load_job(store, src, "some/hub-model").rejected  # unknown here: the worker decides
    store.close()

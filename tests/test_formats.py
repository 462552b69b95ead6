"""Unit tests of jobs/formats.py: pure parsing and validation, no Redis, SQL or MLX."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from typing import Any

import pytest

from omlx_jobs.jobs.formats import (
    CHAT_URL,
    COMPLETIONS_URL,
    DEFAULT_MAX_TOKENS,
    INPUT_ERROR_CODES,
    SUPPORTED_PARAMS,
    InputError,
    InvalidLine,
    ParsedRequest,
    SamplingParams,
    iter_lines,
    parse_line,
    parse_stream,
)


def batch(body: Any, url: str = CHAT_URL, **top: Any) -> str:
    return json.dumps({"custom_id": "r1", "method": "POST", "url": url, "body": body, **top})


def chat(*messages: Any, **params: Any) -> str:
    return batch({"messages": list(messages), **params})


USER = {"role": "user", "content": "hi"}


def error_of(text: str, line: int = 1) -> InputError:
    with pytest.raises(InvalidLine) as info:
        parse_line(text, line)
    return info.value.error


def stream(data: bytes) -> list[ParsedRequest | InputError]:
    return list(parse_stream(io.BytesIO(data)))


# ---- one line: every kind of error ------------------------------------------------------------------

ERRORS = [
    # (line text, field, code, message substring)
    ('{"prompt": "a",}', None, "invalid_json", "invalid JSON at column 16"),
    ('{"prompt": "a', None, "invalid_json", "ends before the JSON does"),
    ("{", None, "invalid_json", "one whole JSON object on one line"),
    ('{"prompt": "a", "top_p": NaN}', None, "invalid_json", "NaN is not allowed"),
    ('{"prompt": "a", "top_p": Infinity}', None, "invalid_json", "Infinity is not allowed"),
    ('{"prompt": "a", "n": ' + "1" * 5000 + "}", None, "out_of_range", "5000-digit integer"),
    ("[" * 50_000, None, "invalid_json", "nested too deeply"),
    ('{"prompt": "a", "n": 1, "n": 2}', "n", "duplicate_key", "appears twice"),
    ('["a"]', None, "invalid_type", "must be a JSON object"),
    ("3", None, "invalid_type", "got an integer (3)"),
    ('{"text": "a"}', None, "missing_field", 'needs "prompt" or "messages"'),
    ('{"prompt": "a", "messages": []}', "prompt", "conflicting_fields", "not both"),
    # custom_id
    (json.dumps({"method": "POST", "url": CHAT_URL, "body": {"messages": [USER]}}), "custom_id", "missing_field", ""),
    ('{"custom_id": 5, "prompt": "a"}', "custom_id", "invalid_type", 'quote it, e.g. "req-1"'),
    ('{"custom_id": "", "prompt": "a"}', "custom_id", "empty_value", "must not be empty"),
    (json.dumps({"custom_id": "x" * 513, "prompt": "a"}), "custom_id", "too_long", "513 characters"),
    ('{"custom_id": "a\\u0000b", "prompt": "a"}', "custom_id", "invalid_value", "control characters"),
    ('{"custom_id": "a\\udc00", "prompt": "a"}', "custom_id", "invalid_encoding", "unpaired surrogate \\udc00"),
    # method, url, body
    (batch({"messages": [USER]}).replace('"POST"', '"post"'), "method", "unsupported_method", 'got "post"'),
    (json.dumps({"custom_id": "r1", "url": CHAT_URL, "body": {}}), "method", "missing_field", '"POST"'),
    (batch({"input": "a"}, url="/v1/responses"), "url", "unsupported_url", 'url "/v1/responses"'),
    (batch({"messages": [USER]}, url="v1/chat/completions"), "url", "unsupported_url", "use /v1/chat/completions"),
    (json.dumps({"custom_id": "r1", "method": "POST", "body": {}}), "url", "missing_field", "is missing"),
    (json.dumps({"custom_id": "r1", "method": "POST", "url": CHAT_URL}), "body", "missing_field", "is missing"),
    (batch([USER]), "body", "invalid_type", "must be an object, got a list"),
    (batch({"messages": [USER]}, modle="m"), "modle", "unknown_field", "inside body"),
    (batch({"messages": [USER]}, bdy={}), "bdy", "unknown_field", "did you mean 'body'?"),
    (batch({"prompt": "a"}), "body.prompt", "endpoint_mismatch", COMPLETIONS_URL),
    (batch({"messages": [USER]}, url=COMPLETIONS_URL), "body.messages", "endpoint_mismatch", CHAT_URL),
    (batch({}, url=COMPLETIONS_URL), "body.prompt", "missing_field", "needs a prompt"),
    (batch({}), "body.messages", "missing_field", "needs a list of messages"),
    # messages
    (chat(), "body.messages", "empty_value", "at least one message"),
    (batch({"messages": {"role": "user"}}), "body.messages", "invalid_type", "got an object"),
    (chat("hi"), "body.messages[0]", "invalid_type", 'got a string ("hi")'),
    (chat({"content": "hi"}), "body.messages[0].role", "missing_field", "use one of system"),
    (chat({"role": "User", "content": "hi"}), "body.messages[0].role", "invalid_role", 'got a string ("User")'),
    (chat(USER, {"role": "function", "content": "x"}), "body.messages[1].role", "invalid_role", "as a tool message"),
    (chat({"role": "user", "content": None}), "body.messages[0].content", "missing_field", "or null"),
    (chat({"role": "system", "content": ""}), "body.messages[0].content", "empty_value", "drop the message"),
    (chat({"role": "user", "content": []}), "body.messages[0].content", "empty_value", "must not be empty"),
    (chat({"role": "user", "content": {"text": "hi"}}), "body.messages[0].content", "invalid_type", "content parts"),
    (chat({"role": "user", "content": ["hi"]}), "body.messages[0].content[0]", "invalid_type", '"type": "text"'),
    (chat({"role": "user", "content": [{"text": "hi"}]}), "body.messages[0].content[0].type", "missing_field", ""),
    (
        chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/x.png"}}]}),
        "body.messages[0].content[0].image_url.url",
        "image_path_not_allowed",
        "--allow-files-from",
    ),
    (
        chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://h/i.png"}}]}),
        "body.messages[0].content[0].image_url.url",
        "remote_images_disabled",
        "--allow-remote-images",
    ),
    (
        chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png,abc"}}]}),
        "body.messages[0].content[0].image_url.url",
        "invalid_image_url",
        "base64",
    ),
    (
        chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk="}}]}),
        "body.messages[0].content[0].image_url.url",
        "invalid_image",
        "not a PNG, JPEG, WebP or GIF",
    ),
    (
        chat({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}),
        "body.messages[0].content[0].type",
        "unsupported_content",
        "'input_audio'",
    ),
    (
        chat({"role": "user", "content": [{"type": "text", "text": 1}]}),
        "body.messages[0].content[0].text",
        "invalid_type",
        "must be a string",
    ),
    (chat({**USER, "tool_calls": []}), "body.messages[0].tool_calls", "invalid_value", "only assistant messages"),
    (chat({**USER, "weight": 1}), "body.messages[0].weight", "unknown_field", "a message takes role, content"),
    (chat({"role": "user", "content": "a\ud800"}), "body.messages[0].content", "invalid_encoding", "surrogate"),
    # prompts
    ('{"prompt": ""}', "prompt", "empty_value", "give the prompt text"),
    ('{"prompt": []}', "prompt", "empty_value", "must not be empty"),
    ('{"prompt": ["a", "b"]}', "prompt", "invalid_type", "each on its own line"),
    ('{"prompt": [1, true]}', "prompt", "invalid_type", "integer token ids"),
    ('{"prompt": [1, -1]}', "prompt", "out_of_range", "non-negative"),
    ('{"prompt": 7}', "prompt", "invalid_type", "got an integer (7)"),
    ('{"prompt": null}', "prompt", "invalid_type", "got null"),
    # parameters
    ('{"prompt": "a", "max_tokens": 0}', "max_tokens", "out_of_range", "between 1 and 131072, got 0"),
    ('{"prompt": "a", "max_tokens": 131073}', "max_tokens", "out_of_range", "between 1 and 131072"),
    ('{"prompt": "a", "max_tokens": 10.0}', "max_tokens", "invalid_type", "got a number (10.0)"),
    ('{"prompt": "a", "max_completion_tokens": "5"}', "max_completion_tokens", "invalid_type", "got a string"),
    ('{"prompt": "a", "max_tokens": 4, "max_completion_tokens": 5}', "max_tokens", "conflicting_fields", "only one"),
    ('{"prompt": "a", "temperature": 2.5}', "temperature", "out_of_range", "[0, 2], got 2.5"),
    ('{"prompt": "a", "temperature": "hot"}', "temperature", "invalid_type", "must be a number"),
    ('{"prompt": "a", "temperature": false}', "temperature", "invalid_type", "got a boolean (false)"),
    ('{"prompt": "a", "temperature": 1e400}', "temperature", "out_of_range", "finite"),
    ('{"prompt": "a", "top_p": 0}', "top_p", "out_of_range", "(0, 1]"),
    ('{"prompt": "a", "top_k": -1}', "top_k", "out_of_range", "between 0 and"),
    ('{"prompt": "a", "min_p": 1.5}', "min_p", "out_of_range", "[0, 1]"),
    ('{"prompt": "a", "seed": 1.5}', "seed", "invalid_type", "must be an integer"),
    ('{"prompt": "a", "repetition_penalty": 0}', "repetition_penalty", "out_of_range", "(0, 10]"),
    ('{"prompt": "a", "presence_penalty": -3}', "presence_penalty", "out_of_range", "[-2, 2]"),
    ('{"prompt": "a", "frequency_penalty": 3}', "frequency_penalty", "out_of_range", "[-2, 2]"),
    ('{"prompt": "a", "n": 65}', "n", "out_of_range", "between 1 and 64"),
    ('{"prompt": "a", "stop": 5}', "stop", "invalid_type", "a string or a list of strings"),
    ('{"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}', "stop", "out_of_range", "at most 4"),
    ('{"prompt": "a", "stop": ["a", null]}', "stop[1]", "invalid_type", "got null"),
    ('{"prompt": "a", "stop": ""}', "stop", "empty_value", "must not be empty"),
    (json.dumps({"prompt": "a", "stop": ["x" * 257]}), "stop[0]", "too_long", "limited to 256"),
    ('{"prompt": "a", "stream": true}', "stream", "unsupported_parameter", "set false"),
    ('{"prompt": "a", "model": ["m"]}', "model", "invalid_type", "must be a string"),
    ('{"prompt": "a", "tools": []}', "tools", "unsupported_parameter", "remove it. Supported: max_tokens"),
    ('{"prompt": "a", "maxtokens": 5}', "maxtokens", "unsupported_parameter", "did you mean 'max_tokens'?"),
    (chat(USER, logit_bias={"x": 1}), "body.logit_bias.x", "invalid_value", "token ids written as strings"),
    (
        chat(
            USER, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {"uniqueItems": True}}}
        ),
        "body.response_format.json_schema.schema.uniqueItems",
        "unsupported_schema",
        "uses 'uniqueItems'",
    ),
    (
        chat(USER, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": 1}}}),
        "body.response_format.json_schema.schema",
        "invalid_schema",
        "type must be a string",
    ),
]


@pytest.mark.parametrize(("text", "field", "code", "message"), ERRORS)
def test_each_error_names_field_and_code(text: str, field: str | None, code: str, message: str) -> None:
    err = error_of(text, line=7)
    assert (err.line, err.field, err.code) == (7, field, code), str(err)
    assert message in err.message, str(err)
    assert code in INPUT_ERROR_CODES


def test_errors_cover_every_parse_code() -> None:
    seen = {code for _, _, code, _ in ERRORS}
    from_files = {"invalid_encoding", "line_too_long", "duplicate_custom_id", "empty_file", "invalid_request"}
    from_files |= {"image_not_found", "image_too_large"}  # tests/test_image_parts.py, with real files
    from_files |= {"image_host_not_allowed"}  # tests/data/bad, with remote images on
    from_files |= {"image_rejected_by_processor"}  # tests/test_image_failures.py, tests/data/bad
    from_files |= {"dimensions_not_supported"}  # tests/test_embeddings_lines.py, with a local model folder
    assert seen | from_files == INPUT_ERROR_CODES


def test_error_keeps_custom_id_when_it_is_known() -> None:
    assert error_of(chat(USER, temperature=-1)).custom_id == "r1"
    assert error_of('{"custom_id": "s", "prompt": ""}').custom_id == "s"
    assert error_of('{"prompt": ""}').custom_id is None
    assert error_of('{"custom_id": 5, "prompt": "a"}').custom_id is None


def test_first_error_of_a_line_wins() -> None:
    err = error_of('{"prompt": "", "temperature": 9}')
    assert err.field == "prompt"


# ---- one line: valid requests and normalization -------------------------------------------------------


def test_openai_chat_line() -> None:
    req = parse_line(chat({"role": "system", "content": "Be brief."}, USER, max_tokens=9), 4)
    assert req == ParsedRequest(
        line=4,
        custom_id="r1",
        endpoint=CHAT_URL,
        body={"messages": [{"role": "system", "content": "Be brief."}, USER], "max_tokens": 9},
    )


def test_openai_completions_line_with_token_ids() -> None:
    req = parse_line(batch({"prompt": [1, 2, 3]}, url=COMPLETIONS_URL), 1)
    assert (req.endpoint, req.body) == (COMPLETIONS_URL, {"prompt": [1, 2, 3]})


def test_shorthand_defaults_custom_id_to_line_number() -> None:
    assert parse_line('{"prompt": "a"}', 12).custom_id == "12"
    assert parse_line('{"messages": [{"role": "user", "content": "a"}]}', 3).custom_id == "3"
    assert parse_line('{"custom_id": "mine", "prompt": "a"}', 12).custom_id == "mine"
    assert parse_line('{"prompt": "a"}', 1).endpoint == COMPLETIONS_URL
    assert parse_line('{"messages": [{"role": "user", "content": "a"}]}', 1).endpoint == CHAT_URL


def test_parameter_normalization() -> None:
    body = parse_line(
        '{"prompt": "a", "max_completion_tokens": 7, "stop": "END", "temperature": null, "top_p": null,'
        ' "model": "gpt-4o", "stream": false, "seed": 3}',
        1,
    ).body
    assert body == {"prompt": "a", "max_tokens": 7, "stop": ["END"], "seed": 3}


def test_equal_max_tokens_and_max_completion_tokens_agree() -> None:
    assert parse_line('{"prompt": "a", "max_tokens": 5, "max_completion_tokens": 5}', 1).body["max_tokens"] == 5


def test_null_model_and_stream_are_accepted() -> None:
    assert parse_line('{"prompt": "a", "model": null, "stream": null}', 1).body == {"prompt": "a"}


def test_content_parts_are_joined_and_assistant_prefill_may_be_empty() -> None:
    parts = {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]}
    body = parse_line(chat(parts, {"role": "assistant", "content": ""}), 1).body
    assert body["messages"] == [{"role": "user", "content": "Hello, world"}, {"role": "assistant", "content": ""}]


def test_every_supported_param_is_accepted() -> None:
    values = {
        "max_tokens": 5,
        "max_completion_tokens": 5,
        "temperature": 0,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "stop": ["\n"],
        "seed": 2**63 - 1,  # the largest seed (negative ones are refused: MLX seeds are unsigned)
        "repetition_penalty": 1.1,
        "presence_penalty": -2,
        "frequency_penalty": 2,
        "n": 64,
    }
    assert set(values) == set(SUPPORTED_PARAMS)
    body = parse_line(json.dumps({"prompt": "a", **values}), 1).body
    assert "max_completion_tokens" not in body
    assert body["temperature"] == 0.0 and isinstance(body["temperature"], float)
    assert body["top_k"] == 40 and body["n"] == 64


# ---- SamplingParams -------------------------------------------------------------------------------------


def test_sampling_params_defaults() -> None:
    assert SamplingParams.from_body({"prompt": "a"}) == SamplingParams()
    assert SamplingParams().max_tokens == DEFAULT_MAX_TOKENS


def test_sampling_params_from_parsed_body() -> None:
    body = parse_line(
        '{"prompt": "a", "max_completion_tokens": 9, "temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1,'
        ' "stop": "x", "seed": 4, "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5,'
        ' "n": 2}',
        1,
    ).body
    assert SamplingParams.from_body(body) == SamplingParams(
        max_tokens=9,
        temperature=0.0,
        top_p=0.5,
        top_k=3,
        min_p=0.1,
        stop=("x",),
        seed=4,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        n=2,
    )


def test_sampling_params_accepts_a_bare_stop_string() -> None:
    assert SamplingParams.from_body({"stop": "END"}).stop == ("END",)


# ---- InputError -----------------------------------------------------------------------------------------


def test_input_error_string_format() -> None:
    err = InputError(3, "must be in [0, 2], got 9", "body.temperature", "r1", "out_of_range")
    assert str(err) == "line 3 (custom_id 'r1'), field 'body.temperature': must be in [0, 2], got 9 [out_of_range]"
    assert str(InputError(5, "invalid JSON", code="invalid_json")) == "line 5: invalid JSON [invalid_json]"
    assert str(InputError(0, "the file holds no requests", code="empty_file")).startswith("file: ")
    assert err.to_dict() == {
        "line": 3,
        "field": "body.temperature",
        "custom_id": "r1",
        "code": "out_of_range",
        "message": "must be in [0, 2], got 9",
    }
    assert InputError(**err.to_dict()) == err


def test_invalid_line_carries_the_error() -> None:
    with pytest.raises(InvalidLine) as info:
        parse_line('{"prompt": 1}', 2)
    assert isinstance(info.value, ValueError)
    assert str(info.value) == str(info.value.error)


# ---- streams: duplicates ----------------------------------------------------------------------------------


def test_duplicate_custom_id_across_lines() -> None:
    items = stream(
        b'{"custom_id": "a", "prompt": "x"}\n{"custom_id": "b", "prompt": "x"}\n'
        b'{"custom_id": "a", "prompt": "y"}\n{"custom_id": "a", "prompt": "z"}\n'
    )
    assert [type(i).__name__ for i in items] == ["ParsedRequest", "ParsedRequest", "InputError", "InputError"]
    for err, line in zip(items[2:], (3, 4), strict=True):
        assert isinstance(err, InputError)
        assert (err.line, err.field, err.custom_id, err.code) == (line, "custom_id", "a", "duplicate_custom_id")
        assert "line 1 already uses it" in err.message


def test_duplicate_of_an_implicit_custom_id_explains_the_default() -> None:
    items = stream(b'{"prompt": "x"}\n{"custom_id": "1", "prompt": "y"}\n')
    assert isinstance(items[1], InputError)
    assert "takes its line number" in items[1].message


def test_duplicate_of_an_invalid_line_is_caught() -> None:
    items = stream(b'{"custom_id": "a", "prompt": ""}\n{"custom_id": "a", "prompt": "y"}\n')
    assert [i.code for i in items if isinstance(i, InputError)] == ["empty_value", "duplicate_custom_id"]


def test_distinct_ids_pass() -> None:
    items = stream(b'{"prompt": "x"}\n{"prompt": "y"}\n{"custom_id": "3b", "prompt": "z"}\n')
    assert [i.custom_id for i in items if isinstance(i, ParsedRequest)] == ["1", "2", "3b"]


# ---- streams: framing and encoding ------------------------------------------------------------------------


def test_bom_crlf_and_blank_lines() -> None:
    data = b'\xef\xbb\xbf{"prompt": "a"}\r\n\r\n  \t \r\n{"prompt": "b"}\r\n'
    assert list(iter_lines(io.BytesIO(data))) == [(1, '{"prompt": "a"}'), (4, '{"prompt": "b"}')]


def test_bom_after_joined_files_is_dropped() -> None:
    data = b'{"prompt": "a"}\n\xef\xbb\xbf{"prompt": "b"}'
    assert [text for _, text in iter_lines(io.BytesIO(data))] == ['{"prompt": "a"}', '{"prompt": "b"}']


def test_invalid_utf8_names_the_byte() -> None:
    [(line, err)] = list(iter_lines(io.BytesIO(b'\n{"prompt": "\xc3\x28"}\n')))
    assert isinstance(err, InputError)
    assert (line, err.line, err.code) == (2, 2, "invalid_encoding")
    assert "byte 0xc3 at offset 12" in err.message and "save the file as UTF-8" in err.message


def test_utf16_file_is_reported_once() -> None:
    data = '{"prompt": "a"}\n{"prompt": "b"}\n'.encode("utf-16")
    [(_, err)] = list(iter_lines(io.BytesIO(data)))
    assert isinstance(err, InputError) and "UTF-16" in err.message


def test_gzip_file_is_named() -> None:
    [(_, err)] = list(iter_lines(io.BytesIO(b"\x1f\x8b\x08\x00\xff")))
    assert isinstance(err, InputError) and "gzip" in err.message


class ReadRecorder(io.BytesIO):
    """Records the largest single read, to show an over-long line is never read whole."""

    largest = 0

    def readline(self, size: int | None = -1) -> bytes:  # type: ignore[override]
        chunk = super().readline(size)
        self.largest = max(self.largest, len(chunk))
        return chunk


def test_over_long_line_is_skipped_in_chunks() -> None:
    limit = 1000
    data = b'{"prompt": "a"}\n' + b"x" * 50_000 + b'\n{"prompt": "b"}\n'
    f = ReadRecorder(data)
    items = list(iter_lines(f, max_line_bytes=limit))
    assert [line for line, _ in items] == [1, 2, 3]
    err = items[1][1]
    assert isinstance(err, InputError)
    assert (err.code, err.line) == ("line_too_long", 2)
    assert "50,001 bytes" in err.message and "1,000 bytes" in err.message
    assert items[2][1] == '{"prompt": "b"}'


def test_over_long_line_reads_are_bounded() -> None:
    f = ReadRecorder(b"y" * (5 * 1024 * 1024))
    [(_, err)] = list(iter_lines(f, max_line_bytes=1024))
    assert isinstance(err, InputError) and err.code == "line_too_long"
    assert f.largest <= 1024 * 1024


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b""])
def test_line_of_exactly_the_limit_is_accepted(ending: bytes) -> None:
    line = b'{"prompt": "' + b"a" * (100 - 14) + b'"}'
    assert len(line) == 100
    [(_, text)] = list(iter_lines(io.BytesIO(line + ending), max_line_bytes=100))
    assert text == line.decode()
    [(_, err)] = list(iter_lines(io.BytesIO(b" " + line + ending), max_line_bytes=100))
    assert isinstance(err, InputError) and err.code == "line_too_long"


def test_stream_mixes_requests_and_errors_in_file_order() -> None:
    items = stream(b'{"prompt": "a"}\nnot json\n{"prompt": "b"}\n')
    assert [(type(i).__name__, i.line) for i in items] == [
        ("ParsedRequest", 1),
        ("InputError", 2),
        ("ParsedRequest", 3),
    ]


def test_empty_stream_yields_nothing() -> None:
    assert stream(b"") == []
    assert stream(b"\xef\xbb\xbf\n\n") == []


# ---- purity --------------------------------------------------------------------------------------------


def test_formats_imports_no_io_libraries() -> None:
    code = (
        "import sys, omlx_jobs.jobs.formats; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlx', 'mlx_lm', 'sqlalchemy', 'redis', 'rq'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_stored_tiny_temperature_is_read_as_greedy() -> None:
    """Rows stored before temperatures under 1e-5 became 0 at submit are read as greedy by the worker too."""
    from omlx_jobs.jobs.params import SamplingParams

    assert SamplingParams.from_body({"prompt": "x", "temperature": 1e-38}).temperature == 0.0
    assert SamplingParams.from_body({"prompt": "x", "temperature": 1e-5}).temperature == 1e-5
    assert SamplingParams.from_body({"prompt": "x"}).temperature == 1.0

"""Requests as the official `openai` client writes them: every field of its request types at its no-op default
is accepted by submit; each value we cannot honour is a line error naming the field; the new parameters
(response_format, logprobs, top_logprobs, echo, logit_bias) validate and normalize as documented.

Bodies are checked against the SDK's own TypedDicts with pydantic, so each one is a body the SDK can write.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Any, Literal, get_type_hints

import pydantic
import pytest
from openai.lib._parsing._completions import type_to_response_format_param
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from omlx_jobs.jobs.errors import InvalidLine
from omlx_jobs.jobs.formats import CHAT_URL, COMPLETIONS_URL, SamplingParams, parse_line
from omlx_jobs.jobs.params import OutputParams
from omlx_jobs.jobs.submit import load_job
from omlx_jobs.store import RequestStatus, open_store

CHAT_TYPE = chat_params.CompletionCreateParamsNonStreaming
COMPLETION_TYPE = completion_params.CompletionCreateParamsNonStreaming
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]

# Every field of the SDK's chat request type, at the value that asks for nothing beyond a plain completion.
CHAT_DEFAULTS: dict[str, Any] = {
    "messages": MESSAGES,
    "model": "gpt-4o-mini",
    "audio": None,
    "frequency_penalty": 0,
    "function_call": "none",
    "functions": [],
    "logit_bias": {},
    "logprobs": False,
    "max_completion_tokens": 16,
    "max_tokens": None,
    "metadata": {"experiment": "7"},
    "modalities": ["text"],
    "moderation": None,
    "n": 1,
    "parallel_tool_calls": True,
    "prediction": None,
    "presence_penalty": 0,
    "prompt_cache_key": "colours",
    "prompt_cache_options": {},
    "prompt_cache_retention": None,
    "reasoning_effort": None,
    "response_format": {"type": "text"},
    "safety_identifier": "user-hash",
    "seed": None,
    "service_tier": "auto",
    "stop": None,
    "store": False,
    "stream": False,
    "stream_options": None,
    "temperature": 1,
    "tool_choice": "none",
    "tools": [],
    "top_logprobs": None,
    "top_p": 1,
    "user": "user-1",
    "verbosity": None,
}
# Fields whose only no-op is to be left out: any value asks for something (web search, even with {}).
CHAT_ABSENT = {"web_search_options"}
COMPLETION_DEFAULTS: dict[str, Any] = {
    "prompt": "Once upon a time",
    "model": "gpt-3.5-turbo-instruct",
    "best_of": 1,
    "echo": False,
    "frequency_penalty": 0,
    "logit_bias": {},
    "logprobs": None,
    "max_tokens": 16,
    "n": 1,
    "presence_penalty": 0,
    "seed": None,
    "stop": None,
    "stream": False,
    "stream_options": None,
    "suffix": None,
    "temperature": 1,
    "top_p": 1,
    "user": "user-1",
}


def sdk_body(typed: Any, body: dict[str, Any]) -> dict[str, Any]:
    """The body, after checking with pydantic that it is an instance of the SDK's request TypedDict."""
    pydantic.TypeAdapter(typed).validate_python(body)
    return body


def batch_line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_the_defaults_cover_every_field_of_the_sdk_types() -> None:
    assert set(CHAT_DEFAULTS) | CHAT_ABSENT == set(get_type_hints(CHAT_TYPE)), "a field of the SDK is not covered"
    assert set(COMPLETION_DEFAULTS) == set(get_type_hints(COMPLETION_TYPE))


def test_a_file_with_every_default_is_accepted_by_submit(tmp_path: Path, sqlite_url: str) -> None:
    path = tmp_path / "sdk.jsonl"
    lines = [
        batch_line("chat", CHAT_URL, sdk_body(CHAT_TYPE, CHAT_DEFAULTS)),
        batch_line("completion", COMPLETIONS_URL, sdk_body(COMPLETION_TYPE, COMPLETION_DEFAULTS)),
        batch_line("chat-minimal", CHAT_URL, sdk_body(CHAT_TYPE, {"messages": MESSAGES, "model": "m"})),
    ]
    path.write_text("\n".join(lines) + "\n")
    store = open_store(url=sqlite_url)
    try:
        result = load_job(store, path, "tiny")
        assert not result.rejected and result.errors == [], [str(e) for e in result.errors]
        rows = list(store.iter_requests(result.job_id))
        assert [r.status for r in rows] == [RequestStatus.PENDING] * 3
        chat = rows[0].body
        # What changes nothing is not stored; what affects generation is.
        assert chat == {"messages": MESSAGES, "max_tokens": 16, "n": 1, "temperature": 1.0, "top_p": 1.0,
                        "presence_penalty": 0.0, "frequency_penalty": 0.0}  # fmt: skip
        assert OutputParams.from_body(chat) == OutputParams()
    finally:
        store.close()


# (field, value, code, part of the message): values the SDK can write that we cannot honour.
CHAT_REJECTED = [
    ("audio", {"voice": "alloy", "format": "wav"}, "unsupported_parameter", "audio output is not supported"),
    ("modalities", ["text", "audio"], "unsupported_parameter", "only text output"),
    ("prediction", {"type": "content", "content": "x"}, "unsupported_parameter", "predicted outputs"),
    ("service_tier", "flex", "unsupported_parameter", "same tier"),
    ("service_tier", "priority", "unsupported_parameter", "same tier"),
    ("store", True, "unsupported_parameter", "not stored for distillation"),
    ("stream", True, "unsupported_parameter", "streaming is not available"),
    ("stream_options", {"include_usage": True}, "unsupported_parameter", "only applies with stream: true"),
    ("tools", [{"type": "function", "function": {"name": "f g"}}], "invalid_value", "letters, digits"),
    ("tool_choice", "required", "conflicting_fields", "needs a non-empty tools list"),
    ("function_call", {"name": "f"}, "unsupported_parameter", "give tools and tool_choice"),
    ("functions", [{"name": "f"}], "unsupported_parameter", "give tools and tool_choice"),
    ("web_search_options", {}, "unsupported_parameter", "web search"),
    ("verbosity", "low", "unsupported_parameter", "max_tokens"),
    ("moderation", {"model": "omni-moderation-latest"}, "unsupported_parameter", "moderation"),
    ("n", 65, "out_of_range", "between 1 and 64"),
    ("logit_bias", {"50256": 101}, "out_of_range", "[-100, 100]"),
    ("top_logprobs", 21, "out_of_range", "between 0 and 20"),
    ("top_logprobs", 2, "conflicting_fields", "needs logprobs: true"),
    (
        "response_format",
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}},
        "unsupported_schema",
        "'not'",
    ),
]
COMPLETION_REJECTED = [
    ("best_of", 2, "unsupported_parameter", "ask for n choices"),
    ("suffix", "The end.", "unsupported_parameter", "text insertion"),
    ("logprobs", 6, "out_of_range", "between 0 and 5"),
    ("stream", True, "unsupported_parameter", "streaming is not available"),
    ("max_tokens", 0, "out_of_range", "only with echo: true"),
]


def _error(url: str, body: dict[str, Any]) -> Any:
    with pytest.raises(InvalidLine) as info:
        parse_line(batch_line("x", url, body), 3)
    return info.value.error


def _field_of(err: Any) -> str:
    return err.field.removeprefix("body.")


@pytest.mark.parametrize(("field", "value", "code", "message"), CHAT_REJECTED, ids=lambda v: str(v)[:30])
def test_each_chat_value_we_cannot_honour_is_a_named_error(field: str, value: Any, code: str, message: str) -> None:
    body = {**CHAT_DEFAULTS, field: value}
    if field != "stream":  # the streaming TypedDict is another type
        sdk_body(CHAT_TYPE, body)
    err = _error(CHAT_URL, body)
    assert (err.line, err.code) == (3, code), str(err)
    assert _field_of(err).startswith(field) and message in err.message, str(err)


def test_malformed_no_op_fields_are_errors_too() -> None:
    err = _error(CHAT_URL, {**CHAT_DEFAULTS, "metadata": {"k": 1}})
    assert (err.field, err.code) == ("body.metadata.k", "invalid_type")
    err = _error(CHAT_URL, {**CHAT_DEFAULTS, "user": 5})
    assert (err.field, err.code) == ("body.user", "invalid_type")
    err = _error(CHAT_URL, {**CHAT_DEFAULTS, "parallel_tool_calls": "yes"})
    assert (err.field, err.code) == ("body.parallel_tool_calls", "invalid_type")


@pytest.mark.parametrize(("field", "value", "code", "message"), COMPLETION_REJECTED, ids=lambda v: str(v)[:30])
def test_each_completion_value_we_cannot_honour_is_a_named_error(
    field: str, value: Any, code: str, message: str
) -> None:
    body = {**COMPLETION_DEFAULTS, field: value}
    if field != "stream":
        sdk_body(COMPLETION_TYPE, body)
    err = _error(COMPLETIONS_URL, body)
    assert (err.code, _field_of(err)) == (code, field) and message in err.message, str(err)


@pytest.mark.parametrize(
    ("url", "field", "value"),
    [
        (CHAT_URL, "logprobs", True),
        (CHAT_URL, "logit_bias", {"5": 1}),
        (CHAT_URL, "response_format", {"type": "json_object"}),
        (COMPLETIONS_URL, "echo", True),
        (COMPLETIONS_URL, "logprobs", 2),
    ],
)
def test_the_new_features_are_accepted_now_that_the_engine_runs_them(url: str, field: str, value: Any) -> None:
    base = CHAT_DEFAULTS if url == CHAT_URL else COMPLETION_DEFAULTS
    line = parse_line(batch_line("x", url, {**base, field: value}), 1)
    assert line.body is not None and field in line.body, line


def _body(url: str, **kw: Any) -> dict[str, Any]:
    base = {"messages": MESSAGES} if url == CHAT_URL else {"prompt": "Q: 2+2? A:"}
    return parse_line(batch_line("x", url, {**base, **kw}), 1).body


def test_chat_logprobs_normalize() -> None:
    body = _body(CHAT_URL, logprobs=True, top_logprobs=3)
    assert (body["logprobs"], body["top_logprobs"]) == (True, 3)
    assert OutputParams.from_body(body) == OutputParams(logprobs=True, top_logprobs=3)
    assert "top_logprobs" not in _body(CHAT_URL, logprobs=True, top_logprobs=0)
    assert _error(CHAT_URL, {"messages": MESSAGES, "logprobs": 3}).code == "invalid_type"


def test_completion_logprobs_echo_and_scoring_only() -> None:
    body = _body(COMPLETIONS_URL, logprobs=0, echo=True, max_tokens=0)
    assert OutputParams.from_body(body) == OutputParams(logprobs=True, top_logprobs=0, echo=True)
    assert SamplingParams.from_body(body).max_tokens == 0, "max_tokens 0 with echo scores only"
    assert OutputParams.from_body(_body(COMPLETIONS_URL, logprobs=5)).top_logprobs == 5
    assert OutputParams.from_body(_body(COMPLETIONS_URL, logprobs=False)) == OutputParams()
    assert _error(COMPLETIONS_URL, {"prompt": "a", "logprobs": True}).code == "invalid_type"
    err = _error(CHAT_URL, {"messages": MESSAGES, "echo": True})
    assert err.code == "unsupported_parameter" and "/v1/completions" in err.message


def test_logit_bias_normalizes_ids_and_checks_values() -> None:
    body = _body(CHAT_URL, logit_bias={"007": 5, "50256": -100})
    assert body["logit_bias"] == {"7": 5.0, "50256": -100.0}
    assert OutputParams.from_body(body).logit_bias == ((7, 5.0), (50256, -100.0))
    assert "logit_bias" not in _body(CHAT_URL, logit_bias={})
    for bad, code in (({"-1": 1}, "invalid_value"), ({"1.5": 1}, "invalid_value"), ({"1": "x"}, "invalid_type"),
                      ({"1": float("nan")}, "invalid_json"), ([1], "invalid_type"),
                      ({"7": 1, "007": 2}, "invalid_value")):  # fmt: skip
        line = json.dumps({"messages": MESSAGES, "logit_bias": bad})  # NaN: written as the bare word
        with pytest.raises(InvalidLine) as info:
            parse_line(line, 1)
        assert info.value.error.code == code, (bad, str(info.value.error))


class Kind(str, enum.Enum):
    person = "person"
    place = "place"


class Entity(pydantic.BaseModel):
    text: str
    kind: Kind


class Extraction(pydantic.BaseModel):
    title: str | None
    entities: list[Entity]
    score: float
    language: Literal["en", "de"]


def test_the_response_format_the_sdk_writes_for_a_pydantic_model_is_accepted() -> None:
    """client.chat.completions.parse(response_format=Model) sends this; it must validate and compile."""
    rf = type_to_response_format_param(Extraction)
    body = _body(CHAT_URL, **sdk_body(CHAT_TYPE, {"messages": MESSAGES, "model": "m", "response_format": rf}))
    fmt = OutputParams.from_body(body).response_format
    assert fmt is not None and fmt.kind == "json_schema" and fmt.name == "Extraction"
    assert json.loads(fmt.schema_json) == rf["json_schema"]["schema"]  # type: ignore[index]
    assert list(json.loads(fmt.schema_json)["properties"]) == ["title", "entities", "score", "language"], "key order"
    assert body["response_format"]["json_schema"]["strict"] is True


def test_response_format_rules() -> None:
    assert "response_format" not in _body(CHAT_URL, response_format={"type": "text"})
    assert _body(CHAT_URL, response_format={"type": "json_object"})["response_format"] == {"type": "json_object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    loose = _body(CHAT_URL, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert loose["response_format"]["json_schema"]["strict"] is False, "strict: false is enforced in full anyway"
    where = "body.response_format.json_schema"

    def js(**spec: Any) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": spec}

    unique = {"$defs": {"x": {"type": "array", "uniqueItems": True}}, "$ref": "#/$defs/x"}
    cases = [
        ({"type": "json_object", "json_schema": {}}, where, "unknown_field"),
        ({"type": "json_schema"}, where, "missing_field"),
        (js(schema=schema), f"{where}.name", "missing_field"),
        (js(name="a b", schema=schema), f"{where}.name", "invalid_value"),
        (js(name="a", schema=[schema]), f"{where}.schema", "invalid_type"),
        (js(name="a", schema=schema, strict="yes"), f"{where}.strict", "invalid_type"),
        (js(name="a", schema={"type": "string", "format": "isbn"}), f"{where}.schema.format", "unsupported_schema"),
        (js(name="a", schema={"type": "integer", "minimum": 5, "maximum": 1}), f"{where}.schema", "invalid_schema"),
        (js(name="a", schema=unique), f"{where}.schema.$defs.x.uniqueItems", "unsupported_schema"),
        (
            js(name="a", schema={"properties": {"p": {"pattern": "(("}}}),
            f"{where}.schema.properties.p.pattern",
            "invalid_schema",
        ),
    ]
    for rf, field, code in cases:
        err = _error(CHAT_URL, {"messages": MESSAGES, "response_format": rf})
        assert (err.field, err.code) == (field, code), str(err)
    assert "unclosed group" in err.message, "the regex error says what is wrong, not only 'regex parse error:'"
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    err = _error(CHAT_URL, {"messages": MESSAGES, "response_format": js(name="a", schema=deep)})
    assert (err.field, err.code) == (f"{where}.schema", "invalid_schema") and "nest it less deeply" in err.message
    err = _error(CHAT_URL, {"messages": MESSAGES, "response_format": {"type": "json_object"}, "stop": ["}"]})
    assert (err.field, err.code) == ("body.stop", "conflicting_fields") and "cut the JSON" in err.message
    err = _error(COMPLETIONS_URL, {"prompt": "a", "response_format": {"type": "json_object"}})
    assert err.code == "unsupported_parameter" and "/v1/chat/completions parameter" in err.message

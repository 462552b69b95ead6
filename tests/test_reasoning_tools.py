"""Reasoning and tool calls through the engine, the store and the output lines, on tiny random models that carry
real chat templates (tests/chat_templates.py: a Qwen3-style one with <think> and <tool_call>, a template that
opens the thinking in its generation prompt, a Llama-3-style one).

- tool_choice required: 100 of 100 calls at temperature 1 parse and their arguments validate (jsonschema), on the
  Qwen3-style and the Llama-3-style template; a named function is always the one called; parallel_tool_calls
  false gives one call; finish_reason is tool_calls;
- a thinking budget of 8 forces the close sequence right after the 8th thinking token, exactly, and the answer
  follows; reasoning_tokens counts the thinking; a cut inside the thinking is length with empty content;
- reasoning_effort none renders the template's no-thinking form; chat_template_kwargs the template does not read
  fail that request alone; tools on a template without tool markup fail alone (tools_not_supported);
- every output body validates as the openai client's ChatCompletion (reasoning_content as an extra field).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from chat_templates import llama3_model, opened_model, qwen3_model
from openai.types.chat import ChatCompletion

from omlx_jobs.jobs.formats import SamplingParams
from omlx_jobs.jobs.output import OUTPUT_COLUMNS, output_lines
from omlx_jobs.jobs.submit import load_job
from omlx_jobs.store import Store, open_store
from omlx_jobs.worker.engine.config import EngineConfig
from omlx_jobs.worker.engine.loop import Engine
from omlx_jobs.worker.engine.sequence import WorkItem
from omlx_jobs.worker.models.loaded import LoadedModel, load_text
from omlx_jobs.worker.runtime.shard import run_shard

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    root = tmp_path_factory.mktemp("families")
    built = {"qwen3": qwen3_model(root / "q"), "opened": opened_model(root / "o"), "llama3": llama3_model(root / "l")}
    return {name: load_text(name, path) for name, path in built.items()}


@pytest.fixture
def store(sqlite_url: str) -> Any:
    s = open_store(url=sqlite_url)
    yield s
    s.close()


def _run(store: Store, loaded: LoadedModel, tmp_path: Path, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Submit one line per body, run the job on `loaded`, and return its output lines in order."""
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "in.jsonl"
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": b})
             for i, b in enumerate(bodies)]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    result = load_job(store, path, "tiny")
    assert not result.rejected, [str(e) for e in result.errors]
    run_shard(store, Engine(loaded, EngineConfig(completion_batch_size=32)), result.job_id)
    rows = list(store.iter_requests(result.job_id, columns=OUTPUT_COLUMNS))
    out = [json.loads(text) for text, _ in output_lines(rows, result.job_id, "tiny")]
    return sorted(out, key=lambda o: int(o["custom_id"][1:]))


def _bodies(out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    bodies = [o["response"]["body"] for o in out]
    for b in bodies:
        ChatCompletion.model_validate(b)
    return bodies


def _calls(body: dict[str, Any]) -> list[dict[str, Any]]:
    return body["choices"][0]["message"].get("tool_calls") or []


def _assert_valid_calls(body: dict[str, Any], names: set[str]) -> None:
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    for call in _calls(body):
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_required_calls_always_parse_and_validate(
    family: str, models: dict[str, LoadedModel], store: Store, tmp_path: Path
) -> None:
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "max_tokens": 160,
            "reasoning_effort": "none"}  # fmt: skip
    bodies = _bodies(_run(store, models[family], tmp_path, [{**body, "seed": i} for i in range(100)]))
    assert len(bodies) == 100
    for b in bodies:
        assert _calls(b), b["choices"][0]
        _assert_valid_calls(b, set(SCHEMAS))


def test_a_named_function_is_always_the_one_called_and_parallel_false_gives_one(
    models: dict[str, LoadedModel], store: Store, tmp_path: Path
) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    base = {"messages": ASK, "tools": TOOLS, "temperature": 1.0, "max_tokens": 96, "reasoning_effort": "none"}
    bodies = _bodies(
        _run(
            store,
            models["qwen3"],
            tmp_path,
            [{**base, "tool_choice": named, "seed": i} for i in range(20)]
            + [{**base, "tool_choice": "required", "parallel_tool_calls": False, "seed": i} for i in range(20)],
        )
    )
    for b in bodies[:20]:
        assert [c["function"]["name"] for c in _calls(b)] == ["get_time"]
        _assert_valid_calls(b, {"get_time"})
    for b in bodies[20:]:
        assert len(_calls(b)) == 1
        _assert_valid_calls(b, set(SCHEMAS))


def test_a_thinking_budget_forces_the_close_sequence_after_8_thinking_tokens(
    models: dict[str, LoadedModel], store: Store, tmp_path: Path
) -> None:
    """The template opens the thinking block; the budget closes it after exactly 8 of the model's tokens."""
    loaded = models["opened"]
    markers = loaded.chat.markers
    assert markers is not None
    body = {"messages": ASK, "thinking_token_budget": 8, "max_tokens": 24, "temperature": 1.0}
    out = _run(store, loaded, tmp_path, [{**body, "seed": i} for i in range(8)])
    for b in _bodies(out):
        choice, usage = b["choices"][0], b["usage"]
        thinking = choice["message"]["reasoning_content"]
        close = list(markers.close_sequence)
        assert usage["completion_tokens_details"]["reasoning_tokens"] == 8 + close.index(markers.close_id) + 1
        thought_ids = loaded.tokenizer.encode(thinking, add_special_tokens=False)
        assert markers.close_id not in thought_ids
        # The answer follows the forced close (unless the model ended right there).
        assert isinstance(choice["message"]["content"], str)
        assert usage["completion_tokens"] > usage["completion_tokens_details"]["reasoning_tokens"] or (
            choice["finish_reason"] == "stop"
        )


def test_the_forced_run_is_exact_token_by_token(models: dict[str, LoadedModel]) -> None:
    """The tokens after the 8th thinking token are the close sequence, whatever the sampler."""
    loaded = models["opened"]
    markers = loaded.chat.markers
    assert markers is not None
    body = {"messages": ASK, "thinking_token_budget": 8}
    tokens = loaded.encode("/v1/chat/completions", body)
    plan = loaded.chat_plan("/v1/chat/completions", body, tokens)
    assert plan is not None and plan.opened
    items = [WorkItem(i, tokens, SamplingParams(max_tokens=20, temperature=1.0, seed=i), chat=plan) for i in range(16)]
    results: list[Any] = []
    Engine(loaded, EngineConfig(completion_batch_size=8)).run(items, results.extend)
    for r in results:
        ids = r.choices[0].token_ids
        assert ids[8 : 8 + len(markers.close_sequence)] == list(markers.close_sequence), ids
        assert markers.close_id not in ids[:8]


def test_a_cut_inside_the_thinking_is_length_with_empty_content(
    models: dict[str, LoadedModel], store: Store, tmp_path: Path
) -> None:
    (b,) = _bodies(_run(store, models["opened"], tmp_path, [{"messages": ASK, "max_tokens": 6, "temperature": 0}]))
    choice = b["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == "" and choice["message"]["reasoning_content"]
    assert b["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6


def test_reasoning_effort_none_renders_the_no_thinking_form(models: dict[str, LoadedModel]) -> None:
    loaded = models["qwen3"]
    on = loaded.tokenizer.decode(loaded.encode("/v1/chat/completions", {"messages": ASK}))
    off = loaded.tokenizer.decode(loaded.encode("/v1/chat/completions", {"messages": ASK, "reasoning_effort": "none"}))
    assert off == on + "<think>\n\n</think>\n\n"
    kw = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    assert loaded.tokenizer.decode(loaded.encode("/v1/chat/completions", kw)) == off


def test_bad_template_kwargs_and_tools_without_markup_fail_alone(
    models: dict[str, LoadedModel], tiny_loaded: LoadedModel, store: Store, tmp_path: Path
) -> None:
    out = _run(
        store,
        models["qwen3"],
        tmp_path,
        [{"messages": ASK, "max_tokens": 2}, {"messages": ASK, "max_tokens": 2, "chat_template_kwargs": {"x": 1}}],
    )
    assert out[0]["response"]["status_code"] == 200
    err = out[1]["response"]["body"]["error"]
    assert err["code"] == "chat_template_error" and "chat_template_kwargs.x" in err["message"]
    (plain,) = _run(store, tiny_loaded, tmp_path / "p", [{"messages": ASK, "tools": TOOLS, "max_tokens": 2}])
    assert plain["response"]["body"]["error"]["code"] == "tools_not_supported"


def test_tool_history_is_rendered_by_the_template(models: dict[str, LoadedModel]) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    for name, shown in (("qwen3", '{"name": "get_weather", "arguments": {"city": "Oslo"}}'),
                        ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"}}')):  # fmt: skip
        loaded = models[name]
        text = loaded.tokenizer.decode(loaded.encode("/v1/chat/completions", {"messages": messages, "tools": TOOLS}))
        assert shown in text and "sunny" in text and '"get_time"' in text


def test_response_format_applies_to_the_answer_after_the_thinking(
    models: dict[str, LoadedModel], store: Store, tmp_path: Path
) -> None:
    """The model thinks freely (a budget of 6 closes it), then the JSON answer follows its schema."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    body = {"messages": ASK, "response_format": rf, "thinking_token_budget": 6, "max_tokens": 40, "temperature": 1.0}
    for b in _bodies(_run(store, models["opened"], tmp_path, [{**body, "seed": i} for i in range(10)])):
        message = b["choices"][0]["message"]
        assert message["reasoning_content"] is not None
        if b["choices"][0]["finish_reason"] == "stop":
            jsonschema.validate(json.loads(message["content"]), schema)


def test_a_shared_tool_list_is_a_cached_prefix(models: dict[str, LoadedModel], store: Store, tmp_path: Path) -> None:
    many = [
        {"type": "function", "function": {"name": f"tool_{i}", "description": f"Tool number {i}.", "parameters": TIME}}
        for i in range(20)
    ]
    bodies = [{"messages": [{"role": "user", "content": f"Question {i}?"}], "tools": many, "max_tokens": 2}
              for i in range(24)]  # fmt: skip
    loaded = models["qwen3"]
    system = len(loaded.encode("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}], "tools": many}))
    out = [b["usage"] for b in _bodies(_run(store, loaded, tmp_path, bodies))]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in out)
    assert all(u["prompt_tokens_details"]["cached_tokens"] >= system - 16 for u in out[1:]), out
    assert cached / sum(u["prompt_tokens"] for u in out) > 0.9


def test_strict_tools_under_auto_give_valid_calls_or_an_answer(
    models: dict[str, LoadedModel], store: Store, tmp_path: Path
) -> None:
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    body = {"messages": ASK, "tools": strict, "temperature": 1.0, "max_tokens": 96, "reasoning_effort": "none"}
    bodies = _bodies(_run(store, models["qwen3"], tmp_path, [{**body, "seed": i} for i in range(20)]))
    for b in bodies:
        choice = b["choices"][0]
        if choice["finish_reason"] == "tool_calls":
            _assert_valid_calls(b, set(SCHEMAS))
        else:  # an answer: the grammar let it start with anything but a call
            assert not _calls(b) and not choice["message"]["content"].startswith("<tool_call>")


def test_required_calls_after_thinking_validate_too(
    models: dict[str, LoadedModel], store: Store, tmp_path: Path
) -> None:
    """Thinking on: the model may open <think> at its first token; the budget closes it, then the call grammar
    applies (gated on the thinking), and the call still validates."""
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "max_tokens": 120,
            "thinking_token_budget": 4}  # fmt: skip
    bodies = _bodies(_run(store, models["qwen3"], tmp_path, [{**body, "seed": i} for i in range(30)]))
    thought = 0
    for b in bodies:
        message = b["choices"][0]["message"]
        thought += message.get("reasoning_content") is not None
        _assert_valid_calls(b, set(SCHEMAS))
        assert _calls(b) and "<think>" not in (message["content"] or "")
    assert thought, "some outputs opened the thinking block"

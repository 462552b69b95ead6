"""The pure parts of reasoning and tool calls, without a model: each family's parser on recorded outputs of its
markup (well-formed, several calls, and malformed ones, which stay text), each family's call grammar on a byte
vocabulary, the family told from templates, the thinking split and its token count, the budget tracker's forced
run, and tool validation at submit.
"""

from __future__ import annotations

import json

import llguidance
import pytest
from chat_templates import LLAMA3_TEMPLATE, OPENED_TEMPLATE, QWEN3_TEMPLATE

from omlx_jobs.jobs.errors import InvalidLine
from omlx_jobs.jobs.formats import parse_line
from omlx_jobs.jobs.response_format import _byte_tokenizer
from omlx_jobs.worker.reasoning.budget import Phase, ThinkTracker
from omlx_jobs.worker.reasoning.markers import ThinkMarkers
from omlx_jobs.worker.reasoning.split import split_output, split_text
from omlx_jobs.worker.tools.families import ToolFamily, tool_family
from omlx_jobs.worker.tools.grammar import call_grammar
from omlx_jobs.worker.tools.parsers import Call, parse_calls

FUNCTIONS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                          "days": {"type": "integer"}}}},
    {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
]  # fmt: skip
PARIS = Call("get_weather", '{"city": "Paris"}')
OSLO = Call("get_weather", '{"city": "Oslo", "days": 3}')

# (family, recorded output, expected content, expected calls)
RECORDED = [
    # Qwen3 / Hermes
    (ToolFamily.HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
     [PARIS]),
    (ToolFamily.HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>',
     "Let me check.", [PARIS, OSLO]),
    (ToolFamily.HERMES, '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>',
     "", [PARIS]),  # arguments as a JSON string, as some fine-tunes write them
    (ToolFamily.HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>', []),  # broken JSON: text
    (ToolFamily.HERMES, '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', []),  # not one of the tools
    (ToolFamily.HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', []),  # cut before its close
    # Qwen3-Coder XML
    (ToolFamily.QWEN3_CODER, "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "", [OSLO]),
    (ToolFamily.QWEN3_CODER, "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n"
     "</function>\n</tool_call>", "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n"
     "</function>\n</tool_call>", []),  # an integer parameter that is not a number
    # Llama 3.x JSON
    (ToolFamily.LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
    (ToolFamily.LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}', "", [PARIS, OSLO]),
    (ToolFamily.LLAMA3, "The weather is fine.", "The weather is fine.", []),
    (ToolFamily.LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}; {"oops"',
     '{"name": "get_weather", "parameters": {"city": "Paris"}; {"oops"', []),
    # Mistral
    (ToolFamily.MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}]', "", [PARIS, OSLO]),
    (ToolFamily.MISTRAL, 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "Sure.", [PARIS]),
    (ToolFamily.MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}',
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}', []),
]  # fmt: skip


@pytest.mark.parametrize(("family", "text", "content", "calls"), RECORDED, ids=lambda v: str(v)[:24])
def test_each_family_parses_its_recorded_outputs(
    family: ToolFamily, text: str, content: str, calls: list[Call]
) -> None:
    parsed = parse_calls(family, text, FUNCTIONS)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        (c.name, json.loads(c.arguments)) for c in calls
    ]


def test_the_family_is_told_from_the_template() -> None:
    assert tool_family(QWEN3_TEMPLATE) is ToolFamily.HERMES
    assert tool_family(LLAMA3_TEMPLATE) is ToolFamily.LLAMA3
    assert tool_family(OPENED_TEMPLATE) is None  # renders no tools
    assert tool_family("{% for t in tools %}<tool_call><function=x>{% endfor %}") is ToolFamily.QWEN3_CODER
    assert tool_family("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]") is ToolFamily.MISTRAL


MARKERS = ThinkMarkers(open_id=1, close_id=2, close_sequence=(9, 2, 9, 9), switch=True)


def test_the_split_keeps_thinking_and_answer_apart() -> None:
    assert split_text("<think>\nhm\n</think>\n\nParis.", opened=False) == ("hm", "Paris.")
    assert split_text("hm\n</think>\n\nParis.", opened=True) == ("hm", "Paris.")  # opened by the prompt
    assert split_text("Paris.", opened=False) == (None, "Paris.")
    assert split_text("<think>\nstill thinking", opened=False) == ("still thinking", "")  # cut: no answer
    s = split_output("<think>a b</think>\n\nc", [1, 5, 6, 2, 9, 7], MARKERS, opened=False)
    assert (s.reasoning, s.content, s.reasoning_tokens) == ("a b", "c", 4)
    assert split_output("a b", [5, 6, 7], MARKERS, opened=True).reasoning_tokens == 3


def _drive(tracker: ThinkTracker, free: list[int], steps: int) -> list[int]:
    """Feed `steps` tokens: the forced one where due, else the next of `free`."""
    out, it = [], iter(free)
    for _ in range(steps):
        token = tracker.next_forced()
        token = next(it) if token is None else token
        tracker.feed(token)
        out.append(token)
    return out


def test_the_budget_forces_the_close_sequence_after_n_thinking_tokens() -> None:
    tracker = ThinkTracker(MARKERS, opened=True, budget=3, tail=False)
    assert _drive(tracker, [5, 6, 7, 8, 8, 8], 9) == [5, 6, 7, 9, 2, 9, 9, 8, 8]
    assert tracker.in_answer and tracker.answer_from == 7 and tracker.forced == 4 and tracker.thought == 3
    maybe = ThinkTracker(MARKERS, opened=False, budget=0)  # the model opens the block itself; budget 0
    assert _drive(maybe, [1, 5], 5) == [1, 9, 2, 9, 9] and maybe.in_answer
    plain = ThinkTracker(MARKERS, opened=False, budget=2)
    assert _drive(plain, [5, 6, 7], 3) == [5, 6, 7] and plain.answer_from == 0  # it did not think
    natural = ThinkTracker(MARKERS, opened=True, budget=None, tail=True)  # a natural close, then the tail
    assert _drive(natural, [5, 2, 7], 5) == [5, 2, 9, 9, 7] and natural.answer_from == 4
    off = ThinkTracker(MARKERS, opened=False, budget=None, thinks=False)
    assert off.phase is Phase.ANSWER and off.answer_from == 0


def _error(body: dict[str, object]) -> tuple[str | None, str]:
    with pytest.raises(InvalidLine) as info:
        parse_line(json.dumps(body), 1)
    return info.value.error.field, info.value.error.code.value


ASK = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": FUNCTIONS[0]["parameters"]}}]


def test_tool_and_reasoning_fields_validate_at_submit() -> None:
    body = parse_line(
        json.dumps({"messages": ASK, "tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False,
                    "reasoning_effort": "none", "thinking_token_budget": 8}), 1
    ).body  # fmt: skip
    assert body["tools"] == TOOLS and "tool_choice" not in body and body["parallel_tool_calls"] is False
    assert body["reasoning_effort"] == "none" and body["thinking_token_budget"] == 8
    rf = {"type": "json_object"}
    assert _error({"messages": ASK, "tools": TOOLS, "response_format": rf}) == ("response_format", "conflicting_fields")
    assert _error({"messages": ASK, "tool_choice": "required"}) == ("tool_choice", "conflicting_fields")
    named = {"type": "function", "function": {"name": "nope"}}
    assert _error({"messages": ASK, "tools": TOOLS, "tool_choice": named}) == (
        "tool_choice.function.name",
        "invalid_value",
    )
    assert _error({"messages": ASK, "max_reasoning_tokens": 8}) == ("max_reasoning_tokens", "unsupported_parameter")
    assert _error({"messages": ASK, "thinking_token_budget": -1}) == ("thinking_token_budget", "out_of_range")
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]
    assert _error({"messages": ASK, "tools": bad_schema})[1] == "unsupported_schema"
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}],
        },
    ]
    assert _error({"messages": history}) == ("messages[1].tool_calls[0].function.arguments", "invalid_value")


# (family, a call the grammar must accept, one it must refuse); markers written as text (a byte vocabulary).
GRAMMAR_CASES = [
    (ToolFamily.HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city":7}}\n</tool_call>'),
    (ToolFamily.LLAMA3, '{"name": "get_time", "parameters": {"zone":"UTC"}}',
     '{"name": "launch", "parameters": {}}'),
    (ToolFamily.MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city":"Oslo","days":3}}]',
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"days":"3"}}]'),
]  # fmt: skip


@pytest.mark.parametrize(("family", "good", "bad"), GRAMMAR_CASES, ids=lambda v: str(v)[:16])
def test_each_family_grammar_accepts_a_valid_call_and_refuses_a_bad_one(
    family: ToolFamily, good: str, bad: str
) -> None:
    grammar = call_grammar(family, FUNCTIONS, parallel=True, required=True, marker_ids={}).grammar()

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()

    assert accepts(good) and not accepts(bad)
    one = call_grammar(family, FUNCTIONS[:1], parallel=False, required=False, marker_ids={}).grammar()
    assert llguidance.LLMatcher(_byte_tokenizer(), one, log_level=0).is_error() is False

"""What a chat request's output needs beyond decoding: its thinking split from its answer, its thinking budget,
its tool calls (parsed, or constrained by a grammar), as one plan per request.

`ChatModel` is what a loaded model's chat template says, found once: its think markers, its tool-call family, the
variables it reads. `ChatModel.render_kwargs` gives the template render its tools, `enable_thinking` and the
request's chat_template_kwargs; `ChatModel.plan` the request's `ChatPlan`, which the engine asks at admission
(`attach`: the budget's processor, the gate of an answer grammar) and at the end (`finish`: the message).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import jinja2
from jinja2 import meta

from omlx_jobs.errors import ErrorCode, FinishReason
from omlx_jobs.jobs.params import OutputParams
from omlx_jobs.jobs.reasoning import ReasoningRequest
from omlx_jobs.jobs.tools import ToolRequest
from omlx_jobs.worker.prompts import PromptError
from omlx_jobs.worker.reasoning.budget import ForceThinking, ThinkTracker
from omlx_jobs.worker.reasoning.markers import ThinkMarkers, chat_template, single_token
from omlx_jobs.worker.reasoning.split import split_output
from omlx_jobs.worker.tools.families import ToolFamily, tool_family
from omlx_jobs.worker.tools.grammar import MARKUP, ToolGrammar, call_grammar
from omlx_jobs.worker.tools.parsers import parse_calls

CALLS = FinishReason.TOOL_CALLS.value
"""The message field of a history's calls and of the stored calls: OpenAI names it as the finish reason."""
TOOL_MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>")


def template_variables(template: str) -> frozenset[str] | None:
    """The variables a template reads (None if it does not parse here: then any kwarg is let through)."""
    try:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return frozenset(meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError:
        return None


def _history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: a call's arguments as an object (HF's convention), not a string."""
    out = []
    for m in messages:
        if CALLS in m:
            calls = [
                {**c, "function": {**c["function"], "arguments": _object(c["function"]["arguments"])}} for c in m[CALLS]
            ]
            m = {**m, CALLS: calls}
        out.append(m)
    return out


def _object(arguments: str) -> Any:
    return json.loads(arguments)  # validated at submit (jobs/tools.py)


@dataclass(frozen=True)
class ChatModel:
    """What a model's chat template says about thinking and tools, found once per loaded model."""

    markers: ThinkMarkers | None
    family: ToolFamily | None
    variables: frozenset[str] | None
    marker_ids: dict[str, int]

    @classmethod
    def of(cls, tokenizer: Any) -> ChatModel:
        template = chat_template(tokenizer)
        ids = {m: t for m in TOOL_MARKERS if m in template and (t := single_token(tokenizer, m)) is not None}
        return cls(ThinkMarkers.find(tokenizer), tool_family(template), template_variables(template), ids)

    def render_kwargs(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The messages and the keyword arguments of the template render; PromptError for what it cannot take."""
        kwargs: dict[str, Any] = {}
        for key, value in dict(body.get("chat_template_kwargs") or {}).items():
            if self.variables is not None and key not in self.variables:
                raise PromptError(
                    ErrorCode.CHAT_TEMPLATE_ERROR,
                    f"chat_template_kwargs.{key} is not a variable of this model's chat template; remove it",
                )
            kwargs[key] = value
        tools = ToolRequest.from_body(body)
        if body.get("tools"):
            if tools is not None and self.family is None:
                raise PromptError(
                    ErrorCode.TOOLS_NOT_SUPPORTED,
                    "this model's chat template writes no tool-call markup we can parse (hermes/Qwen3, "
                    "Qwen3-Coder, Llama 3, Mistral); remove tools, or set tool_choice none",
                )
            kwargs["tools"] = body["tools"]
        if ReasoningRequest.from_body(body).thinking is False and self.markers is not None and self.markers.switch:
            kwargs["enable_thinking"] = False
        return _history(body["messages"]), kwargs

    def plan(self, body: dict[str, Any], prompt: Sequence[int]) -> ChatPlan | None:
        """The request's plan, or None when its output is a plain answer (no thinking, no tools)."""
        tools, reasoning = ToolRequest.from_body(body), ReasoningRequest.from_body(body)
        if self.markers is None and tools is None:
            return None
        budget, thinks = reasoning.budget, True
        if self.markers is not None and reasoning.thinking is False:
            if self.markers.switch:
                thinks = False  # the template rendered its no-thinking form
            else:
                budget = 0  # no switch: the thinking is closed at once instead
        grammar = self._grammar(tools) if tools is not None and tools.constrained else None
        opened = self.markers.opens_thinking(prompt) if self.markers is not None and thinks else False
        return ChatPlan(self, tools, grammar, opened=opened, thinks=thinks and self.markers is not None, budget=budget)

    def _grammar(self, tools: ToolRequest) -> ToolGrammar:
        if self.family not in MARKUP:
            raise PromptError(
                ErrorCode.TOOLS_NOT_SUPPORTED,
                f"constrained tool calls (tool_choice required or named, strict tools) are not available for the "
                f"{self.family} family yet; use tool_choice auto without strict",
            )
        return call_grammar(
            self.family,  # type: ignore[arg-type]
            tools.functions,
            parallel=tools.parallel,
            required=tools.required,
            marker_ids=self.marker_ids,
        )


@dataclass
class ChatPlan:
    model: ChatModel
    tools: ToolRequest | None
    grammar: ToolGrammar | None
    opened: bool
    """The prompt opened the thinking block: the output starts inside it."""
    thinks: bool
    budget: int | None

    def constrain(self, output: OutputParams) -> OutputParams:
        """The request's output parameters with its call grammar in place of a response_format (never both)."""
        return replace(output, response_format=self.grammar) if self.grammar is not None else output  # type: ignore[arg-type]

    def attach(self, processors: list[Any], constraint: Any, eos: Sequence[int] = ()) -> list[Any]:
        """A choice's processors with the budget's ForceThinking before the batchable part (grammar and bias),
        and the answer grammar `constraint` gated on the thinking (which then may not end before the answer)."""
        gated = constraint is not None and self.thinks
        if self.model.markers is None or (self.budget is None and not gated):
            return processors
        tracker = ThinkTracker(
            self.model.markers, opened=self.opened, budget=self.budget, tail=gated, thinks=self.thinks
        )
        if gated:
            constraint.gate = tracker
        at = next((i for i, p in enumerate(processors) if getattr(p, "batchable", False)), len(processors))
        force = ForceThinking(tracker, no_end_while_thinking=eos if gated else ())
        return [*processors[:at], force, *processors[at:]]

    def finish(self, text: str, tokens: Sequence[int], reason: str) -> tuple[str, str, dict[str, Any] | None]:
        """(content, finish_reason, the stored extras or None) of one choice's final text and kept tokens."""
        extras: dict[str, Any] = {}
        content = text
        markers = self.model.markers
        if markers is not None and self.thinks:
            split = split_output(text, tokens, markers, opened=self.opened)
            if split.reasoning is not None:
                content = split.content
                extras["reasoning_content"] = split.reasoning
                extras["reasoning_tokens"] = split.reasoning_tokens
        if self.tools is not None and self.model.family is not None:
            parsed = parse_calls(self.model.family, content, [t["function"] for t in self.tools.tools])
            calls = parsed.calls if self.tools.parallel else parsed.calls[:1]
            if calls:
                content = parsed.content
                extras[CALLS] = [{"name": c.name, "arguments": c.arguments} for c in calls]
                if reason == FinishReason.STOP:
                    reason = FinishReason.TOOL_CALLS
        return content, str(reason), extras or None

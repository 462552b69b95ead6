"""response_format, logit_bias, logprobs and echo through the engine, on the tiny random model (junk when
unconstrained: a hard case), end to end through the real store and shard runner where results are checked.

- a json_schema job of 200 requests over several schemas: 100% parse and validate (jsonschema); json_object too;
  every output ends with stop, or length where max_tokens cut it;
- returned logprobs equal a log-softmax of the model's logits for the same tokens (a plain forward pass),
  batched and single, cache on and off, also under a grammar or a bias (the model's own, not the masked ones);
- echo's prompt logprobs equal a plain forward pass, also when the prefix came from the cache;
- output bodies validate against the official openai client's types; a bias outside the vocabulary fails alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from openai._models import construct_type
from openai.types import Completion
from openai.types.chat import ChatCompletion

from omlx_jobs.jobs.formats import CHAT_URL, COMPLETIONS_URL, SamplingParams, parse_line
from omlx_jobs.jobs.output import OUTPUT_COLUMNS, output_lines
from omlx_jobs.jobs.params import OutputParams
from omlx_jobs.jobs.submit import load_job
from omlx_jobs.store import RequestStatus, Store, open_store
from omlx_jobs.worker.engine.config import EngineConfig
from omlx_jobs.worker.engine.loop import Engine
from omlx_jobs.worker.engine.results import ItemResult
from omlx_jobs.worker.engine.sequence import WorkItem
from omlx_jobs.worker.extras.logits import log_softmax
from omlx_jobs.worker.models.loaded import LoadedModel
from omlx_jobs.worker.runtime.shard import run_shard

SCHEMAS = json.loads((Path(__file__).parent / "data/schemas/schemas.json").read_text())["schemas"]
TOPICS = ["a person", "a review", "an invoice", "a news story", "a tree of labels"]


@pytest.fixture
def store(sqlite_url: str) -> Any:
    s = open_store(url=sqlite_url)
    yield s
    s.close()


def _line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _run_job(store: Store, engine: Engine, tmp_path: Path, lines: list[str]) -> tuple[str, list[dict[str, Any]]]:
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    result = load_job(store, path, "tiny")
    assert not result.rejected, [str(e) for e in result.errors]
    run_shard(store, engine, result.job_id)
    rows = list(store.iter_requests(result.job_id, columns=OUTPUT_COLUMNS))
    return result.job_id, [json.loads(text) for text, _ in output_lines(rows, result.job_id, "tiny")]


def _chat(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "Reply with JSON only."},
        {"role": "user", "content": f"Extract {TOPICS[i % len(TOPICS)]} as JSON, record {i}."},
    ]


def test_a_json_schema_job_of_200_requests_always_parses_and_validates(
    store: Store, tiny_loaded: LoadedModel, tmp_path: Path
) -> None:
    engine = Engine(tiny_loaded, EngineConfig(completion_batch_size=32))
    lines, specs = [], {}
    # Nested objects, enums, arrays, required, anyOf/null and $ref; the recursive tree is left out: nothing bounds
    # its depth, so the junk-writing model can fill the tiny model's context with it (a cut says length).
    bounded = [s for s in SCHEMAS if s["name"] != "tree"]
    for i in range(200):
        spec = bounded[i % len(bounded)]
        sampling = {"temperature": 0} if i % 2 else {"temperature": 1.0, "seed": i}
        fmt = {"type": "json_schema", "json_schema": {"name": spec["name"], "schema": spec["schema"], "strict": True}}
        body = {"messages": _chat(i), "max_tokens": 1024, "response_format": fmt, **sampling}
        lines.append(_line(f"r{i}", CHAT_URL, body))
        specs[f"r{i}"] = spec
    _, outputs = _run_job(store, engine, tmp_path, lines)
    assert len(outputs) == 200
    for out in outputs:
        body = out["response"]["body"]
        ChatCompletion.model_validate(body)
        (choice,) = body["choices"]
        assert choice["finish_reason"] == "stop", choice
        assert choice["logprobs"] is None, "nothing asked for, nothing returned"
        jsonschema.validate(json.loads(choice["message"]["content"]), specs[out["custom_id"]]["schema"])


def test_json_object_outputs_are_objects_or_were_cut_by_max_tokens(
    store: Store, tiny_loaded: LoadedModel, tmp_path: Path
) -> None:
    engine = Engine(tiny_loaded, EngineConfig(completion_batch_size=32))
    fmt = {"type": "json_object"}
    bodies = [
        {"messages": _chat(i), "max_tokens": 300, "temperature": 1.0, "seed": i, "response_format": fmt}
        for i in range(48)
    ]
    lines = [_line(f"o{i}", CHAT_URL, b) for i, b in enumerate(bodies)]
    _, outputs = _run_job(store, engine, tmp_path, lines)
    stopped = 0
    for out in outputs:
        body = out["response"]["body"]
        (choice,) = body["choices"]
        if choice["finish_reason"] == "stop":
            stopped += 1
            assert isinstance(json.loads(choice["message"]["content"]), dict)
        else:
            assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 300
    assert stopped >= 12, "many sampled objects close within the budget"


def test_a_cut_constrained_output_says_length(store: Store, tiny_loaded: LoadedModel, tmp_path: Path) -> None:
    spec = next(s for s in SCHEMAS if s["name"] == "invoice")
    fmt = {"type": "json_schema", "json_schema": {"name": "invoice", "schema": spec["schema"]}}
    body = {"messages": _chat(0), "max_tokens": 8, "temperature": 0, "response_format": fmt}
    _, (out,) = _run_job(store, Engine(tiny_loaded), tmp_path, [_line("cut", CHAT_URL, body)])
    usage, (choice,) = out["response"]["body"]["usage"], out["response"]["body"]["choices"]
    assert choice["finish_reason"] == "length" and usage["completion_tokens"] == 8


# ---- logprobs ------------------------------------------------------------------------------------------


def _forward_logprobs(loaded: LoadedModel, tokens: list[int]) -> np.ndarray:
    """(len(tokens), V) log-softmax of a plain forward pass: row j is the distribution of token j + 1."""
    logits = loaded.model(mx.array([tokens]), cache=make_prompt_cache(loaded.model))[0].astype(mx.float32)
    return np.array(log_softmax(logits))


def _work(loaded: LoadedModel, key: int, url: str, body: dict[str, Any]) -> WorkItem:
    b = parse_line(_line(str(key), url, body), 1).body
    assert b is not None
    return WorkItem(key, loaded.encode(url, b), SamplingParams.from_body(b), output=OutputParams.from_body(b))


def _results(engine: Engine, items: list[WorkItem]) -> dict[int, ItemResult]:
    out: dict[int, ItemResult] = {}
    engine.run(items, lambda rs: out.update({r.key: r for r in rs}))
    return out


SHARED = "You are a careful assistant. Think about the question and answer it in a few words. "


def _logprob_items(loaded: LoadedModel) -> list[WorkItem]:
    """Chat requests with logprobs sharing a system prompt (so the cache has work), plain, biased, constrained."""
    items = []
    for i in range(8):
        body: dict[str, Any] = {
            "messages": [{"role": "system", "content": SHARED}, {"role": "user", "content": f"Question {i}?"}],
            "max_tokens": 12,
            "logprobs": True,
            "top_logprobs": 5,
            **({"temperature": 0} if i % 2 else {"temperature": 1.0, "seed": i}),
        }
        if i % 4 == 1:
            body["logit_bias"] = {"7": 5.0, "9": -100}
        if i % 4 == 2:
            body["response_format"] = {"type": "json_object"}
        items.append(_work(loaded, i, CHAT_URL, body))
    return items


@pytest.mark.parametrize(("batch", "cache"), [(8, True), (8, False), (1, True)])
def test_logprobs_equal_a_plain_forward_pass(tiny_loaded: LoadedModel, batch: int, cache: bool) -> None:
    engine = Engine(tiny_loaded, EngineConfig(completion_batch_size=batch, prefill_batch_size=4, prefix_cache=cache))
    items = _logprob_items(tiny_loaded)
    results = _results(engine, items)
    pieces = engine.outputs.pieces
    for item in items:
        (choice,) = results[item.key].choices
        entries = choice.logprobs
        assert entries is not None and len(entries) == len(choice.token_ids)
        ref = _forward_logprobs(tiny_loaded, item.tokens + choice.token_ids)
        for k, (token, entry) in enumerate(zip(choice.token_ids, entries, strict=True)):
            row = ref[len(item.tokens) + k - 1]
            assert entry[0] == pieces[token]
            assert entry[1] == pytest.approx(float(row[token]), abs=1e-4), (item.key, k)
            top = entry[2]
            assert len(top) == 5 and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
            best = np.sort(row)[::-1][:5]
            np.testing.assert_allclose([lp for _, lp in top], best, atol=1e-4)
            assert entry[1] <= top[0][1] + 1e-6 and (entry[1] < top[-1][1] + 1e-6 or [entry[0], entry[1]] in top)
    if cache:
        assert engine.cache.stats.hits > 0


def test_logit_bias_forces_and_bans_tokens(tiny_loaded: LoadedModel) -> None:
    engine = Engine(tiny_loaded)
    greedy = {"messages": _chat(0), "max_tokens": 6, "temperature": 0}
    forced = _work(tiny_loaded, 0, CHAT_URL, {**greedy, "logit_bias": {"42": 100}})
    plain = _work(tiny_loaded, 1, CHAT_URL, greedy)
    results = _results(engine, [forced, plain])
    assert results[0].choices[0].token_ids == [42] * 6
    first = results[1].choices[0].token_ids[0]
    banned = _work(tiny_loaded, 2, CHAT_URL, {**greedy, "logit_bias": {str(first): -100}})
    assert _results(engine, [banned])[2].choices[0].token_ids[0] != first


# ---- echo ----------------------------------------------------------------------------------------------

QUESTION = "Question: which of these is the capital of France, the largest city on the Seine? Answer:"
ANSWERS = [" Paris", " Lyon", " Marseille", " the city of Toulouse"]


def _echo_items(loaded: LoadedModel, max_tokens: int = 0) -> list[WorkItem]:
    return [
        _work(
            loaded, i, COMPLETIONS_URL, {"prompt": QUESTION + a, "max_tokens": max_tokens, "logprobs": 3, "echo": True}
        )
        for i, a in enumerate(ANSWERS)
    ]


@pytest.mark.parametrize("cache", [True, False])
def test_echo_logprobs_equal_a_plain_forward_pass(tiny_loaded: LoadedModel, cache: bool) -> None:
    engine = Engine(tiny_loaded, EngineConfig(prefix_cache=cache, min_shared_tokens=4))
    items = _echo_items(tiny_loaded)
    for _ in range(2):  # the second run finds every prefix cached
        results = _results(engine, items)
        for item in items:
            (choice,) = results[item.key].choices
            assert choice.finish_reason == "length" and choice.completion_tokens == 0 and choice.logprobs == []
            prompt = choice.prompt_logprobs
            assert prompt is not None and len(prompt) == len(item.tokens)
            assert prompt[0][1] is None and prompt[0][2] is None, "nothing precedes the first token"
            ref = _forward_logprobs(tiny_loaded, item.tokens)
            for j in range(1, len(item.tokens)):
                assert prompt[j][1] == pytest.approx(float(ref[j - 1][item.tokens[j]]), abs=1e-4), (item.key, j)
                np.testing.assert_allclose([lp for _, lp in prompt[j][2]], np.sort(ref[j - 1])[::-1][:3], atol=1e-4)
            assert choice.text == QUESTION + ANSWERS[item.key]


def test_scoring_computes_the_trie_minimum(tiny_loaded: LoadedModel) -> None:
    """The question is scored once, by its warm-up, and each answer runs only its own tokens."""
    engine = Engine(tiny_loaded, EngineConfig(min_shared_tokens=4))
    items = _echo_items(tiny_loaded)
    stats = engine.run(items, lambda rs: None)
    assert stats.warmups >= 1 and stats.prefill_tokens <= stats.trie_min_tokens + len(items)
    first, q = items[0].tokens, len(items[0].tokens)  # q: the tokens every prompt starts with (the question)
    for i in items[1:]:
        q = next((j for j in range(min(q, len(i.tokens))) if i.tokens[j] != first[j]), min(q, len(i.tokens)))
    assert engine.outputs.scored_tokens <= sum(len(i.tokens) - q + 1 for i in items)


def test_echo_with_generation_and_the_openai_types(store: Store, tiny_loaded: LoadedModel, tmp_path: Path) -> None:
    echoed = {"echo": True, "temperature": 0}
    lines = [
        _line("e", COMPLETIONS_URL, {"prompt": QUESTION, "max_tokens": 4, "logprobs": 2, **echoed}),
        _line("s", COMPLETIONS_URL, {"prompt": QUESTION + ANSWERS[0], "max_tokens": 0, "logprobs": 0, **echoed}),
        _line("t", COMPLETIONS_URL, {"prompt": QUESTION, "max_tokens": 3, **echoed}),
        _line("c", CHAT_URL, {"messages": _chat(1), "max_tokens": 4, "temperature": 0, "logprobs": True, "n": 2}),
        _line("p", CHAT_URL, {"messages": _chat(1), "max_tokens": 4, "temperature": 0}),
    ]
    _, outputs = _run_job(store, Engine(tiny_loaded), tmp_path, lines)
    by_id = {o["custom_id"]: o["response"]["body"] for o in outputs}
    for key in ("e", "s"):  # strict past echo's first token, whose null the SDK's types lack (its parse takes it)
        assert isinstance(construct_type(type_=Completion, value=by_id[key]), Completion)
        lp = by_id[key]["choices"][0]["logprobs"]
        rest = {k: v[1:] for k, v in lp.items()}
        Completion.model_validate({**by_id[key], "choices": [{**by_id[key]["choices"][0], "logprobs": rest}]})
    echo = construct_type(type_=Completion, value=by_id["e"]).choices[0]  # type: ignore[union-attr]
    assert echo.text.startswith(QUESTION) and echo.logprobs is not None
    n_prompt = by_id["e"]["usage"]["prompt_tokens"]
    assert len(echo.logprobs.tokens or []) == n_prompt + 4 and (echo.logprobs.token_logprobs or [])[0] is None
    assert echo.logprobs.text_offset == sorted(echo.logprobs.text_offset or [])
    score = by_id["s"]
    assert score["choices"][0]["text"] == QUESTION + ANSWERS[0] and score["usage"]["completion_tokens"] == 0
    assert len(score["choices"][0]["logprobs"]["tokens"]) == score["usage"]["prompt_tokens"]
    assert by_id["t"]["choices"][0]["logprobs"] is None and by_id["t"]["choices"][0]["text"].startswith(QUESTION)
    chat = ChatCompletion.model_validate(by_id["c"])
    assert all(c.logprobs and c.logprobs.content and len(c.logprobs.content) == 4 for c in chat.choices)
    assert all(c["logprobs"] is None for c in by_id["p"]["choices"])


def test_a_bias_outside_the_vocabulary_fails_alone(store: Store, tiny_loaded: LoadedModel, tmp_path: Path) -> None:
    lines = [
        _line("bad", CHAT_URL, {"messages": _chat(0), "max_tokens": 3, "logit_bias": {"99999": 1}}),
        _line("good", CHAT_URL, {"messages": _chat(0), "max_tokens": 3}),
    ]
    job_id, _ = _run_job(store, Engine(tiny_loaded), tmp_path, lines)
    rows = {r.custom_id: r for r in store.iter_requests(job_id)}
    assert rows["bad"].status == RequestStatus.FAILED and rows["bad"].error_code == "invalid_logit_bias"
    assert rows["good"].status == RequestStatus.COMPLETED


def test_one_mask_call_per_step_equals_the_row_by_row_processors(tiny_loaded: LoadedModel) -> None:
    """Grammar masks and biases applied for the whole batch in one call per step give the tokens that mlx-lm's
    own row-by-row processor calls give (greedy), penalties and logprobs included."""
    bodies = []
    for i in range(12):
        spec = SCHEMAS[i % len(SCHEMAS)]
        body: dict[str, Any] = {"messages": _chat(i), "max_tokens": 48, "temperature": 0}
        if i % 3 != 2:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": spec["schema"]}}
        if i % 2:
            body["logit_bias"] = {"7": 3.0, "11": -100}
        if i % 4 == 3:
            body |= {"repetition_penalty": 1.2, "logprobs": True, "top_logprobs": 2}
        bodies.append(body)

    def tokens(batched: bool) -> dict[int, list[int]]:
        engine = Engine(tiny_loaded, EngineConfig(completion_batch_size=8, prefill_batch_size=4))
        if not batched:
            engine.backend.step_logits = None
        items = [_work(tiny_loaded, i, CHAT_URL, b) for i, b in enumerate(bodies)]
        return {k: r.choices[0].token_ids for k, r in _results(engine, items).items()}

    assert tokens(batched=True) == tokens(batched=False)

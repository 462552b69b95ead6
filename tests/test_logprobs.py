"""Logprobs: per-step collection, the stored form, OpenAI's formats (checked with the official client's types),
byte-identical output without logprobs, and prompt logprobs (echo) against a plain forward pass, with and
without a cached prefix."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from openai._models import construct_type
from openai.types import Completion
from openai.types.chat import ChatCompletion

from omlx_jobs.jobs.formats import CHAT_URL, COMPLETIONS_URL
from omlx_jobs.jobs.logprobs import completion_logprobs
from omlx_jobs.jobs.output import output_lines, response_body
from omlx_jobs.worker.extras.logits import log_softmax
from omlx_jobs.worker.extras.logprobs import FLOOR, TokenLogprob, TokenPieces, step_logprobs, stored_logprobs
from omlx_jobs.worker.extras.prompt_logprobs import PromptLogprobs, prompt_logprobs

# Token 3 is the first two bytes of "’" (e2 80 99) and token 4 its last: pieces that are not text alone.
PIECES = TokenPieces([b"Hello", b" world", b"!", b"\xe2\x80", b"\x99", b"<|im_end|>"])


def row(endpoint: str, text: str, logprobs: Any = None, more: Any = None, **kw: Any) -> SimpleNamespace:
    base = dict(
        id=7,
        idx=0,
        custom_id="c",
        endpoint=endpoint,
        status="completed",
        output_text=text,
        more_choices=more,
        finish_reason="stop",
        prompt_tokens=5,
        cached_tokens=0,
        completion_tokens=3,
        error_code=None,
        error_message=None,
        finished_at=1_700_000_000,
    )
    if logprobs is not None:
        base["logprobs"] = logprobs
    return SimpleNamespace(**(base | kw))


# ---- collection ----------------------------------------------------------------------------------------


def test_step_logprobs_sorted_consistent_and_ties_by_id() -> None:
    v1 = log_softmax(mx.array([0.0, 2.0, 2.0, -1.0, 1.0]))
    v2 = log_softmax(mx.array([3.0, 0.0, 1.0, 1.0, -5.0]))
    got = step_logprobs([v1, v2], [3, 0], [3, 0])
    a, b = got
    assert a.token == 3 and a.logprob == pytest.approx(float(v1[3]))
    assert [t for t, _ in a.top] == [1, 2, 4], "sorted by logprob, equal ones by token id"
    assert b.top == () and b.logprob == pytest.approx(float(v2[0]))
    (c,) = step_logprobs([v2], [2], [20])
    assert len(c.top) == 5 and dict(c.top)[2] == c.logprob


def test_stored_form_is_compact_json_with_pieces() -> None:
    tl = [TokenLogprob(0, -0.25, ((0, -0.25), (1, -1.5))), TokenLogprob(3, float("-inf"), ((3, float("-inf")),))]
    stored = stored_logprobs([tl], PIECES, top_logprobs=2)
    assert stored == {
        "v": 1,
        "choices": [
            [["Hello", -0.25, [["Hello", -0.25], [" world", -1.5]]], [[226, 128], FLOOR, [[[226, 128], FLOOR]]]]
        ],
    }
    assert json.loads(json.dumps(stored, allow_nan=False)) == stored
    plain = stored_logprobs([[TokenLogprob(2, -0.1234567891)]], PIECES, top_logprobs=0)
    assert plain["choices"] == [[["!", -0.12345679]]], "float32 precision, no alternatives stored"


# ---- OpenAI formats -------------------------------------------------------------------------------------


def _chat_stored(top: int) -> dict[str, Any]:
    entries = [
        TokenLogprob(0, -0.1, ((0, -0.1), (1, -2.5))[:top]),
        TokenLogprob(3, -0.2, ((3, -0.2), (4, -3.0))[:top]),
        TokenLogprob(4, -0.01, ((4, -0.01), (2, -5.0))[:top]),
    ]
    return stored_logprobs([entries, entries[:1]], PIECES, top_logprobs=top)


@pytest.mark.parametrize("top", [0, 2])
def test_chat_logprobs_validate_against_the_openai_types(top: int) -> None:
    text = "Hello’"
    body = response_body(
        row(CHAT_URL, text, _chat_stored(top), more=[{"text": "Hello", "finish_reason": "length"}]), "m"
    )
    parsed = ChatCompletion.model_validate(body)  # strict validation, not the client's lenient parse
    first = parsed.choices[0].logprobs
    assert first is not None and first.content is not None
    assert [t.token for t in first.content] == ["Hello", "\\xe2\\x80", "\\x99"]
    assert b"".join(bytes(t.bytes or []) for t in first.content).decode() == text
    for t in first.content:
        assert len(t.top_logprobs) == top
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        if top:
            assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob
    second = parsed.choices[1].logprobs
    assert second is not None and second.content is not None and len(second.content) == 1


def test_completion_logprobs_validate_against_the_openai_types() -> None:
    stored = _chat_stored(2)
    body = response_body(row(COMPLETIONS_URL, "Hello’", stored, more=[{"text": "Hello", "finish_reason": "stop"}]), "m")
    parsed = Completion.model_validate(body)
    lp = parsed.choices[0].logprobs
    assert lp is not None
    assert lp.tokens == ["Hello", "\\xe2\\x80", "\\x99"]
    assert lp.text_offset == [0, 5, 5], "the partial character starts where it will appear"
    assert lp.token_logprobs == [-0.1, -0.2, -0.01]
    assert lp.top_logprobs is not None and lp.top_logprobs[0] == {"Hello": -0.1, " world": -2.5}


def test_completion_top_logprobs_always_hold_the_chosen_token() -> None:
    (tl,) = step_logprobs([log_softmax(mx.array([5.0, 0.0, 1.0, 2.0, 3.0, 4.0]))], [1], [2])
    out = completion_logprobs(stored_logprobs([[tl]], PIECES, top_logprobs=2)["choices"][0])
    assert out["top_logprobs"][0] == {
        "Hello": pytest.approx(tl.top[0][1]),
        "<|im_end|>": pytest.approx(tl.top[1][1]),
        " world": pytest.approx(tl.logprob),
    }
    zero = completion_logprobs(stored_logprobs([[tl]], PIECES, top_logprobs=0)["choices"][0])
    assert zero["top_logprobs"] == [{" world": pytest.approx(tl.logprob)}], "logprobs 0: the chosen token only"


def test_echo_returns_the_prompt_first_with_a_null_first_logprob() -> None:
    prompt = [TokenLogprob(0, None), TokenLogprob(1, -1.25, ((2, -0.5), (1, -1.25)))]
    out = [TokenLogprob(2, -0.5, ((2, -0.5),))]
    stored = stored_logprobs([out], PIECES, top_logprobs=2, prompt=prompt)
    body = response_body(row(COMPLETIONS_URL, "Hello world!", stored), "m")
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["Hello", " world", "!"] and lp["text_offset"] == [0, 5, 11]
    assert lp["token_logprobs"] == [None, -1.25, -0.5] and lp["top_logprobs"][0] is None
    # The client parses it (its default, lenient path); the SDK's types have no null in token_logprobs,
    # which the API returns for echo's first token, so the strict check runs past that token.
    parsed = construct_type(type_=Completion, value=body)
    assert isinstance(parsed, Completion) and parsed.choices[0].logprobs.token_logprobs == [None, -1.25, -0.5]  # type: ignore[union-attr]
    rest = {k: v[1:] for k, v in lp.items()}
    Completion.model_validate({**body, "choices": [{**body["choices"][0], "logprobs": rest}]})


def test_output_without_logprobs_is_byte_identical() -> None:
    """Rows that asked for no logprobs (no stored column yet, or null) render exactly as before."""
    before = (
        '{"id": "batch_req_j_0", "custom_id": "c", "response": {"status_code": 200, "request_id": "req_7", "body": '
        '{"id": "chatcmpl-7", "object": "chat.completion", "created": 1700000000, "model": "m", "choices": '
        '[{"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": null, "finish_reason": '
        '"stop"}], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, '
        '"prompt_tokens_details": {"cached_tokens": 0}}}}, "error": null}'
    )
    for r in (row(CHAT_URL, "hi"), SimpleNamespace(**vars(row(CHAT_URL, "hi")), logprobs=None)):
        ((line, is_error),) = list(output_lines([r], "j", "m"))
        assert line == before and not is_error


# ---- prompt logprobs ------------------------------------------------------------------------------------


def plain(model: Any, tokens: list[int]) -> np.ndarray:
    return np.array(log_softmax(model(mx.array([tokens]))[0].astype(mx.float32)))


def check_against_plain(got: PromptLogprobs, lsm: np.ndarray, tokens: list[int], first_scored: bool) -> None:
    assert got.tokens.tolist() == tokens
    assert np.isnan(got.logprobs[0]) != first_scored
    want = [lsm[i - 1][tokens[i]] for i in range(1, len(tokens))]
    assert np.allclose(got.logprobs[1:], want, atol=2e-4)
    for i in range(1, len(tokens)):
        order = np.argsort(-lsm[i - 1])[: got.top_ids.shape[1]]
        assert np.allclose(got.top_logprobs[i], lsm[i - 1][order], atol=2e-4)
        assert set(got.top_ids[i].tolist()) == set(order.tolist()) or np.allclose(
            np.sort(lsm[i - 1][got.top_ids[i]]), np.sort(lsm[i - 1][order]), atol=2e-4
        )


def test_prompt_logprobs_batched_equal_plain_forward_passes(tiny_loaded) -> None:  # type: ignore[no-untyped-def]
    model, enc = tiny_loaded.model, tiny_loaded.tokenizer.encode
    prompts = [enc("The quick brown fox jumps over the lazy dog."), enc("Paris"), enc("Once upon a time there was")]
    results = prompt_logprobs(model, prompts, positions_per_step=8)  # several chunks per prompt
    for p, (got, last, caches) in zip(prompts, results, strict=True):
        lsm = plain(model, p)
        check_against_plain(got, lsm, p, first_scored=False)
        assert np.allclose(np.array(log_softmax(last.astype(mx.float32))), lsm[-1], atol=2e-4), (
            "logits after the prompt"
        )
        assert caches is None
    entries = results[0][0].entries(2)
    assert entries[0] == TokenLogprob(prompts[0][0], None) and len(entries[1].top) == 2


def test_prompt_logprobs_after_a_cached_prefix_equal_one_plain_pass(tiny_loaded) -> None:  # type: ignore[no-untyped-def]
    """A question scored once and cached, its answers scored after it: the same as each (question, answer)
    scored whole, including each answer's first token (scored from the logits kept with the prefix)."""
    model, enc = tiny_loaded.model, tiny_loaded.tokenizer.encode
    question = enc("Question: what is the capital of France? Answer:")
    answers = [enc(" Paris"), enc(" Berlin, the capital of Germany"), enc(" Rome")]
    (prefix_lp, prefix_logits, prefix_caches) = prompt_logprobs(model, [question], return_caches=True)[0]
    assert prefix_caches is not None and prefix_caches[0].offset == len(question)
    scored = prompt_logprobs(model, answers, prefix=(prefix_caches, prefix_logits), return_caches=True)
    for a, (got, last, caches) in zip(answers, scored, strict=True):
        whole = question + a
        lsm = plain(model, whole)
        check_against_plain(prefix_lp.concat(got), lsm, whole, first_scored=False)
        assert not np.isnan(got.logprobs[0]), "the answer's first token is scored from the prefix's logits"
        assert len(prefix_lp.concat(got).head(len(question))) == len(question)
        # The row's own cache continues the sequence: one more token gives the plain pass's next logits.
        assert caches is not None and caches[0].offset == len(whole)
        nxt = model(mx.array([[whole[-1]]]), cache=_copy(caches))
        ref = model(mx.array([whole + [whole[-1]]]))
        assert np.allclose(np.array(nxt[0, -1]), np.array(ref[0, -1]), atol=2e-3)
        assert np.allclose(np.array(last), np.array(model(mx.array([whole]))[0, -1]), atol=2e-3)


def _copy(caches: Any) -> Any:
    fresh = [KVCache() for _ in caches]
    for f, c in zip(fresh, caches, strict=True):
        f.state = c.state
    return fresh


def test_prompt_logprobs_refuse_what_they_cannot_score(tiny_loaded) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        prompt_logprobs(tiny_loaded.model, [[]])
    rotating = [RotatingKVCache(max_size=8) for _ in make_prompt_cache(tiny_loaded.model)]
    with pytest.raises(ValueError, match="KVCache"):
        prompt_logprobs(tiny_loaded.model, [[1, 2]], prefix=(rotating, mx.zeros((384,))))

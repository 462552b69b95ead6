"""Grammar masks and the logits path on the tiny model's tokenizer: EOS sets, padded vocabularies, the grammar
cache, mx mask application, logit_bias, and the per-batch call against the per-row processors."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omlx_jobs.jobs.params import OutputParams
from omlx_jobs.jobs.response_format import JSON_OBJECT_SCHEMA, ResponseFormat
from omlx_jobs.worker.extras.grammar import GrammarCache, GrammarError, GrammarTokenizer, model_eos_ids
from omlx_jobs.worker.extras.logits import (
    BatchLogits,
    GrammarProcessor,
    LogitBias,
    LogprobTap,
    allowed_tokens,
    apply_bitmask,
    logits_width,
    row_logits,
)
from omlx_jobs.worker.loading import load
from omlx_jobs.worker.prompts import PromptError
from tests.tiny_model import build_tiny_model

SCHEMAS = json.loads((Path(__file__).parent / "data/schemas/schemas.json").read_text())["schemas"]
PADDING = 61  # logits past the tokenizer's vocabulary


def fmt(schema: dict) -> ResponseFormat:
    return ResponseFormat("json_schema", json.dumps(schema))


@pytest.fixture(scope="module")
def padded(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The tiny model with padded logits, and its grammar tokenizer."""
    loaded = load(str(build_tiny_model(tmp_path_factory.mktemp("padded"), vocab_padding=PADDING)))
    width = logits_width(loaded.model)
    tok = GrammarTokenizer.build(loaded.tokenizer, width, model_eos_ids(loaded.tokenizer, loaded.config, width))
    return loaded, tok


def allowed_ids(bitmask: np.ndarray, row: int, vocab: int) -> set[int]:
    bits = np.unpackbits(bitmask.view(np.uint8)[row], bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


def test_eos_ids_join_the_tokenizer_and_the_config(padded) -> None:  # type: ignore[no-untyped-def]
    loaded, tok = padded
    im_end = loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
    endoftext = loaded.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_ids == {im_end}
    both = model_eos_ids(loaded.tokenizer, {"eos_token_id": [im_end, endoftext, 10**9]}, tok.vocab_size)
    assert both == {im_end, endoftext}, "every EOS id, none outside the vocabulary"


def test_padded_vocabulary_slots_are_never_allowed(padded) -> None:  # type: ignore[no-untyped-def]
    loaded, tok = padded
    real = len(loaded.tokenizer.get_vocab())
    assert tok.vocab_size == real + PADDING
    cache = GrammarCache(tok)
    c = cache.constraint(ResponseFormat("json_object", json.dumps(JSON_OBJECT_SCHEMA)))
    bitmask = tok.new_bitmask(1)
    text = '{"a":[1,"x y",{"b":null}],"c":true}'
    for t in tok.ll.tokenize_str(text):
        c.fill(bitmask, 0)
        allowed = allowed_ids(bitmask, 0, tok.vocab_size)
        assert t in allowed
        assert not allowed & set(range(real, tok.vocab_size)), "a padded slot was allowed"
        c.consume([t])
    logits = apply_bitmask(mx.zeros((1, tok.vocab_size)), bitmask)
    assert bool(mx.all(logits[0, real:] == -mx.inf))


def test_a_complete_document_allows_only_eos(padded) -> None:  # type: ignore[no-untyped-def]
    _, tok = padded
    spec = SCHEMAS[0]
    c = GrammarCache(tok).constraint(fmt(spec["schema"]))
    c.consume(tok.ll.tokenize_str(json.dumps(spec["example"], separators=(",", ":"))))
    bitmask = tok.new_bitmask(1)
    c.fill(bitmask, 0)
    assert c.is_accepting and c.is_stopped and c.error is None
    assert allowed_ids(bitmask, 0, tok.vocab_size) == set(tok.eos_ids)


def test_every_eos_id_may_end_the_output(padded) -> None:  # type: ignore[no-untyped-def]
    loaded, _ = padded
    width = logits_width(loaded.model)
    ids = {loaded.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    tok = GrammarTokenizer.build(loaded.tokenizer, width, ids)
    c = GrammarCache(tok).constraint(fmt({"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]}))
    c.consume(tok.ll.tokenize_str('{"a":1}'))
    bitmask = tok.new_bitmask(1)
    c.fill(bitmask, 0)
    assert allowed_ids(bitmask, 0, width) == ids


def test_a_token_outside_the_mask_fails_the_output_and_leaves_only_eos(padded) -> None:  # type: ignore[no-untyped-def]
    _, tok = padded
    c = GrammarCache(tok).constraint(fmt(SCHEMAS[0]["schema"]))
    c.consume(tok.ll.tokenize_str("[1]"))  # not an object
    assert c.error
    bitmask = tok.new_bitmask(1)
    c.fill(bitmask, 0)
    assert allowed_ids(bitmask, 0, tok.vocab_size) == set(tok.eos_ids)


def test_grammar_cache_compiles_each_schema_once_and_copies_are_independent(padded) -> None:  # type: ignore[no-untyped-def]
    _, tok = padded
    cache = GrammarCache(tok, max_entries=2)
    a1, a2 = cache.constraint(fmt(SCHEMAS[0]["schema"])), cache.constraint(fmt(SCHEMAS[0]["schema"]))
    assert (cache.misses, cache.hits) == (1, 1)
    a1.consume(tok.ll.tokenize_str('{"name":"x"'))
    m1, m2 = tok.new_bitmask(1), tok.new_bitmask(1)
    a1.fill(m1, 0)
    a2.fill(m2, 0)
    assert not np.array_equal(m1, m2), "a copy must not share its state"
    assert allowed_ids(m2, 0, tok.vocab_size) == {t for t in range(tok.vocab_size) if tok.ll.decode_bytes([t]) == b"{"}
    cache.constraint(fmt(SCHEMAS[1]["schema"]))
    cache.constraint(fmt(SCHEMAS[2]["schema"]))  # evicts schema 0, least recently used
    cache.constraint(fmt(SCHEMAS[0]["schema"]))
    assert (cache.misses, cache.hits) == (4, 1)


def test_a_schema_that_does_not_compile_is_a_request_error(padded) -> None:  # type: ignore[no-untyped-def]
    _, tok = padded
    with pytest.raises(GrammarError) as info:
        GrammarCache(tok).constraint(fmt({"type": "object", "properties": {"a": {"not": {}}}}))
    assert info.value.code == "grammar_error" and "not" in info.value.message


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_apply_bitmask_matches_a_numpy_unpacking(dtype: mx.Dtype) -> None:
    rng = np.random.default_rng(0)
    vocab = 100
    bitmask = rng.integers(-(2**31), 2**31, size=(3, 4), dtype=np.int64).astype(np.int32)
    want = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    assert np.array_equal(np.array(allowed_tokens(bitmask, vocab)), want)
    logits = mx.array(rng.normal(size=(3, vocab)).astype(np.float32)).astype(dtype)
    out = apply_bitmask(logits, bitmask)
    assert out.dtype == dtype
    assert np.array_equal(
        np.array(out.astype(mx.float32)), np.where(want, np.array(logits.astype(mx.float32)), -np.inf)
    )


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = mx.zeros((1, 10))
    forced = LogitBias([(3, 100.0), (5, -100.0)], 10)(mx.array([1]), logits)
    assert int(mx.argmax(forced)) == 3 and float(forced[0, 5]) == -100.0
    assert float(mx.sum(forced)) == 0.0
    with pytest.raises(PromptError) as info:
        LogitBias([(10, 1.0)], 10)
    assert info.value.code == "invalid_logit_bias" and "10" in info.value.message


def test_row_logits_puts_the_tap_first_and_only_when_needed(padded) -> None:  # type: ignore[no-untyped-def]
    _, tok = padded
    cache = GrammarCache(tok)
    plain = row_logits(OutputParams(logprobs=True), grammars=None, vocab_size=tok.vocab_size)
    assert plain.processors == [] and plain.tap is None, "no processor: BatchGenerator's logprobs are raw already"
    full = row_logits(
        OutputParams(response_format=fmt(SCHEMAS[0]["schema"]), logit_bias=((1, 2.0),), logprobs=True),
        grammars=cache,
        vocab_size=tok.vocab_size,
    )
    assert [type(p) for p in full.processors] == [LogprobTap, LogitBias, GrammarProcessor]
    assert full.constraint is not None
    batched = row_logits(
        OutputParams(response_format=fmt(SCHEMAS[0]["schema"]), logit_bias=((1, 2.0),), logprobs=True),
        grammars=cache,
        vocab_size=tok.vocab_size,
        batched=True,
    )
    assert batched.processors == [] and batched.tap is None and batched.constraint is not None
    with pytest.raises(PromptError):
        row_logits(OutputParams(logit_bias=((10**6, 1.0),)), grammars=None, vocab_size=tok.vocab_size, batched=True)


def test_tap_keeps_raw_logprobs_by_position() -> None:
    tap = LogprobTap()
    logits = mx.array([[0.0, 1.0, 2.0]])
    assert tap(mx.array([5, 6]), logits) is logits
    got = tap.take(2)
    assert got is not None and np.allclose(np.array(got), np.array(logits[0] - mx.logsumexp(logits[0])))
    assert tap.take(2) is None
    for n in range(3, 12):
        tap(mx.zeros((n,)), logits)
    assert tap.take(3) is None, "old vectors are dropped"


def test_one_batch_call_equals_the_row_processors(padded) -> None:  # type: ignore[no-untyped-def]
    """BatchLogits (all rows, one call) and GrammarProcessor + LogitBias (row by row) mask alike."""
    _, tok = padded
    cache = GrammarCache(tok)
    rng = np.random.default_rng(1)
    specs = [*SCHEMAS, None]  # a row without a constraint passes through
    outs = [
        OutputParams(response_format=fmt(s["schema"]) if s else None, logit_bias=((7, 3.0),) if s is None else ())
        for s in specs
    ]
    rows_a = [row_logits(o, grammars=cache, vocab_size=tok.vocab_size) for o in outs]
    rows_b = [row_logits(o, grammars=cache, vocab_size=tok.vocab_size, batched=True) for o in outs]
    docs = [tok.ll.tokenize_str(json.dumps(s["example"], separators=(",", ":"))) if s else [] for s in specs]
    batch = BatchLogits(tok)
    contexts = [[1, 2, 3] for _ in specs]
    for step in range(6):
        logits = mx.array(rng.normal(size=(len(specs), tok.vocab_size)).astype(np.float32))
        per_row = mx.concatenate(
            [
                _run(r.processors, mx.array(ctx), logits[i : i + 1])
                for i, (r, ctx) in enumerate(zip(rows_a, contexts, strict=True))
            ]
        )
        new = [ctx[-1] if step else None for ctx in contexts]
        batched = batch.apply(logits, rows_b, new)
        assert np.array_equal(np.array(per_row), np.array(batched)), step
        for i, d in enumerate(docs):
            contexts[i].append(d[step] if d else 5)


def _run(processors, tokens, logits):  # type: ignore[no-untyped-def]
    for p in processors:
        logits = p(tokens, logits)
    return logits


def test_grammar_cache_is_bounded_in_bytes(padded) -> None:  # type: ignore[no-untyped-def]
    """Issue 21, finding 20: a huge schema's matcher holds tens of MB; the cache holds a byte budget, not 256."""
    from omlx_jobs.worker.extras.grammar import grammar_cost

    _, tok = padded

    def huge(i: int) -> dict:
        props = {f"f{i}_{k}_{'x' * 30}": {"type": "string", "enum": [f"v{j}" for j in range(4)]} for k in range(300)}
        return {"type": "object", "properties": props}

    cost = grammar_cost(fmt(huge(0)).grammar())
    assert cost > 2_000_000
    cache = GrammarCache(tok, max_bytes=int(cost * 2.5))
    for i in range(5):
        cache.constraint(fmt(huge(i)))
        assert cache.nbytes <= cache.max_bytes or len(cache) == 1
    assert len(cache) == 2
    cache.constraint(fmt(huge(4)))  # the newest stayed
    assert cache.hits == 1
    small = GrammarCache(tok, max_bytes=1)
    small.constraint(fmt(huge(0)))
    assert len(small) == 1  # one over the budget is kept: the request that needs it is running

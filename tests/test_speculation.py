"""Speculative decoding on the tiny real model (fp32): greedy output equals speculation off token for token, the
KV cache holds exactly the accepted tokens after a rollback, and the sampled acceptance rule draws from the
model's distribution (chi-square over fixed seeds)."""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from omlx_jobs.defaults import Switches
from omlx_jobs.jobs.formats import CHAT_URL, COMPLETIONS_URL, SamplingParams, parse_line
from omlx_jobs.jobs.params import OutputParams
from omlx_jobs.worker.backend import rollback
from omlx_jobs.worker.engine.config import EngineConfig
from omlx_jobs.worker.engine.loop import Engine
from omlx_jobs.worker.engine.results import ItemResult, RunStats
from omlx_jobs.worker.engine.sequence import WorkItem
from omlx_jobs.worker.extras.sampling import filtered
from omlx_jobs.worker.models.loaded import LoadedModel
from omlx_jobs.worker.speculation import verify

PASSAGE = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 3
SYSTEM = "You are a helpful assistant. Answer briefly and clearly, in one sentence. " * 2


def _engine(loaded: LoadedModel, speculation: str, batch: int, **switches: Any) -> Engine:
    config = EngineConfig(
        completion_batch_size=batch,
        prefill_batch_size=min(batch, 4),
        min_shared_tokens=8,
        switches=Switches(speculation=speculation, min_level_tokens=8, **switches),  # type: ignore[arg-type]
    )
    return Engine(loaded, config)


def _run(engine: Engine, items: list[WorkItem]) -> tuple[dict[Any, ItemResult], RunStats]:
    results: dict[Any, ItemResult] = {}
    stats = engine.run(items, lambda rs: results.update({r.key: r for r in rs}))
    assert stats.unfinished == []
    return results, stats


def _both(loaded: LoadedModel, items: list[WorkItem], batch: int, **switches: Any) -> tuple[dict, dict, RunStats]:
    off, _ = _run(_engine(loaded, "off", batch, **switches), items)
    on, stats = _run(_engine(loaded, "auto", batch, **switches), items)
    return off, on, stats


def _ids(results: dict[Any, ItemResult]) -> dict[Any, list[list[int]]]:
    return {k: [c.token_ids for c in r.choices] for k, r in results.items()}


def _greedy(max_tokens: int = 40, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def _two_level(loaded: LoadedModel, n: int) -> list[list[int]]:
    """A shared system prompt, two documents under it, questions under each (two prefix levels)."""
    prompts = []
    for i in range(n):
        doc = f"Document {i % 2}: " + PASSAGE
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{doc} Question {i}?"}]
        prompts.append(loaded.encode(CHAT_URL, {"messages": messages}))
    return prompts


@pytest.mark.parametrize("batch", [1, 4, 32])
def test_greedy_equals_speculation_off(tiny_loaded: LoadedModel, batch: int) -> None:
    """One-level (a shared passage) and two-level prefixes, cascade rows; some rows finish inside a draft
    (small max_tokens), some never draft (penalties), in the same steps as rows that do."""
    one_level = [tiny_loaded.encode(COMPLETIONS_URL, {"prompt": PASSAGE + f" {i}"}) for i in range(12)]
    prompts = one_level + _two_level(tiny_loaded, 12 if batch > 1 else 4)
    items = []
    for i, p in enumerate(prompts):
        params = _greedy(40 if i % 5 else 7)
        if i % 7 == 3:
            params = _greedy(30, repetition_penalty=1.3)  # a processor: this row does not speculate
        items.append(WorkItem(i, p, params))
    off, on, stats = _both(tiny_loaded, items, batch)
    assert _ids(on) == _ids(off)
    assert [r.choices[0].finish_reason for r in on.values()] == [r.choices[0].finish_reason for r in off.values()]
    assert stats.verify_steps > 0 and stats.accepted_tokens > 0 and stats.rejected_tokens > 0
    assert stats.generation_tokens == sum(c.completion_tokens for r in on.values() for c in r.choices)


def test_greedy_equals_off_with_rows_copying_their_prefix(tiny_loaded: LoadedModel) -> None:
    """Cascade off: each row holds a copy of its prefix in the batch cache, and rolls back its own positions."""
    items = [WorkItem(i, p, _greedy(32)) for i, p in enumerate(_two_level(tiny_loaded, 8))]
    off, on, stats = _both(tiny_loaded, items, 4, cascade=False)
    assert _ids(on) == _ids(off) and stats.accepted_tokens > 0


def test_stop_string_inside_a_draft_and_n_3(tiny_loaded: LoadedModel) -> None:
    prompt = tiny_loaded.encode(COMPLETIONS_URL, {"prompt": PASSAGE})
    plain, _ = _run(_engine(tiny_loaded, "off", 4), [WorkItem(0, prompt, _greedy(40))])
    tokens = plain[0].choices[0].token_ids
    full = tiny_loaded.tokenizer.decode(tokens)
    # A stop string starting at the 20th token's text: by then the row drafts (the output repeats itself).
    stop = full[len(tiny_loaded.tokenizer.decode(tokens[:20])) :][:3]
    assert stop and full.find(stop) > 0
    items = [WorkItem(0, prompt, _greedy(40, stop=(stop,))), WorkItem(1, prompt, _greedy(24, n=3))]
    off, on, stats = _both(tiny_loaded, items, 4)
    assert _ids(on) == _ids(off)
    assert on[0].choices[0].text == off[0].choices[0].text == full[: full.find(stop)]
    assert on[0].choices[0].finish_reason == "stop" and len(on[1].choices) == 3
    assert stats.accepted_tokens > 0
    assert stats.generation_tokens == sum(c.completion_tokens for r in on.values() for c in r.choices)


def _request(loaded: LoadedModel, key: int, body: dict[str, Any]) -> WorkItem:
    line = json.dumps({"custom_id": str(key), "method": "POST", "url": CHAT_URL, "body": body})
    b = parse_line(line, 1).body
    assert b is not None
    return WorkItem(key, loaded.encode(CHAT_URL, b), SamplingParams.from_body(b), output=OutputParams.from_body(b))


def test_grammar_logprob_and_seeded_rows_decode_as_before_next_to_speculating_rows(tiny_loaded: LoadedModel) -> None:
    """Rows with a grammar, logprobs or a seed never speculate (docs/speculation.md): their output is unchanged,
    the seeded one included, while greedy rows in the same batch do."""
    messages = [{"role": "user", "content": PASSAGE}]
    bodies = [
        {"messages": messages, "max_tokens": 40, "temperature": 0},
        {"messages": messages, "max_tokens": 24, "temperature": 0, "response_format": {"type": "json_object"}},
        {"messages": messages, "max_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 2},
        {"messages": messages, "max_tokens": 24, "temperature": 1.0, "seed": 5},
        {"messages": messages, "max_tokens": 40, "temperature": 0},
    ]
    items = [_request(tiny_loaded, i, b) for i, b in enumerate(bodies)]
    off, on, stats = _both(tiny_loaded, items, 8)
    assert _ids(on) == _ids(off)
    # Logprobs as without speculation (to fp32 rounding: a verification step's forward pass is wider).
    a, b = on[2].choices[0].logprobs, off[2].choices[0].logprobs
    assert a is not None and b is not None and [e[0] for e in a] == [e[0] for e in b]
    np.testing.assert_allclose([e[1] for e in a], [e[1] for e in b], atol=1e-5)
    assert stats.accepted_tokens > 0


def test_sampled_rows_speculate_and_finish(tiny_loaded: LoadedModel) -> None:
    prompt = tiny_loaded.encode(COMPLETIONS_URL, {"prompt": PASSAGE})
    items = [WorkItem(i, prompt, SamplingParams(max_tokens=32, temperature=0.3)) for i in range(6)]
    on, stats = _run(_engine(tiny_loaded, "auto", 8), items)
    assert all(r.choices[0].completion_tokens == 32 or r.choices[0].finish_reason == "stop" for r in on.values())
    assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0


# ---- KV rollback ---------------------------------------------------------------------------------


def _single_keys(model: Any, tokens: list[int]) -> list[mx.array]:
    cache = [KVCache() for _ in model.layers]
    model(mx.array([tokens]), cache=cache)
    return [c.keys[0, :, : c.offset, :] for c in cache]


def test_rollback_leaves_exactly_the_accepted_tokens(tiny_loaded: LoadedModel) -> None:
    model = tiny_loaded.model
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]
    longest = max(len(p) for p in prompts)
    pads = [longest - len(p) for p in prompts]
    cache = [BatchKVCache(pads) for _ in model.layers]
    model(mx.array([[0] * pad + p for p, pad in zip(prompts, pads, strict=True)]), cache=cache)
    verified = [[20, 21, 22, 23], [24, 25, 26, 27], [28, 29, 30, 31]]  # pending token + 3 drafts each
    model(mx.array(verified), cache=cache)
    kept = [4, 1, 2]  # positions each row keeps: all of them, the pending token only, one draft
    rollback.roll_back(cache, [4 - k for k in kept])
    expect = [p + v[:k] for p, v, k in zip(prompts, verified, kept, strict=True)]
    for layer, c in enumerate(cache):
        assert rollback.row_positions(c) == [len(e) for e in expect]
        for row, tokens in enumerate(expect):
            ref = _single_keys(model, tokens)[layer]
            np.testing.assert_allclose(np.array(rollback.row_keys(c, row)), np.array(ref), atol=1e-5)
    # The next step sees only the kept positions: its logits equal a single-request run of each row.
    nxt = [40, 41, 42]
    logits = model(mx.array(nxt)[:, None], cache=cache)[:, -1, :]
    for row, tokens in enumerate(expect):
        ref = model(mx.array([tokens + [nxt[row]]]))[0, -1, :]
        np.testing.assert_allclose(np.array(logits[row]), np.array(ref), atol=1e-4)


# ---- the sampled acceptance rule -------------------------------------------------------------------


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # nothing drawn where the distribution is zero
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


@pytest.mark.parametrize("top_k", [0, 4])
def test_sampled_acceptance_draws_from_the_models_distribution(top_k: int) -> None:
    """Each position's token, drafted or not, follows the row's processed distribution p: the first token over
    all draws, the second over the draws that accepted the first draft (chi-square, 3000 fixed seeds)."""
    vocab = 6
    logits = mx.array(np.random.default_rng(0).normal(size=(3, vocab)) * 1.5, dtype=mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    params = SamplingParams(temperature=0.8, top_k=top_k, max_tokens=8)
    p = np.array(mx.softmax(filtered(params, logprobs), axis=-1))
    drafts = [int(np.argsort(p[0])[-2]), int(np.argmax(p[1]))]  # a likely but not the likeliest first draft
    first, second = np.zeros(vocab), np.zeros(vocab)
    for seed in range(3000):
        v = verify.sampled(drafts, logprobs, lambda lp: filtered(params, lp), key=mx.random.key(seed))
        tokens = [*drafts[: v.accepted], v.token]
        first[tokens[0]] += 1
        if v.accepted >= 1:
            second[tokens[1]] += 1
    # 99.9% quantile of chi-square with 5 degrees of freedom: 20.5.
    assert _chi_square(first, p[0]) < 20.5
    assert second.sum() > 300 and _chi_square(second, p[1]) < 20.5

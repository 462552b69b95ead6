"""Samplers on the tiny real model: a top_k at or above the vocabulary means no top-k filter (validation
cannot know the vocabulary; mlx-lm raises past it), for shared and seeded samplers alike."""

from __future__ import annotations

import mlx.core as mx

from omlx_jobs.jobs.formats import COMPLETIONS_URL, SamplingParams
from omlx_jobs.worker.engine.loop import Engine
from omlx_jobs.worker.engine.results import ItemResult
from omlx_jobs.worker.engine.sequence import WorkItem
from omlx_jobs.worker.extras.sampling import SamplerFactory
from omlx_jobs.worker.models.loaded import LoadedModel


def _run(loaded: LoadedModel, params: list[SamplingParams]) -> dict[int, ItemResult]:
    engine = Engine(loaded)
    tokens = loaded.encode(COMPLETIONS_URL, {"prompt": "Once upon a time"})
    results: dict[int, ItemResult] = {}
    stats = engine.run(
        [WorkItem(i, tokens, p) for i, p in enumerate(params)], lambda rs: results.update({r.key: r for r in rs})
    )
    assert stats.unfinished == []
    return results


def test_top_k_beyond_the_vocabulary_completes(tiny_loaded: LoadedModel) -> None:
    vocab = tiny_loaded.vocab_size
    params = [SamplingParams(max_tokens=8, temperature=1.0, top_k=k) for k in (vocab, vocab + 1, 1_000_000)]
    results = _run(tiny_loaded, params)
    assert len(results) == 3
    for r in results.values():
        assert r.choices[0].completion_tokens >= 1
        assert all(0 <= t < vocab for t in r.choices[0].token_ids)


def test_a_huge_top_k_samples_exactly_as_no_top_k(tiny_loaded: LoadedModel) -> None:
    # Seeded: the same key, so the same tokens unless the filter changed the distribution.
    vocab = tiny_loaded.vocab_size
    results = _run(
        tiny_loaded,
        [SamplingParams(max_tokens=12, temperature=1.0, seed=7, top_k=k) for k in (0, vocab, 1_000_000)],
    )
    ids = [results[i].choices[0].token_ids for i in range(3)]
    assert ids[0] == ids[1] == ids[2]


def test_a_top_k_below_the_vocabulary_still_filters() -> None:
    logits = mx.array([[0.0, 1.0, 2.0, 3.0]])
    sampler = SamplerFactory().sampler(SamplingParams(temperature=1.0, top_k=1))
    assert sampler is not None
    assert {int(sampler(logits - mx.logsumexp(logits)).item()) for _ in range(20)} == {3}
    wide = SamplerFactory().sampler(SamplingParams(temperature=1.0, top_k=10**6))
    assert wide is not None and int(wide(logits).item()) in range(4)  # no ValueError from mlx-lm

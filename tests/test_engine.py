"""The engine on the tiny real model: equivalence with single-request mlx-lm, prefix reuse, stops, disk tier."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from omlx_jobs.jobs.formats import CHAT_URL, COMPLETIONS_URL, SamplingParams
from omlx_jobs.worker.engine.config import EngineConfig
from omlx_jobs.worker.engine.limits import max_new_tokens
from omlx_jobs.worker.engine.loop import Engine
from omlx_jobs.worker.engine.results import ItemResult
from omlx_jobs.worker.engine.sequence import WorkItem
from omlx_jobs.worker.loading import load
from omlx_jobs.worker.models.loaded import LoadedModel
from omlx_jobs.worker.prompts import PromptError
from tests.tiny_model import build_tiny_model

SYSTEMS = [
    "You are a helpful assistant. Answer briefly and clearly, in one sentence. " * 2,
    "Extract the names, dates and places from this document and answer in German. " * 2,
]


def reference(loaded: LoadedModel, tokens: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from single-request mlx_lm.generate_step, stopping at EOS (not included)."""
    out = []
    for tok, _ in generate_step(mx.array(tokens), loaded.model, max_tokens=max_tokens):
        t = int(tok)
        if t in loaded.tokenizer.eos_token_ids:
            break
        out.append(t)
    return out


def mixed_prompts(loaded: LoadedModel) -> list[list[int]]:
    prompts = []
    for s, system in enumerate(SYSTEMS):
        for i in range(6):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {s}.{i} fox"}]
            prompts.append(loaded.encode(CHAT_URL, {"messages": messages}))
    # A conversation whose earlier turn is a prefix of the later one.
    turn1 = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": "hello there"}]
    prompts.append(loaded.encode(CHAT_URL, {"messages": turn1}))
    turn2 = [*turn1, {"role": "assistant", "content": "Paris"}, {"role": "user", "content": "and Germany?"}]
    prompts.append(loaded.encode(CHAT_URL, {"messages": turn2}))
    for text in ("Once upon a time", "The quick brown fox", "0123"):
        prompts.append(loaded.encode(COMPLETIONS_URL, {"prompt": text}))
    return prompts


def run(engine: Engine, items: list[WorkItem]) -> dict[int, ItemResult]:
    results: dict[int, ItemResult] = {}
    stats = engine.run(items, lambda rs: results.update({r.key: r for r in rs}))
    assert stats.unfinished == []
    return results


def greedy(max_tokens: int = 10, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("prefix_cache", [False, True])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_job_equals_single_request_generate(tiny_loaded: LoadedModel, prefix_cache: bool, batch: int) -> None:
    prompts = mixed_prompts(tiny_loaded)
    engine = Engine(
        tiny_loaded,
        EngineConfig(prefix_cache=prefix_cache, completion_batch_size=batch, prefill_batch_size=2, min_shared_tokens=8),
    )
    results = run(engine, [WorkItem(i, p, greedy()) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert results[i].choices[0].token_ids == reference(tiny_loaded, p, 10), f"prompt {i}"
    if prefix_cache:
        assert sum(r.cached_tokens for r in results.values()) > 0
    else:
        assert all(r.cached_tokens == 0 for r in results.values())


def test_prefix_reuse_computes_each_shared_token_once(tiny_loaded: LoadedModel) -> None:
    prompts = mixed_prompts(tiny_loaded)
    # With every shared node worth a warm-up (min 1 token), nothing shared is computed twice.
    engine = Engine(tiny_loaded, EngineConfig(cache_memory=None, min_shared_tokens=1))
    items = [WorkItem(i, p, greedy(4)) for i, p in enumerate(prompts)]
    results: dict[int, ItemResult] = {}
    stats = engine.run(items, lambda rs: results.update({r.key: r for r in rs}))
    assert stats.prefill_tokens == stats.trie_min_tokens  # every distinct prompt token computed once
    assert stats.prompt_tokens == sum(len(p) for p in prompts)
    # Per request, cached tokens are the prompt tokens not computed for it; a warm-up's tokens are charged to
    # the first request that reuses them (worker/engine/charges.py), so the requests' computed tokens add up to the
    # job's.
    uncached = sum(r.prompt_tokens - r.cached_tokens for r in results.values())
    assert uncached == stats.prefill_tokens and stats.warmup_tokens > 0
    for i, p in enumerate(prompts):
        assert results[i].choices[0].token_ids == reference(tiny_loaded, p, 4)


def test_n_copies_share_the_prompt_and_greedy_copies_agree(tiny_loaded: LoadedModel) -> None:
    prompt = tiny_loaded.encode(
        CHAT_URL, {"messages": [{"role": "system", "content": SYSTEMS[1]}, {"role": "user", "content": "four answers"}]}
    )
    engine = Engine(tiny_loaded, EngineConfig(cache_memory=None, min_shared_tokens=8))
    results: dict[int, ItemResult] = {}
    stats = engine.run([WorkItem(0, prompt, greedy(6, n=4))], lambda rs: results.update({r.key: r for r in rs}))
    ref = reference(tiny_loaded, prompt, 6)
    assert [c.token_ids for c in results[0].choices] == [ref] * 4
    assert stats.prefill_tokens == len(prompt)  # the prompt was computed once for all four
    assert stats.first_token_reuses == 4
    assert results[0].completion_tokens == 4 * 6


def test_seeded_sampling_is_reproducible_and_independent_of_batching(tiny_loaded: LoadedModel) -> None:
    prompts = mixed_prompts(tiny_loaded)[:6]
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=7, n=2)

    def sample(batch: int) -> list[list[list[int]]]:
        engine = Engine(tiny_loaded, EngineConfig(completion_batch_size=batch, min_shared_tokens=8))
        res = run(engine, [WorkItem(i, p, params) for i, p in enumerate(prompts)])
        return [[c.token_ids for c in res[i].choices] for i in range(len(prompts))]

    a, b = sample(8), sample(1)
    assert a == b
    assert any(choices[0] != choices[1] for choices in a)  # choice 1 uses seed + 1


def test_stop_strings_cut_the_text_and_stop_generation(tiny_loaded: LoadedModel) -> None:
    prompt = tiny_loaded.encode(COMPLETIONS_URL, {"prompt": "The quick brown fox"})
    ref = reference(tiny_loaded, prompt, 12)
    full = tiny_loaded.tokenizer.decode(ref)
    stop = full[len(tiny_loaded.tokenizer.decode(ref[:3])) :][:2]  # text that first appears after 3 tokens
    assert stop and full.find(stop) >= 0
    engine = Engine(tiny_loaded)
    res = run(engine, [WorkItem(0, prompt, greedy(12, stop=(stop,)))])[0].choices[0]
    assert res.finish_reason == "stop"
    assert res.text == full[: full.find(stop)]
    assert res.completion_tokens < 12


def test_length_and_eos_finish_reasons(tiny_model_dir: Path) -> None:
    loaded = load(str(tiny_model_dir))
    prompt = loaded.encode(COMPLETIONS_URL, {"prompt": "Once upon a time"})
    ref = reference(loaded, prompt, 6)
    res = run(Engine(loaded), [WorkItem(0, prompt, greedy(6))])[0].choices[0]
    assert (res.finish_reason, res.completion_tokens, res.token_ids) == ("length", 6, ref)
    # Make the 3rd greedy token an end-of-sequence token: generation stops there and drops it.
    loaded.tokenizer.add_eos_token(loaded.tokenizer.decode([ref[2]]))
    if ref[2] not in loaded.tokenizer.eos_token_ids:
        pytest.skip("token is not addressable as a string")
    res = run(Engine(loaded), [WorkItem(0, prompt, greedy(6))])[0].choices[0]
    assert res.finish_reason == "stop"
    assert res.token_ids == ref[: ref.index(ref[2])]


def test_prompt_over_the_context_is_rejected(tiny_loaded: LoadedModel) -> None:
    engine = Engine(tiny_loaded)
    with pytest.raises(PromptError) as err:
        engine.check([5] * tiny_loaded.context_length, greedy())
    assert err.value.code == "context_length_exceeded"
    engine.check([5] * (tiny_loaded.context_length - 1), greedy())
    assert max_new_tokens(tiny_loaded.context_length - 3, greedy(100), tiny_loaded.context_length) == 3


def test_small_cache_budget_still_correct_and_evicts(tiny_loaded: LoadedModel) -> None:
    prompts = mixed_prompts(tiny_loaded)
    engine = Engine(tiny_loaded, EngineConfig(cache_memory=1, min_shared_tokens=8))
    results = run(engine, [WorkItem(i, p, greedy(5)) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert results[i].choices[0].token_ids == reference(tiny_loaded, p, 5)
    assert engine.cache.stats.evictions > 0
    assert engine.cache.stats.bytes <= 1  # nothing kept once the groups finished


def test_disk_tier_survives_restart_and_corrupt_files(tiny_loaded: LoadedModel, tmp_path: Path) -> None:
    prompts = mixed_prompts(tiny_loaded)
    items = [WorkItem(i, p, greedy(5)) for i, p in enumerate(prompts)]
    config = EngineConfig(cache_dir=str(tmp_path / "cache"), min_shared_tokens=8)
    first = Engine(tiny_loaded, config)
    expected = run(first, items)
    files = sorted((tmp_path / "cache" / tiny_loaded.identity).glob("*.safetensors"))
    assert files, "warm-up prefixes were saved"

    restarted = Engine(tiny_loaded, config)  # a new worker: empty memory cache, same disk
    results: dict[int, ItemResult] = {}
    stats = restarted.run(items, lambda rs: results.update({r.key: r for r in rs}))
    assert stats.disk_hits > 0
    assert {k: r.choices[0].token_ids for k, r in results.items()} == {
        k: r.choices[0].token_ids for k, r in expected.items()
    }

    files[0].write_bytes(b"not a safetensors file")
    again = Engine(tiny_loaded, config)
    results = run(again, items)
    assert {k: r.choices[0].token_ids for k, r in results.items()} == {
        k: r.choices[0].token_ids for k, r in expected.items()
    }


def test_caches_never_cross_models(tiny_loaded: LoadedModel, tmp_path: Path) -> None:
    other = load(str(build_tiny_model(tmp_path / "other", seed=1)))
    assert other.identity != tiny_loaded.identity
    prompts = mixed_prompts(tiny_loaded)
    items = [WorkItem(i, p, greedy(5)) for i, p in enumerate(prompts)]
    config = EngineConfig(cache_dir=str(tmp_path / "cache"), min_shared_tokens=8)
    run(Engine(tiny_loaded, config), items)
    engine = Engine(other, config)
    assert engine.disk is not None and len(engine.disk) == 0  # the first model's files are not visible
    results: dict[int, ItemResult] = {}
    engine.run(items, lambda rs: results.update({r.key: r for r in rs}))
    for i, p in enumerate(prompts):
        assert results[i].choices[0].token_ids == reference(other, p, 5)


def test_short_identical_prompts_are_computed_once(tiny_loaded: LoadedModel) -> None:
    prompt = tiny_loaded.encode(COMPLETIONS_URL, {"prompt": "0123"})
    assert len(prompt) < 16
    engine = Engine(tiny_loaded, EngineConfig(cache_memory=None))
    results: dict[int, ItemResult] = {}
    items = [WorkItem(i, prompt, greedy(5, n=2)) for i in range(3)]
    stats = engine.run(items, lambda rs: results.update({r.key: r for r in rs}))
    assert stats.prefill_tokens == stats.trie_min_tokens == len(prompt)
    ref = reference(tiny_loaded, prompt, 5)
    assert all(c.token_ids == ref for r in results.values() for c in r.choices)

"""The engine's seams on the tiny real model: pages, released results, clean-up after errors, a disk tier that
cannot write, and the backend's rows (cached prefixes in, tokens and logprobs out)."""

from __future__ import annotations

import errno
import gc
import logging
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from omlx_jobs.jobs.formats import COMPLETIONS_URL
from omlx_jobs.worker.backend.decode import DecodeBatch
from omlx_jobs.worker.backend.rows import RowSpec
from omlx_jobs.worker.cache import disk as disk_cache
from omlx_jobs.worker.cache.prefix_cache import Entry, Match
from omlx_jobs.worker.engine.config import EngineConfig
from omlx_jobs.worker.engine.loop import Engine
from omlx_jobs.worker.engine.results import ItemResult
from omlx_jobs.worker.engine.sequence import WorkItem
from omlx_jobs.worker.models.loaded import LoadedModel
from omlx_jobs.worker.prompts import token_key
from tests.test_engine import greedy, mixed_prompts, reference, run


def token_ids(results: dict[Any, ItemResult]) -> dict[Any, list[list[int]]]:
    return {k: [c.token_ids for c in r.choices] for k, r in results.items()}


def test_pages_read_lazily_give_the_same_tokens(tiny_loaded: LoadedModel) -> None:
    prompts = mixed_prompts(tiny_loaded)
    config = EngineConfig(completion_batch_size=3, prefill_batch_size=2, min_shared_tokens=8)
    whole = run(Engine(tiny_loaded, config), [WorkItem(i, p, greedy(5)) for i, p in enumerate(prompts)])
    read: list[int] = []

    def lazily() -> Iterator[WorkItem]:
        for i, p in enumerate(prompts):
            read.append(i)
            yield WorkItem(i, p, greedy(5))

    results: dict[Any, ItemResult] = {}
    read_at_first_result: list[int] = []

    def on_results(rs: list[ItemResult]) -> None:
        read_at_first_result.append(len(read))
        results.update({r.key: r for r in rs})

    stats = Engine(tiny_loaded, config).run(lazily(), on_results, page_size=4)
    assert read_at_first_result[0] < len(prompts)  # the first results came before the whole shard was read
    assert stats.input_exhausted and stats.unfinished == []
    assert token_ids(results) == token_ids(whole)


def test_finished_results_are_dropped_once_handed_out(tiny_loaded: LoadedModel) -> None:
    prompt = tiny_loaded.encode(COMPLETIONS_URL, {"prompt": "Once upon a time"})
    engine = Engine(tiny_loaded, EngineConfig(completion_batch_size=2, prefill_batch_size=1))
    handed: list[weakref.ref[Any]] = []
    alive_later: list[int] = []

    def on_results(rs: list[ItemResult]) -> None:
        gc.collect()
        alive_later.append(sum(ref() is not None for ref in handed))  # results of earlier steps still held
        handed.extend(weakref.ref(c) for r in rs for c in r.choices)

    stats = engine.run([WorkItem(i, prompt + [i + 10], greedy(3, n=2)) for i in range(40)], on_results)
    assert len(handed) == 80 and set(alive_later) == {0}
    assert stats.peak_live_items <= engine.window  # bounded by the batch, not by the 40 items


def test_a_failing_run_cleans_up_and_raises_its_own_error(tiny_loaded: LoadedModel, monkeypatch: Any) -> None:
    prompts = mixed_prompts(tiny_loaded)
    items = [WorkItem(i, p, greedy(4)) for i, p in enumerate(prompts)]
    engine = Engine(tiny_loaded, EngineConfig(cache_memory=None, min_shared_tokens=8, completion_batch_size=2))
    closed: list[DecodeBatch] = []
    real_close = DecodeBatch.close

    def close_then_fail(self: DecodeBatch) -> Any:
        real_close(self)
        closed.append(self)
        raise AttributeError("an mlx-lm internal moved")

    def on_results(rs: list[ItemResult]) -> None:
        if len(engine.cache.lifetimes):  # fail while warm-up prefixes are held
            raise RuntimeError("the store went away")

    monkeypatch.setattr(DecodeBatch, "close", close_then_fail)
    with pytest.raises(RuntimeError, match="the store went away"):
        engine.run(items, on_results)
    assert len(closed) == 1 and len(engine.cache.lifetimes) == 0  # closed, and every hold released
    assert all(e.pins == 0 for e in engine.cache.entries())
    with pytest.raises(AttributeError, match="moved"):  # without an earlier error, a clean-up error is raised
        engine.run(items[:2], lambda rs: None)
    monkeypatch.undo()
    assert run(engine, items)[0].choices[0].token_ids == reference(tiny_loaded, prompts[0], 4)


def test_a_full_disk_never_stops_generation(
    tiny_loaded: LoadedModel, tmp_path: Path, monkeypatch: Any, caplog: Any
) -> None:
    def no_space(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    prompts = mixed_prompts(tiny_loaded)
    items = [WorkItem(i, p, greedy(4)) for i, p in enumerate(prompts)]
    monkeypatch.setattr(disk_cache.tempfile, "mkstemp", no_space)
    engine = Engine(tiny_loaded, EngineConfig(cache_dir=str(tmp_path / "cache"), min_shared_tokens=8))
    with caplog.at_level(logging.WARNING, logger=disk_cache.__name__):
        results = run(engine, items)
    assert "No space left on device" in caplog.text
    assert engine.disk is not None and len(engine.disk) == 0
    assert list((tmp_path / "cache").rglob("*.safetensors")) == []
    for i, p in enumerate(prompts):
        assert results[i].choices[0].token_ids == reference(tiny_loaded, p, 4)


def test_a_failed_save_leaves_no_files(tiny_loaded: LoadedModel, tmp_path: Path, monkeypatch: Any) -> None:
    def broken(path: str, *args: Any, **kwargs: Any) -> None:
        Path(path).write_bytes(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    disk = disk_cache.DiskCache(tmp_path, tiny_loaded.identity, max_bytes=1 << 30)
    monkeypatch.setattr(disk_cache, "save_prompt_cache", broken)
    disk.save(token_key([1, 2, 3]), [])
    assert len(disk) == 0 and list(disk.dir.iterdir()) == []


def test_encode_reads_the_vocabulary_size_once(tiny_loaded: LoadedModel, monkeypatch: Any) -> None:
    calls = []
    real = type(tiny_loaded).vocab_size

    def counted(self: LoadedModel) -> int:
        calls.append(1)
        return real.fget(self)  # type: ignore[attr-defined, no-any-return]

    monkeypatch.setattr(type(tiny_loaded), "vocab_size", property(counted))
    assert tiny_loaded.encode(COMPLETIONS_URL, {"prompt": list(range(5, 305))}) == list(range(5, 305))
    assert len(calls) == 1


def test_backend_rows_start_from_a_cached_prefix_and_return_logprobs(tiny_loaded: LoadedModel) -> None:
    """What a vision or cascade module uses: a row inserted from a precomputed cache decodes as if it had run
    the whole prompt, and each step's logprobs are the distribution its token was chosen from."""
    engine = Engine(tiny_loaded)
    prompt = mixed_prompts(tiny_loaded)[0]
    cut = len(prompt) - 3
    ((caches, _),) = engine.backend.prefill([None], [prompt[:cut]], [set()])
    entry = Entry(token_key(prompt[:cut]), caches, 0)
    batch = engine.backend.open()
    try:
        rows = batch.insert(
            [
                RowSpec(prompt=prompt[cut:], max_tokens=6, prefix=Match(entry, cut), context=prompt[:cut]),
                RowSpec(prompt=list(prompt), max_tokens=6),
            ]
        )
        tokens: dict[int, list[int]] = {r: [] for r in rows}
        finished: set[int] = set()
        while len(finished) < 2:
            for out in batch.step():
                (token,) = out.tokens
                (logprobs,) = out.logprobs
                assert int(mx.argmax(logprobs).item()) == token  # greedy: the top of its own distribution
                assert abs(float(mx.logsumexp(logprobs).item())) < 1e-4  # normalized
                tokens[out.row].append(token)
                if out.finish is not None:
                    finished.add(out.row)
    finally:
        batch.close()
    ref = reference(tiny_loaded, prompt, 6)
    assert tokens[rows[0]][: len(ref)] == ref and tokens[rows[1]] == tokens[rows[0]]

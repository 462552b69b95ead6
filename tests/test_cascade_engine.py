"""Cascade attention through the real engine (tiny qwen3, fp32, CPU): rows reference their cached prefix.

The same jobs run with cascade on (worker/backend/cascade_batch.py) and off (each row holds a copy of its prefix,
today's path): greedy token ids must be equal, batched and single, with one- and two-level prefixes (a system prompt,
then a document) and several groups per batch; the logits of the two batches agree; the batch holds one copy of
a group's prefix; and every pin a row took is released when it leaves.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections import Counter
from typing import Any

import mlx.core as mx
import pytest

from omlx_jobs.defaults import Switches
from omlx_jobs.jobs.formats import SamplingParams
from omlx_jobs.worker.attention import cascade
from omlx_jobs.worker.attention import fused as cascade_fused
from omlx_jobs.worker.backend.cascade_batch import CascadeBatch, PrefixLevels
from omlx_jobs.worker.backend.cascade_cache import OWN_STEP
from omlx_jobs.worker.backend.decode import DecodeBatch
from omlx_jobs.worker.backend.rows import RowSpec
from omlx_jobs.worker.engine.config import EngineConfig
from omlx_jobs.worker.engine.loop import Engine
from omlx_jobs.worker.engine.results import ItemResult
from omlx_jobs.worker.engine.sequence import WorkItem
from omlx_jobs.worker.models.loaded import LoadedModel
from tests.cascade_cases import count_calls


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 380) for _ in range(n)]


def job_prompts(seed: int = 0) -> list[list[int]]:
    """Two documents after one system prompt (two levels), a second system prompt alone (one level), a prompt
    that is exactly a document (its whole prompt cached), prompts sharing nothing."""
    rng = random.Random(seed)
    system, other = toks(rng, 40), toks(rng, 48)
    docs = [toks(rng, 36), toks(rng, 44)]
    prompts = [system + doc + toks(rng, rng.randrange(3, 12)) for doc in docs for _ in range(5)]
    prompts += [system + toks(rng, rng.randrange(4, 9)) for _ in range(3)]
    prompts += [other + toks(rng, rng.randrange(2, 10)) for _ in range(4)]
    prompts += [system + docs[0], toks(rng, 20), toks(rng, 7)]
    rng.shuffle(prompts)  # the planner orders them
    return prompts


def greedy(max_tokens: int = 8, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n)


REFERENCE_ALL = (0.0, 0.0, 1.0, False)
"""Device costs under which the cost model references every level (the tests of the referencing paths)."""


def switched(**kw: Any) -> Switches:
    """The environment's switches (the defaults here, every level referenced), with some set."""
    return dataclasses.replace(Switches.from_env(), **{"level_costs": REFERENCE_ALL, **kw})


def run_job(
    loaded: LoadedModel, prompts: list[list[int]], *, use: bool, batch: int, switches: Switches | None = None
) -> dict[int, Any]:
    config = EngineConfig(
        completion_batch_size=batch,
        prefill_batch_size=3,
        min_shared_tokens=8,
        cache_memory=None,
        switches=dataclasses.replace(switches or switched(), cascade=use),
    )
    engine = Engine(loaded, config)
    assert engine.backend.cascade is use
    results: dict[int, ItemResult] = {}
    items = [WorkItem(i, p, greedy(8, n=2 if i == 0 else 1)) for i, p in enumerate(prompts)]
    stats = engine.run(items, lambda rs: results.update({r.key: r for r in rs}))
    assert stats.unfinished == []
    assert len(engine.cache.lifetimes) == 0 and all(e.pins == 0 for e in engine.cache.entries())
    return {k: ([c.token_ids for c in r.choices], r.cached_tokens) for k, r in results.items()}


@pytest.fixture
def chains(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of levels of each row admitted from a cached prefix."""
    seen: list[int] = []
    real = PrefixLevels.path

    def spy(self: PrefixLevels, match: Any) -> Any:
        cuts, end = real(self, match)
        seen.append(len(cuts))
        return cuts, end

    monkeypatch.setattr(PrefixLevels, "path", spy)
    return seen


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_greedy_tokens_equal_todays_path(tiny_loaded: LoadedModel, batch: int, chains: list[int]) -> None:
    prompts = job_prompts()
    today = run_job(tiny_loaded, prompts, use=False, batch=batch)
    assert not chains
    ours = run_job(tiny_loaded, prompts, use=True, batch=batch)
    assert ours == today  # token ids and cached tokens
    assert sum(cached for _, cached in ours.values()) > 0
    assert 1 in chains and 2 in chains  # one- and two-level prefixes


def test_several_groups_share_one_batch(tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """At batch 16 the decode steps attend to the system prompt, both documents and the other prompt at once."""
    levels_seen: list[int] = []
    real = cascade.attention

    def spy(q: mx.array, k: mx.array, v: mx.array, levels: Any, *args: Any, **kwargs: Any) -> mx.array:
        if q.shape[2] == 1:
            levels_seen.append(len(levels))
        return real(q, k, v, levels, *args, **kwargs)

    monkeypatch.setattr(cascade, "attention", spy)
    prompts = job_prompts(seed=1)
    assert run_job(tiny_loaded, prompts, use=True, batch=16) == run_job(tiny_loaded, prompts, use=False, batch=16)
    assert max(levels_seen) >= 4


def test_short_levels_fold_into_the_rows(tiny_loaded: LoadedModel) -> None:
    """With levels of at least 64 tokens the documents' 36 and 44 become copied tails: same tokens."""
    prompts = job_prompts(seed=2)
    folded = run_job(tiny_loaded, prompts, use=True, batch=8, switches=switched(min_level_tokens=64))
    assert folded == run_job(tiny_loaded, prompts, use=False, batch=8)


@pytest.mark.parametrize("batch", [1, 5, 16])
@pytest.mark.parametrize(
    "costs", [(1.0, 1.0, 0.0, False), (60.0, 0.0, 1.0, False), None], ids=["copy-all", "mixed", "measured"]
)
def test_levels_the_cost_model_copies_give_todays_tokens(
    tiny_loaded: LoadedModel, batch: int, costs: Any, chains: list[int]
) -> None:
    """The cost model copies every level ("copy-all"), the short documents shared by few rows while the system
    prompt is referenced ("mixed": a reference costs 60 row-tokens), or what the CPU measured at start-up; rows
    join and leave the batch as they finish: the same greedy tokens as today's path."""
    prompts = job_prompts(seed=8)
    today = run_job(tiny_loaded, prompts, use=False, batch=batch)
    switches = switched(level_costs=costs)
    assert run_job(tiny_loaded, prompts, use=True, batch=batch, switches=switches) == today
    assert chains
    if costs == (1.0, 1.0, 0.0, False):
        assert set(chains) == {0}
    if costs == (60.0, 0.0, 1.0, False) and batch == 16:
        assert 0 in chains and max(chains) >= 1


@pytest.mark.parametrize("batch", [1, 5, 16])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_every_level_in_one_packed_call_gives_todays_tokens(
    tiny_loaded: LoadedModel, batch: int, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPUs attend a decode step's levels in one masked call over their packed keys (attention/packed.py); forced
    here on the CPU, compiled or not, as rows join and leave a batch of several groups and one or two levels."""
    from omlx_jobs.worker.attention import packed

    calls = count_calls(monkeypatch, packed, "decode")
    prompts = job_prompts(seed=9)
    today = run_job(tiny_loaded, prompts, use=False, batch=batch)
    switches = switched(cascade_packed="always", cascade_compile="always" if compiled else "never")
    assert run_job(tiny_loaded, prompts, use=True, batch=batch, switches=switches) == today
    assert calls() > 0


def test_the_switch_and_models_that_cannot_take_it(tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMLX_JOBS_CASCADE", "0")
    assert EngineConfig().switches.cascade is False
    monkeypatch.delenv("OMLX_JOBS_CASCADE")
    engine = Engine(tiny_loaded, EngineConfig())
    assert engine.backend.cascade and isinstance(engine.backend.open(engine.cache), CascadeBatch)
    assert type(Engine(tiny_loaded, EngineConfig(prefix_cache=False)).backend.open(None)) is DecodeBatch
    monkeypatch.setattr(tiny_loaded.model, "model_type", "gpt2")  # say, a model whose attention we have not wrapped
    engine = Engine(tiny_loaded, EngineConfig())
    assert not engine.backend.cascade and type(engine.backend.open(engine.cache)) is DecodeBatch


def warm_engine(loaded: LoadedModel, prompts: list[list[int]], **switches: Any) -> Engine:
    """An engine whose prefix cache holds every shared prefix of `prompts` (a run made them)."""
    config = EngineConfig(cache_memory=None, min_shared_tokens=8, prefill_batch_size=3, switches=switched(**switches))
    engine = Engine(loaded, config)
    engine.run([WorkItem(i, p, greedy(1)) for i, p in enumerate(prompts)], lambda rs: None)
    return engine


def rows_of(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[RowSpec]:
    rows = []
    for p in prompts:
        match = engine.cache.lookup(WorkItem(0, p, greedy()).prompt.key, limit=len(p) - 1, count=False)
        n = match.length if match is not None else 0
        rows.append(RowSpec(prompt=p[n:], max_tokens=max_tokens, prefix=match, context=p[:n]))
    return rows


def decode(batch: Any, rows: list[RowSpec]) -> tuple[dict[int, list[int]], dict[int, list[mx.array]]]:
    ids = batch.insert(rows)
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    logprobs: dict[int, list[mx.array]] = {i: [] for i in ids}
    running = set(ids)
    while running:
        for out in batch.step():
            tokens[out.row] += out.tokens
            logprobs[out.row] += out.logprobs
            if out.finish is not None:
                running.discard(out.row)
    batch.close()
    return tokens, logprobs


def test_logits_agree_with_todays_path(tiny_loaded: LoadedModel) -> None:
    prompts = job_prompts(seed=3)
    engine = warm_engine(tiny_loaded, prompts)
    rows = rows_of(engine, prompts, 6)
    assert sum(r.prefix is not None for r in rows) >= 10
    today, today_lp = decode(DecodeBatch(engine.backend), rows)
    ours, ours_lp = decode(engine.backend.open(engine.cache), rows_of(engine, prompts, 6))
    assert list(ours.values()) == list(today.values())
    worst = max(
        mx.abs(a - b).max().item()
        for la, lb in zip(ours_lp.values(), today_lp.values(), strict=True)
        for a, b in zip(la, lb, strict=True)
    )
    assert worst < 1e-4
    assert len(engine.cache.lifetimes) == 0  # the batch released the pins its rows took


def test_a_group_holds_its_suffixes_and_one_prefix(tiny_loaded: LoadedModel) -> None:
    """Bytes the batch cache holds for 12 rows over a system prompt and a document: suffixes plus one prefix."""
    rng = random.Random(4)
    system, doc = toks(rng, 40), toks(rng, 60)
    prompts = [system + doc + toks(rng, 6) for _ in range(12)]
    engine = warm_engine(tiny_loaded, prompts, speculation="off")  # a rollback reshapes the own buffers
    model = tiny_loaded.model
    layers, args = len(model.layers), model.args
    per_token = layers * 2 * args.num_key_value_heads * args.head_dim * 4  # keys and values, float32
    prefix = 100 * per_token

    def held(batch: Any) -> tuple[int, int]:
        mx.eval(model.parameters())
        before = mx.get_active_memory()
        waiting = set(batch.insert(rows_of(engine, prompts, 16)))
        while waiting:  # prefill in batches of 3, then decode steps: until every row generates
            waiting -= {out.row for out in batch.step()}
        nbytes, grown = batch.cache_nbytes(), mx.get_active_memory() - before
        batch.close()
        return nbytes, grown

    cascade_bytes, cascade_grown = held(engine.backend.open(engine.cache))
    suffixes = 12 * OWN_STEP * per_token  # each row's own tokens (7 + 2 generated) in one allocation step
    assert cascade_bytes == suffixes + prefix
    today_bytes, today_grown = held(DecodeBatch(engine.backend))
    assert today_bytes >= 12 * (prefix + 7 * per_token)  # today every row holds its own copy of the prefix
    assert cascade_grown < today_grown / 2


def test_the_cuda_path_with_its_kernels_references(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What runs on CUDA (the ragged kernel for rows without levels, the cascade kernel for own suffixes), with
    each kernel's mx-ops reference in its place, on a model with 64-wide heads: today's tokens."""
    from omlx_jobs.worker.attention.kernels import ragged as attention
    from omlx_jobs.worker.attention.kernels import suffix as cascade_kernel
    from omlx_jobs.worker.loading import load
    from tests.tiny_model import build_tiny_model

    wide = load(str(build_tiny_model(tmp_path_factory.mktemp("wide") / "m", hidden_size=256)))
    calls: Counter[str] = Counter()

    def counted(name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            calls[name] += 1
            return fn(*args)

        return call

    prompts = job_prompts(seed=5)
    today = run_job(wide, prompts, use=False, batch=8, switches=switched(ragged_decode=False))
    monkeypatch.setattr(attention, "available", lambda: True)
    monkeypatch.setattr(attention, "ragged_decode", counted("ragged", attention.ragged_reference))
    monkeypatch.setattr(cascade_kernel, "suffix_decode", counted("cascade", cascade_kernel.suffix_decode_reference))
    assert run_job(wide, prompts, use=True, batch=8) == today
    assert calls["cascade"] > 0
    assert run_job(wide, prompts, use=False, batch=8) == today
    assert calls["ragged"] > 0


def test_fused_prefill_of_one_group_equals_todays_path(
    tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPUs prefill a window whose rows all continue the same levels through mlx's fused attention over the levels
    (broadcast for the layer) and the own keys (cascade_fused.prefill); forced here on the CPU."""
    fused = count_calls(monkeypatch, cascade_fused, "prefill")
    prompts = job_prompts(seed=3)
    on = run_job(tiny_loaded, prompts, use=True, batch=4, switches=switched(cascade_fused_prefill="always"))
    assert fused() > 0
    assert on == run_job(tiny_loaded, prompts, use=False, batch=4, switches=switched(cascade_fused_prefill="never"))


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix-kernel", "prefix-mx"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_cuda_path_with_the_prefix_kernel_reference(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, compiled: bool, prefix: bool
) -> None:
    """Both cascade kernels (the prefix levels' and the own suffixes'; or the levels in mx ops), each as its mx-ops
    reference, through a continuous batch whose size changes as rows finish and are admitted, compiled as on GPUs:
    today's tokens."""
    from omlx_jobs.worker.attention import cascade_decode
    from omlx_jobs.worker.attention.kernels import prefix as cascade_prefix
    from omlx_jobs.worker.attention.kernels import ragged as attention
    from omlx_jobs.worker.attention.kernels import suffix as cascade_kernel
    from omlx_jobs.worker.loading import load
    from tests.tiny_model import build_tiny_model

    wide = load(str(build_tiny_model(tmp_path_factory.mktemp("wide") / "m", hidden_size=256)))
    prompts = job_prompts(seed=7)
    today = run_job(wide, prompts, use=False, batch=5, switches=switched(ragged_decode=False))
    monkeypatch.setattr(attention, "available", lambda: True)
    monkeypatch.setattr(attention, "ragged_decode", attention.ragged_reference)
    monkeypatch.setattr(cascade_kernel, "suffix_decode", cascade_kernel.suffix_decode_reference)
    # The job's levels (up to 48 tokens) in several parts of at least 8 keys.
    split = functools.partial(cascade_prefix.prefix_decode_reference, min_split=8)
    monkeypatch.setattr(cascade_prefix, "prefix_decode", split)
    suffix_calls = count_calls(monkeypatch, cascade_kernel, "suffix_decode")
    prefix_calls = count_calls(monkeypatch, cascade_prefix, "prefix_decode")
    monkeypatch.setattr(cascade_decode, "prefix_supported", lambda *a: True)  # the tiny model is float32
    switches = switched(cascade_compile="always" if compiled else "never", cascade_prefix_kernel=prefix)
    assert run_job(wide, prompts, use=True, batch=5, switches=switches) == today
    assert (prefix_calls() > 0) is prefix and suffix_calls() > 0

"""CascadeKVCache through the real model (tiny qwen3, fp32, CPU), without the engine.

Today's path: each row holds its whole prompt (a KVCache view of its cached prefix, merged by mlx-lm). The
cascade path: each row references its shared prefix levels and holds only its own suffix. Both run the same
suffixes through mlx-lm's BatchGenerator (prefill in chunks, decode, rows finishing at different steps, rows
admitted while others decode) or through the model directly; tokens and logits must agree.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from omlx_jobs.worker.attention import cascade, routing
from omlx_jobs.worker.attention.kernels import suffix as cascade_kernel
from omlx_jobs.worker.attention.options import CascadeOptions, Routing
from omlx_jobs.worker.backend.cascade_cache import OWN_STEP, CascadeKVCache, SharedPrefix, SharedPrefixes, row_caches
from omlx_jobs.worker.cache import kv
from omlx_jobs.worker.loading import load
from omlx_jobs.worker.models.loaded import LoadedModel
from tests.tiny_model import build_tiny_model


@dataclass
class Row:
    prefix: list[int]
    full: list[Any] | None
    """Today's path: the KVCache holding the whole cached prefix."""
    chain: list[SharedPrefix]
    suffix: list[int]


@dataclass
class Prefixes:
    rows: list[Row]
    system: SharedPrefix
    doc_a: SharedPrefix
    layers: int


def _prefill(model: Any, tokens: list[int], base: list[Any] | None = None) -> list[Any]:
    caches = copy.deepcopy(base) if base is not None else make_prompt_cache(model)
    model(mx.array([tokens]), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


@pytest.fixture(scope="module")
def prefixes(tiny_loaded: LoadedModel) -> Prefixes:
    return make_prefixes(tiny_loaded.model)


def make_prefixes(model: Any) -> Prefixes:
    """A system prompt shared by 5 rows, two documents after it (2-level chains), a second group, a plain row."""
    assert routing.install(model)
    mx.random.seed(3)
    vocab = model.args.vocab_size

    def tokens(n: int) -> list[int]:
        return mx.random.randint(0, vocab, (n,)).tolist()

    system, doc_a, doc_b, other = tokens(40), tokens(30), tokens(25), tokens(33)
    c_sys = _prefill(model, system)
    c_a, c_b = _prefill(model, doc_a, c_sys), _prefill(model, doc_b, c_sys)
    c_other = _prefill(model, other)
    p_sys = SharedPrefix.from_caches(c_sys, 0, 40)
    p_a, p_b = SharedPrefix.from_caches(c_a, 40, 70), SharedPrefix.from_caches(c_b, 40, 65)
    p_other = SharedPrefix.from_caches(c_other, 0, 33)
    rows = [
        Row(system + doc_a, c_a, [p_sys, p_a], tokens(5)),
        Row(system + doc_a, c_a, [p_sys, p_a], tokens(9)),
        Row(system + doc_b, c_b, [p_sys, p_b], tokens(3)),
        Row(system, c_sys, [p_sys], tokens(7)),
        Row(other, c_other, [p_other], tokens(4)),
        Row([], None, [], tokens(12)),
        Row(system + doc_a, c_a, [p_sys, p_a], tokens(1)),  # whole prompt cached but its last token
        Row(system + doc_b, c_b, [p_sys, p_b], tokens(6)),
    ]
    return Prefixes(rows, p_sys, p_a, len(model.layers))


def caches_for(row: Row, layers: int, use_cascade: bool) -> list[Any] | None:
    if use_cascade:
        return row_caches(row.chain, layers)
    return kv.view(row.full, len(row.prefix), len(row.prefix)) if row.full is not None else None


def generate(
    model: Any, rows: list[Row], layers: int, use_cascade: bool, *, steps: int = 8, waves: int = 2, step_size: int = 4
) -> tuple[list[list[int]], list[list[mx.array]]]:
    """Greedy tokens and logprobs per row through BatchGenerator, rows inserted in `waves` while others decode."""
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=3, prefill_step_size=step_size)
    uids: list[int] = []
    cut = (len(rows) + waves - 1) // waves
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list[mx.array]] = {}
    for w in range(waves):
        for i, row in enumerate(rows[w * cut : (w + 1) * cut]):
            (uid,) = gen.insert(
                [row.suffix],
                max_tokens=[steps - i % 3],  # rows finish at different steps: the batch is filtered
                caches=[caches_for(row, layers, use_cascade)],
                all_tokens=[list(row.prefix)],
            )
            uids.append(uid)
            tokens[uid], logprobs[uid] = [], []
        for _ in range(3 if w + 1 < waves else 10**6):
            responses = gen.next_generated()
            if not responses:
                break
            for r in responses:
                tokens[r.uid].append(r.token)
                logprobs[r.uid].append(r.logprobs)
    gen.close()
    return [tokens[u] for u in uids], [logprobs[u] for u in uids]


def max_diff(a: list[list[mx.array]], b: list[list[mx.array]]) -> float:
    return max(mx.abs(x - y).max().item() for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


@pytest.mark.parametrize("waves", [1, 2])
def test_batch_generator_gives_todays_tokens_and_logits(
    tiny_loaded: LoadedModel, prefixes: Prefixes, waves: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_loaded.model
    seen: list[tuple[int, int]] = []
    real = cascade.attention

    def spy(q: mx.array, k: mx.array, v: mx.array, levels: Any, *args: Any) -> mx.array:
        seen.append((q.shape[2], len(levels)))
        return real(q, k, v, levels, *args)

    today, today_lp = generate(model, prefixes.rows, prefixes.layers, False, waves=waves)
    monkeypatch.setattr(cascade, "attention", spy)
    ours, ours_lp = generate(model, prefixes.rows, prefixes.layers, True, waves=waves)
    assert ours == today
    assert max_diff(ours_lp, today_lp) < 1e-4
    assert any(n > 1 for n, _ in seen) and any(n == 1 for n, _ in seen)  # prefill chunks and decode steps
    assert max(levels for _, levels in seen) >= 4  # system, two documents, the other group's prompt


def test_a_single_row_and_a_one_group_batch(tiny_loaded: LoadedModel, prefixes: Prefixes) -> None:
    model = tiny_loaded.model
    for rows in ([prefixes.rows[1]], [prefixes.rows[i] for i in (0, 1, 6)]):
        today, today_lp = generate(model, rows, prefixes.layers, False, waves=1)
        ours, ours_lp = generate(model, rows, prefixes.layers, True, waves=1)
        assert ours == today
        assert max_diff(ours_lp, today_lp) < 1e-4


def test_decode_through_the_kernel_contract(tmp_path_factory: pytest.TempPathFactory) -> None:
    """With the CUDA kernel's mx-ops reference in its place (64-wide heads, a size it takes): same tokens."""
    model = load(str(build_tiny_model(tmp_path_factory.mktemp("wide") / "m", hidden_size=256))).model
    wide = make_prefixes(model)
    today, today_lp = generate(model, wide.rows, wide.layers, False)
    calls = []

    def spy(*args: mx.array) -> mx.array:
        calls.append(args[0].shape[0])
        return cascade_kernel.suffix_decode_reference(*args)

    with routing.active(Routing(cascade=CascadeOptions(suffix_kernel=spy))):
        ours, ours_lp = generate(model, wide.rows, wide.layers, True)
    assert ours == today
    assert max_diff(ours_lp, today_lp) < 1e-4
    assert calls and max(calls) > 4


def test_rope_positions_continue_from_the_prefix(
    tiny_loaded: LoadedModel, prefixes: Prefixes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the prefix length in `offset` the outputs change (so the tests above would catch it)."""
    model = tiny_loaded.model
    rows = [prefixes.rows[i] for i in (0, 2, 3)]
    _, today_lp = generate(model, rows, prefixes.layers, False, waves=1)
    monkeypatch.setattr(CascadeKVCache, "offset", property(lambda self: self.own.offset))
    _, ours_lp = generate(model, rows, prefixes.layers, True, waves=1)
    assert max_diff(ours_lp, today_lp) > 1e-2


def cascade_batch(rows: list[Row], layers: int) -> list[CascadeKVCache]:
    """Per-layer batch caches of the rows' cascade caches, as BatchGenerator merges them."""
    per_row = [row_caches(r.chain, layers) for r in rows]
    return [CascadeKVCache.merge([caches[i] for caches in per_row]) for i in range(layers)]


def _right_padded_prefill(model: Any, batch: list[Any], suffixes: list[list[int]]) -> mx.array:
    """What PromptProcessingBatch.prompt does in one chunk: right-pad, prepare, run, finalize; all logits."""
    lengths = [len(s) for s in suffixes]
    longest = max(lengths)
    for c in batch:
        c.prepare(lengths=lengths, right_padding=[longest - n for n in lengths])
    logits = model(mx.array([s + [0] * (longest - len(s)) for s in suffixes]), cache=batch)
    for c in batch:
        c.finalize()
    return logits


def test_prefill_and_decode_logits_equal_the_full_path(tiny_loaded: LoadedModel, prefixes: Prefixes) -> None:
    """The model called directly: every suffix position's logits in the prefill, then 6 greedy decode steps."""
    model = tiny_loaded.model
    rows = prefixes.rows
    full = BatchKVCache.merge
    today = [
        full([caches_for(r, prefixes.layers, False)[i] if r.full is not None else KVCache() for r in rows])
        for i in range(prefixes.layers)
    ]
    ours = cascade_batch(rows, prefixes.layers)
    suffixes = [r.suffix for r in rows]
    a = _right_padded_prefill(model, today, suffixes)
    b = _right_padded_prefill(model, ours, suffixes)
    for i, n in enumerate(len(s) for s in suffixes):
        assert mx.allclose(a[i, :n], b[i, :n], atol=1e-4).item(), f"row {i}"
    tok_a = tok_b = mx.argmax(mx.stack([a[i, len(s) - 1] for i, s in enumerate(suffixes)]), axis=-1)
    for step in range(6):
        la = model(tok_a[:, None], cache=today)[:, -1]
        lb = model(tok_b[:, None], cache=ours)[:, -1]
        assert mx.allclose(la, lb, atol=1e-4).item(), f"step {step}"
        tok_a, tok_b = mx.argmax(la, axis=-1), mx.argmax(lb, axis=-1)
        assert tok_a.tolist() == tok_b.tolist()


def test_a_shared_prefix_is_held_once(tiny_loaded: LoadedModel, prefixes: Prefixes) -> None:
    """Bytes held by the batch cache for a group: its rows' suffixes plus one copy of each prefix level."""
    model = tiny_loaded.model
    group = [r for r in prefixes.rows if r.chain[:2] == [prefixes.system, prefixes.doc_a]]
    assert len(group) == 3
    group = group * 3  # nine rows continuing the system prompt and document A
    layers = prefixes.layers
    mx.eval(prefixes.system.segments[0].keys)
    before = mx.get_active_memory()
    batch = cascade_batch(group, layers)
    logits = _right_padded_prefill(model, batch, [r.suffix for r in group])
    mx.eval(logits, [c.state for c in batch])
    del logits
    grown = mx.get_active_memory() - before

    own = sum(c.own.nbytes for c in batch)
    prefix = prefixes.system.nbytes + prefixes.doc_a.nbytes
    assert sum(c.nbytes for c in batch) == own + prefix
    for c, sys_seg, doc_seg in zip(batch, prefixes.system.segments, prefixes.doc_a.segments, strict=True):
        levels, _ = c.cascade_layout()
        assert len(levels) == 2
        for lv, seg in zip(levels, (sys_seg, doc_seg), strict=True):
            assert lv.keys is seg.keys and lv.values is seg.values
        assert c.own.keys.shape[2] == OWN_STEP  # one allocation step: suffixes of up to 9 tokens
    assert grown <= own * 1.1  # nothing was copied: the levels are views of the prefix entries
    today = sum(BatchKVCache.merge([caches_for(r, layers, False)[i] for r in group]).nbytes for i in range(layers))
    assert today >= len(group) * prefix  # today every row holds its own copy of the prefix


def test_extract_gives_the_row_whole_prompt(tiny_loaded: LoadedModel, prefixes: Prefixes) -> None:
    model = tiny_loaded.model
    rows = prefixes.rows[:4]
    batch = cascade_batch(rows, prefixes.layers)
    _right_padded_prefill(model, batch, [r.suffix for r in rows])
    full = _prefill(model, rows[2].prefix + rows[2].suffix)
    for c, f in zip(batch, full, strict=True):
        one = c.extract(2)
        assert one.chains == [c.chains[2]]
        whole = one.to_kv_cache()
        assert whole.offset == f.offset == len(rows[2].prefix) + len(rows[2].suffix)
        assert mx.allclose(whole.keys, f.keys[..., : f.offset, :], atol=1e-4).item()
        assert mx.allclose(whole.values, f.values[..., : f.offset, :], atol=1e-4).item()


def test_rows_must_all_be_cascade_and_levels_contiguous(prefixes: Prefixes) -> None:
    layers = prefixes.layers
    with pytest.raises(ValueError, match="contiguous"):
        row_caches([prefixes.doc_a], layers)
    with pytest.raises(ValueError, match="contiguous"):
        row_caches([prefixes.doc_a, prefixes.system], layers)
    c = CascadeKVCache.merge([row_caches([prefixes.system], layers)[0]])
    with pytest.raises(TypeError, match="every row"):
        c.extend(BatchKVCache([0]))
    with pytest.raises(ValueError, match="KVCache"):
        SharedPrefix.from_caches([KVCache()], 0, 4)


def test_eligible_models_and_routing_installs_once(tiny_loaded: LoadedModel) -> None:
    import sys

    model = tiny_loaded.model
    assert routing.cascade_eligible(model)
    assert not routing.cascade_eligible(SimpleNamespace(model_type="gemma3"))
    assert routing.install(SimpleNamespace(model_type="mamba")) is False
    module = sys.modules[type(model).__module__]
    assert routing.install(model)
    fn = module.scaled_dot_product_attention
    assert routing.install(model) and routing.install(model)
    assert module.scaled_dot_product_attention is fn  # it never wraps twice


def test_rows_continuing_the_same_entries_share_level_objects(tiny_loaded: LoadedModel) -> None:
    model = tiny_loaded.model
    system = _prefill(model, list(range(20)))
    doc = _prefill(model, list(range(20, 32)), system)
    levels = SharedPrefixes()
    a = levels.chain([(b"sys", system, 20), (b"doc", doc, 32)])
    b = levels.chain([(b"sys", system, 20), (b"doc", doc, 32)])
    c = levels.chain([(b"doc", doc, 32)])  # the document's entry alone: one level of all 32 tokens
    assert a[0] is b[0] and a[1] is b[1] and len(levels) == 3
    assert (a[1].start, a[1].end, c[0].start, c[0].end) == (20, 32, 0, 32)
    batch = cascade_batch([Row([], None, a, [1]), Row([], None, b, [2])], len(model.layers))
    assert len(batch[0].cascade_layout()[0]) == 2  # two levels, each read once for both rows
    levels.discard(b"doc")
    assert len(levels) == 1 and levels.chain([(b"sys", system, 20)])[0] is a[0]
    with pytest.raises(ValueError, match="deepen"):
        levels.chain([(b"doc", doc, 32), (b"sys", system, 20)])


def test_a_row_with_no_own_tokens_yet(prefixes: Prefixes) -> None:
    """Straight after insertion a row holds only references: extracting it copies nothing but its levels."""
    layers = prefixes.layers
    c = CascadeKVCache.merge([row_caches([prefixes.system, prefixes.doc_a], layers)[0]])
    assert c.own.keys is None and not c.empty() and c.size() == 0
    assert c.offset.tolist() == [70]  # its first own token goes to position 70
    whole = c.extract(0).to_kv_cache()
    assert whole.offset == 70
    assert mx.array_equal(whole.keys[..., :40, :], prefixes.system.segments[0].keys).item()
    assert CascadeKVCache.merge([row_caches([], layers)[0]]).empty()


def _own_batch(lengths: list[int], seed: int) -> BatchKVCache:
    """A left-padded own-suffix cache of rows with these lengths (random keys), as after an insert."""
    mx.random.seed(seed)
    rows = []
    for n in lengths:
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, n, 16)), mx.random.normal((1, 2, n, 16)))
        rows.append(c)
    return BatchKVCache.merge(rows)


def test_filter_equals_mlx_lms_and_reads_the_padding_once_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer of a filter call gives what mlx-lm's BatchKVCache.filter gives; the padding to drop is read
    from the device for the first layer only; another batch filtered with the same list reads its own."""
    reads = {"n": 0}
    real = mx.array.tolist

    def counting(self: mx.array) -> Any:
        reads["n"] += 1
        return real(self)

    lengths = [9, 4, 7, 12]
    layers = [CascadeKVCache([()] * 4, _own_batch(lengths, seed=i)) for i in range(3)]
    theirs = [_own_batch(lengths, seed=i) for i in range(3)]
    keep = [1, 2]  # the longest rows leave: both kept rows have padding to drop
    monkeypatch.setattr(mx.array, "tolist", counting)
    for c in layers:
        c.filter(keep)
    assert reads["n"] == 1
    monkeypatch.setattr(mx.array, "tolist", real)
    for c, t in zip(layers, theirs, strict=True):
        t.filter(keep)
        assert c.own._idx == t._idx == 7
        assert c.own.left_padding.tolist() == t.left_padding.tolist() == [3, 0]
        assert c.own.offset.tolist() == t.offset.tolist()
        assert mx.array_equal(c.own.keys[..., : c.own._idx, :], t.keys[..., : t._idx, :])
    other = CascadeKVCache([()] * 4, _own_batch([3, 5, 8, 2], seed=9))  # same list, another batch: no reuse
    other.filter(keep)
    assert other.own.left_padding.tolist() == [3, 0] and other.own._idx == 8  # its padding: 0 to drop

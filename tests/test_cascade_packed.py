"""All of a decode step's prefix levels in one masked call (worker/attention/packed.py): equal to attention over
each row's concatenated keys, with the rows' own suffixes merged in mx ops or by the CUDA suffix kernel's
reference; one compiled graph per row bucket however the batch and its levels change."""

from __future__ import annotations

import mlx.core as mx
import pytest

from omlx_jobs.worker.attention import cascade, packed
from omlx_jobs.worker.attention.kernels import suffix as cascade_kernel
from omlx_jobs.worker.attention.options import CascadeOptions
from tests.cascade_cases import case

TOLERANCE = {mx.float32: 1e-5, mx.bfloat16: 3e-2}


@pytest.mark.parametrize("compile", ["never", "always"])
@pytest.mark.parametrize("kernel", [False, True], ids=["mx", "suffix-kernel"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
def test_one_call_for_every_level_equals_attention_over_the_concatenated_keys(
    compile: str, kernel: bool, dtype: mx.Dtype
) -> None:
    """Two groups, one- and two-level chains, a row of its own group and a row without prefix (cascade_cases)."""
    q, k, v, levels, mask, start, ref = case(heads=8, kv_heads=2, dim=64, n=1, dtype=dtype)
    assert len(levels) == 4
    suffix = cascade_kernel.suffix_decode_reference if kernel else None
    options = CascadeOptions(compile=compile, packed="always", suffix_kernel=suffix)  # type: ignore[arg-type]
    out = cascade.attention(q, k, v, levels, 0.125, mask, start, options=options)
    assert out.dtype == dtype and out.shape == q.shape
    assert mx.abs(out.astype(mx.float32) - ref).max().item() < TOLERANCE[dtype]
    assert len(options.graphs.decode_steps) == 1 and not options.graphs.merges  # one graph, no per-level merge


def test_rows_coming_and_going_reuse_the_bucket_graph() -> None:
    """Batches of 8, 7, 6 and 5 rows with other levels each: one bucket (8 rows), one compiled graph."""
    options = CascadeOptions(compile="always", packed="always")
    batches = [
        ([[0, 1], [0, 1], [0, 1], [0, 2], [0, 2], [0], [3], []], [5, 9, 6, 12, 7, 8, 10, 11]),
        ([[0, 1], [0, 1], [0, 2], [0, 2], [0], [3], []], [5, 6, 12, 7, 8, 10, 11]),
        ([[0, 2], [0, 2], [0], [3], [3], []], [4, 12, 7, 8, 10, 11]),
        ([[0], [0], [3], [], []], [3, 3, 9, 2, 4]),
    ]
    for chains, own in batches:
        q, k, v, levels, mask, start, ref = case(
            heads=8, kv_heads=2, dim=64, n=1, dtype=mx.float32, chains=chains, own=own
        )
        out = cascade.attention(q, k, v, levels, 0.125, mask, start, options=options)
        assert mx.abs(out - ref).max().item() < TOLERANCE[mx.float32]
    assert len(options.graphs.decode_steps) == 1


def test_buckets() -> None:
    assert [packed.bucket(n) for n in (1, 3, 5, 8, 9, 33, 100, 128, 129, 300)] == [
        1,
        4,
        8,
        8,
        16,
        48,
        128,
        128,
        192,
        320,
    ]


def test_padded_rows_see_nothing() -> None:
    q, _, _, levels, *_ = case(heads=4, kv_heads=2, dim=16, n=1, dtype=mx.float32)
    p = packed.pack(levels, q.shape[0])
    assert p.visible.shape == (8, sum(lv.keys.shape[2] for lv in levels))
    assert not p.visible[7].any().item()  # the row without prefix sees no level
    o, lse = packed.decode(q, p, 0.25, CascadeOptions(packed="always"))
    assert mx.isinf(lse[7]).all().item() and not mx.abs(o[7]).max().item()


def test_the_batch_cache_packs_once_while_its_levels_stay() -> None:
    """CascadeKVCache: rows leaving keep the packed keys when the set of levels is the same; a level gone repacks."""
    from mlx_lm.models.cache import KVCache

    from omlx_jobs.worker.backend.cascade_cache import SharedPrefixes, row_caches

    def entry(n: int) -> list[KVCache]:
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, n, 16)), mx.random.normal((1, 2, n, 16)))
        return [c]

    shared = SharedPrefixes()
    a, b = entry(40), entry(24)
    rows = [
        row_caches(shared.chain([(key, e, n)]), 1)[0] for key, e, n in [(b"a", a, 40), (b"a", a, 40), (b"b", b, 24)]
    ]
    rows.append(row_caches(shared.chain([(b"b", b, 24)]), 1)[0])
    cache = type(rows[0]).merge(rows)
    first = cache.cascade_packed()
    assert first is not None and first.keys.shape[2] == 64 and first.visible.shape == (4, 64)
    cache.filter([0, 2, 3])
    kept = cache.cascade_packed()
    assert kept is not first and kept.keys is first.keys  # new mask, same packed keys
    assert kept.visible.sum().item() == 40 + 24 + 24
    cache.filter([0])
    alone = cache.cascade_packed()
    assert alone is not None and alone.keys.shape[2] == 40

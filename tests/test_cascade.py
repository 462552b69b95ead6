"""Cascade attention (worker/attention/cascade.py): equal to mlx's attention over each row's concatenated keys and
values.

Each case is a batch of rows with left-padded own suffixes of different lengths, 1- and 2-level prefix chains,
several groups and a row with no prefix; decode (one query per row) and prefill chunks (causal within the
suffix). The reference is mx.fast.scaled_dot_product_attention per row over its prefix levels + own keys.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import pytest

from omlx_jobs.worker.attention import cascade, parts
from omlx_jobs.worker.attention.kernels import prefix as prefix_kernel
from omlx_jobs.worker.attention.kernels import suffix as cascade_kernel
from omlx_jobs.worker.attention.options import CascadeOptions
from tests.cascade_cases import OWN, case

TOLERANCE = {mx.float32: 1e-5, mx.bfloat16: 3e-2}


@pytest.mark.parametrize("dim", [64, 96, 128, 256])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 6], ids=["decode", "prefill"])
def test_equals_attention_over_the_concatenated_keys(dim: int, heads: int, kv_heads: int, dtype: mx.Dtype, n: int):
    q, k, v, levels, mask, start, ref = case(heads=heads, kv_heads=kv_heads, dim=dim, n=n, dtype=dtype)
    out = cascade.attention(q, k, v, levels, dim**-0.5, mask, start)
    assert out.dtype == dtype and out.shape == q.shape
    err = mx.abs(out.astype(mx.float32) - ref).max().item()
    assert err < TOLERANCE[dtype], err


def test_a_wrong_merge_is_caught() -> None:
    """The reference notices a row that loses a level (so the tests above can fail)."""
    q, k, v, levels, mask, start, ref = case(heads=8, kv_heads=2, dim=64, n=1, dtype=mx.float32)
    out = cascade.attention(q, k, v, levels[:-1], 0.125, mask, start)  # row 6 loses its group's prefix
    assert mx.abs(out - ref).max().item() > 1e-2
    out = cascade.attention(q, k, v, levels, 0.125, None, start)  # the padding is attended
    assert mx.abs(out - ref).max().item() > 1e-2


def test_one_group_spanning_the_batch_and_single_rows() -> None:
    for chains, own in [([[0, 1]] * 4, [3, 5, 1, 2]), ([[0]], [4]), ([[]], [6])]:
        q, k, v, levels, mask, start, ref = case(
            heads=8, kv_heads=2, dim=64, n=1, dtype=mx.float32, chains=chains, own=own, segments=[40, 17]
        )
        assert all(lv.rows is None for lv in levels)
        out = cascade.attention(q, k, v, levels, 0.125, mask, start)
        assert mx.abs(out - ref).max().item() < 2e-5


def test_long_prefill_is_split_into_chunks_of_queries() -> None:
    q, k, v, levels, mask, start, ref = case(
        heads=4, kv_heads=2, dim=64, n=20, dtype=mx.float32, own=[x + 20 for x in OWN]
    )
    options = CascadeOptions(score_budget=8 * 4 * 3 * 60)  # 3 query positions per chunk
    out = cascade.attention(q, k, v, levels, 0.125, mask, start, options=options)
    assert mx.abs(out - ref).max().item() < 2e-5


def test_merge_of_disjoint_parts_is_attention_over_their_union() -> None:
    mx.random.seed(2)
    q = mx.random.normal((2, 4, 3, 32))
    k = mx.random.normal((2, 2, 30, 32))
    v = mx.random.normal((2, 2, 30, 32))
    whole = parts.attend(q, k, v, 0.2)
    pieces = [parts.attend(q, k[:, :, a:b], v[:, :, a:b], 0.2) for a, b in [(0, 7), (7, 8), (8, 30)]]
    o, lse = parts.merge(pieces)
    assert mx.allclose(o, whole[0], atol=1e-5) and mx.allclose(lse, whole[1], atol=1e-5)
    nothing = (mx.zeros_like(o), mx.full(lse.shape, float("-inf")))
    o2, lse2 = parts.merge([nothing, (o, lse)])
    assert mx.allclose(o2, o, atol=1e-6) and mx.allclose(lse2, lse, atol=1e-6)
    sdpa = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2)
    assert mx.allclose(whole[0], sdpa, atol=1e-5)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
def test_kernel_contract_reference_equals_the_portable_path(dtype: mx.Dtype) -> None:
    """suffix_decode_reference (what the CUDA kernel computes) gives the portable path's decode output."""
    q, k, v, levels, mask, start, ref = case(heads=16, kv_heads=4, dim=128, n=1, dtype=dtype)
    calls = []

    def spy(*args: mx.array) -> mx.array:
        calls.append(args[0].shape)
        return cascade_kernel.suffix_decode_reference(*args)

    options = CascadeOptions(suffix_kernel=spy)
    routed = cascade.attention(q, k, v, levels, 128**-0.5, mask, start, options=options)
    prefill = case(heads=16, kv_heads=4, dim=128, n=3, dtype=dtype)
    cascade.attention(*prefill[:3], prefill[3], 128**-0.5, prefill[4], prefill[5], options=options)
    assert calls == [(8, 16, 1, 128)]  # decode only
    assert mx.abs(routed.astype(mx.float32) - ref).max().item() < TOLERANCE[dtype]


def test_kernel_shapes_are_the_ragged_kernels() -> None:
    assert cascade_kernel.supported(32, 8, 128) and cascade_kernel.supported(16, 16, 256)
    assert not cascade_kernel.supported(4, 2, 16)
    q, k, v, levels, mask, start, ref = case(heads=4, kv_heads=2, dim=16, n=1, dtype=mx.float32)
    options = CascadeOptions(suffix_kernel=lambda *a: pytest.fail("head size 16 is not the kernel's"))
    out = cascade.attention(q, k, v, levels, 0.25, mask, start, options=options)
    assert mx.abs(out - ref).max().item() < 2e-5


def test_the_compiled_path_used_on_gpus_gives_the_same() -> None:
    """Shapeless compilation (Metal, CUDA) across batches of different shapes; forced here on the CPU."""
    options = CascadeOptions(compile="always")
    cases = [(1, 8, mx.float32, OWN), (1, 8, mx.float32, [x + 3 for x in OWN]), (4, 4, mx.float32, OWN)]
    for n, heads, dtype, own in [*cases, (1, 8, mx.bfloat16, OWN), (3, 8, mx.bfloat16, OWN)]:
        q, k, v, levels, mask, start, ref = case(heads=heads, kv_heads=2, dim=64, n=n, dtype=dtype, own=own)
        out = cascade.attention(q, k, v, levels, 0.125, mask, start, options=options)
        assert mx.abs(out.astype(mx.float32) - ref).max().item() < TOLERANCE[dtype]
    assert len(options.graphs.decode_steps) == 1  # one level structure: one function for both lengths and dtypes
    q, k, v, levels, mask, start, ref = case(heads=8, kv_heads=2, dim=64, n=1, dtype=mx.float32)
    kernel = CascadeOptions(compile="always", suffix_kernel=cascade_kernel.suffix_decode_reference)
    out = cascade.attention(q, k, v, levels, 0.125, mask, start, options=kernel)
    assert mx.abs(out - ref).max().item() < TOLERANCE[mx.float32]


@pytest.mark.parametrize("route", ["mx", "kernel", "prefix"])
def test_the_compiled_path_follows_the_batch_as_it_grows_and_shrinks(route: str) -> None:
    """One level structure, batches of other sizes and other rows per level (a continuous batch admits and
    finishes rows): the compiled graphs (GPUs; forced here) must not keep the first batch's row counts."""
    suffix = cascade_kernel.suffix_decode_reference
    prefix = functools.partial(prefix_kernel.prefix_decode_reference, min_split=16)  # levels in several parts
    kernels = {
        "mx": CascadeOptions(compile="always"),
        "kernel": CascadeOptions(compile="always", suffix_kernel=suffix),
        "prefix": CascadeOptions(compile="always", suffix_kernel=suffix, prefix_kernel=prefix),
    }
    batches = [
        ([[0, 1], [0, 1], [0], []], [3, 5, 2, 4]),
        ([[0, 1], [0, 1], [0, 1], [0], [0], []], [3, 5, 2, 4, 6, 1]),
        ([[0, 1], [0], []], [2, 2, 2]),
    ]
    for chains, own in batches:
        q, k, v, levels, mask, start, ref = case(
            heads=8, kv_heads=2, dim=64, n=1, dtype=mx.bfloat16, chains=chains, own=own, segments=[40, 17]
        )
        assert [lv.rows is not None for lv in levels] == [True, True]
        out = cascade.attention(q, k, v, levels, 0.125, mask, start, options=kernels[route])
        assert out.shape == q.shape
        assert mx.abs(out.astype(mx.float32) - ref).max().item() < TOLERANCE[mx.bfloat16]

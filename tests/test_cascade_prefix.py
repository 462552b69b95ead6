"""The prefix levels of a cascade decode step through prefix_kernel's contract (its CUDA kernel's, here its mx-ops
reference): the keys split into parts, each part's (o, lse), the parts merged and scattered back to the batch.

The CUDA kernel itself is checked against the reference on the GPU (bench/kernels/cascade_step.py `check`).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from omlx_jobs.defaults import Switches
from omlx_jobs.worker.attention import cascade, parts, routing
from omlx_jobs.worker.attention.kernels import prefix as cascade_prefix
from omlx_jobs.worker.attention.kernels import suffix as cascade_kernel
from omlx_jobs.worker.attention.options import CascadeOptions
from tests.cascade_cases import case

TOLERANCE = {mx.bfloat16: 3e-2, mx.float16: 5e-3}
SEGMENTS = [150, 70, 14, 9]  # longer than a key tile (32): with MIN_SPLIT 16, a level splits into several parts


def spy(calls: list[int]) -> object:
    def prefix(*args: mx.array) -> tuple[mx.array, mx.array]:
        o, lse = cascade_prefix.prefix_decode_reference(*args, min_split=16)
        calls.append(o.shape[0])
        return o, lse

    return prefix


def kernels(prefix: object, suffix: object = cascade_kernel.suffix_decode_reference, **kw: object) -> CascadeOptions:
    """Cascade options with these kernels (the CUDA kernels' mx-ops references in their place)."""
    return CascadeOptions(suffix_kernel=suffix, prefix_kernel=prefix, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
def test_split_levels_merged_equal_attention_over_the_concatenated_keys(dtype: mx.Dtype, compiled: bool) -> None:
    q, k, v, levels, mask, start, ref = case(heads=16, kv_heads=4, dim=128, n=1, dtype=dtype, segments=SEGMENTS)
    calls: list[int] = []
    options = kernels(spy(calls), compile="always" if compiled else "never")
    out = cascade.attention(q, k, v, levels, 128**-0.5, mask, start, options=options)
    assert len(calls) == len(levels) and max(calls) > 2  # every level through the contract, in several parts
    assert out.dtype == dtype and out.shape == q.shape
    assert mx.abs(out.astype(mx.float32) - ref).max().item() < TOLERANCE[dtype]


def test_a_lost_part_is_caught() -> None:
    """Dropping one part of a level's keys changes the result (so the test above can fail)."""
    q, k, v, levels, mask, start, ref = case(heads=16, kv_heads=4, dim=128, n=1, dtype=mx.bfloat16, segments=SEGMENTS)

    def lossy(*args: mx.array) -> tuple[mx.array, mx.array]:
        o, lse = cascade_prefix.prefix_decode_reference(*args, min_split=16)
        return (o[1:], lse[1:]) if o.shape[0] > 1 else (o, lse)

    out = cascade.attention(q, k, v, levels, 128**-0.5, mask, start, options=kernels(lossy))
    assert mx.abs(out.astype(mx.float32) - ref).max().item() > 0.1


def test_float32_and_other_head_sizes_keep_the_mx_ops() -> None:
    for dtype, dim in [(mx.float32, 128), (mx.bfloat16, 256)]:
        q, k, v, levels, mask, start, ref = case(heads=8, kv_heads=2, dim=dim, n=1, dtype=dtype)
        options = kernels(lambda *a: pytest.fail("not its shape"))
        out = cascade.attention(q, k, v, levels, dim**-0.5, mask, start, options=options)
        assert mx.abs(out.astype(mx.float32) - ref).max().item() < 3e-2


def test_the_cuda_kernels_are_the_default_unless_turned_off() -> None:
    options = routing.for_backend(Switches(), kernels=True).cascade
    assert options.prefix_kernel is cascade_prefix.prefix_decode
    options = routing.for_backend(Switches(cascade_prefix_kernel=False), kernels=True).cascade
    assert options.prefix_kernel is None and options.suffix_kernel is cascade_kernel.suffix_decode
    assert routing.for_backend(Switches(), kernels=False).cascade.suffix_kernel is None


def test_splits_fill_the_gpu_with_at_least_min_split_keys_each() -> None:
    # 128 rows of a Qwen3-8B shape (G 4, 8 kv heads): 8 query tiles x 8 heads = 64 blocks; 5 splits of 3,072 keys
    assert cascade_prefix.splits(128 * 4, 8, 3072) == 5
    assert cascade_prefix.splits(32 * 4, 8, 3072) == 12  # 16 blocks would want 17 splits: 256 keys each at least
    assert cascade_prefix.splits(4096, 8, 3072) == 1
    assert cascade_prefix.splits(4, 8, 100) == 1


def test_the_compiled_merge_serves_models_of_other_shapes() -> None:
    """One level structure, other head counts and sizes: each gets a merge of its own shapes (a shapeless compile
    would keep the first one's gather shape)."""
    options = kernels(cascade_prefix.prefix_decode_reference, compile="always")
    for heads, kv_heads, dim in [(32, 8, 64), (8, 8, 64), (16, 4, 128)]:
        q, k, v, levels, mask, start, ref = case(heads=heads, kv_heads=kv_heads, dim=dim, n=1, dtype=mx.bfloat16)
        out = cascade.attention(q, k, v, levels, dim**-0.5, mask, start, options=options)
        assert out.shape == q.shape
        assert mx.abs(out.astype(mx.float32) - ref).max().item() < TOLERANCE[mx.bfloat16]
    assert len(options.graphs.merges) == 3


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_one_level_for_every_row_goes_to_the_suffix_kernel_in_parts(compiled: bool) -> None:
    """A level that every row continues: its parts go to the suffix kernel as they are, which merges them."""
    q, k, v, levels, mask, start, ref = case(
        heads=16, kv_heads=4, dim=64, n=1, dtype=mx.bfloat16, chains=[[0]] * 4, own=[3, 5, 1, 2], segments=[150]
    )
    assert len(levels) == 1 and levels[0].rows is None
    pieces: list[int] = []

    def suffix(*args: mx.array) -> mx.array:
        pieces.append(args[4].shape[0])
        return cascade_kernel.suffix_decode_reference(*args)

    options = kernels(spy([]), suffix, compile="always" if compiled else "never")
    out = cascade.attention(q, k, v, levels, 0.125, mask, start, options=options)
    assert pieces == [cascade_prefix.splits(4 * 4, 4, 150, min_split=16)] and pieces[0] > 1
    assert mx.abs(out.astype(mx.float32) - ref).max().item() < TOLERANCE[mx.bfloat16]


def test_the_suffix_kernel_reference_merges_parts_as_one() -> None:
    """[P, B, H, D] parts of the prefix and their merge ([B, H, 1, D]) give the suffix kernel the same result."""
    mx.random.seed(4)
    q, k, v = mx.random.normal((3, 8, 1, 64)), mx.random.normal((3, 2, 9, 64)), mx.random.normal((3, 2, 9, 64))
    start = mx.array([0, 4, 8], mx.int32)
    o_parts = mx.random.normal((3, 3, 8, 64))
    lse_parts = mx.random.normal((3, 3, 8)).at[1, 2].add(float("-inf"))  # a row without keys in one part
    merged = parts.merge([(o_parts[p][:, :, None], lse_parts[p][:, :, None]) for p in range(3)])
    one = cascade_kernel.suffix_decode_reference(q, k, v, start, *merged, 0.125)
    many = cascade_kernel.suffix_decode_reference(q, k, v, start, o_parts, lse_parts, 0.125)
    assert mx.allclose(one, many, atol=1e-5)
    first = cascade_kernel.suffix_decode_reference(q, k, v, start, o_parts[:1], lse_parts[:1], 0.125)
    assert not mx.allclose(first, many, atol=1e-2)


def test_every_part_holds_keys() -> None:
    """Parts are whole key tiles: where rounding up leaves the last ones empty, there are fewer parts."""
    for queries, kv_heads, keys in [(8, 2, 33924), (16, 4, 150), (512, 8, 3072), (4, 8, 37), (128, 8, 1000)]:
        parts = cascade_prefix.splits(queries, kv_heads, keys)
        length = cascade_prefix.part_length(keys, parts)
        assert length % cascade_prefix.KEY_TILE == 0 and (parts - 1) * length < keys <= parts * length
    assert cascade_prefix.splits(8, 2, 33924) == 118  # 132 wanted, 14 of them would be empty

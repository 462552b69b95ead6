"""Cascade attention through mlx's fused attention (worker/attention/fused.py): the same as over concatenated keys.

With OMLX_JOBS_CASCADE_FUSED_DECODE=1 decode steps put the rows along the query axis and mask each row to its
levels and its own suffix (cuDNN on CUDA); here, on the CPU, mlx's attention takes the same inputs (unfused),
so the masks and layouts are checked against the per-row reference of tests/cascade_cases.py and through the
real engine.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from omlx_jobs.defaults import Switches
from omlx_jobs.worker.attention import cascade
from omlx_jobs.worker.attention import fused as cascade_fused
from omlx_jobs.worker.attention.options import CascadeOptions
from omlx_jobs.worker.models.loaded import LoadedModel
from tests.cascade_cases import case, count_calls
from tests.test_cascade_engine import job_prompts, run_job, switched


def buffers(k: mx.array, v: mx.array, size: int) -> tuple[mx.array, mx.array]:
    """Own-suffix buffers of `size` positions whose tail past k's length is garbage (it must stay unseen)."""
    tail = (k.shape[0], k.shape[1], size - k.shape[2], k.shape[3])
    return mx.concatenate([k, 100 * mx.ones(tail, k.dtype)], 2), mx.concatenate([v, 100 * mx.ones(tail, v.dtype)], 2)


@pytest.mark.parametrize("rows_per_call", [32, 3, 8])
@pytest.mark.parametrize("size", [12, 64, 70])
def test_decode_equals_attention_over_the_concatenated_keys(rows_per_call: int, size: int) -> None:
    """Several groups, two-level chains, a row with no prefix; one block, several, and a padded last block; own
    buffers cut at the bucket (64) or at their end (12, 70 positions; 12 = the suffixes' exact length)."""
    q, k, v, levels, _, start, ref = case(heads=8, kv_heads=2, dim=64, n=1, dtype=mx.float32)
    own_k, own_v = buffers(k, v, size)
    out = cascade_fused.decode(q, own_k, own_v, k.shape[2], start, levels, 0.125, rows_per_call=rows_per_call)
    assert out.shape == q.shape
    assert mx.abs(out - ref).max().item() < 2e-5


def test_decode_in_bf16_and_through_cascade_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    options = CascadeOptions(fused_decode=True)
    decoded = count_calls(monkeypatch, cascade_fused, "decode")
    for dtype, tol in ((mx.float32, 2e-5), (mx.bfloat16, 3e-2)):
        q, k, v, levels, mask, start, ref = case(heads=8, kv_heads=2, dim=128, n=1, dtype=dtype)
        out = cascade.attention(q, k, v, levels, 128**-0.5, mask, start, buffers(k, v, 64), options)
        assert out.dtype == dtype and mx.abs(out.astype(mx.float32) - ref).max().item() < tol
    assert decoded() == 2


def test_a_row_that_loses_its_level_is_caught() -> None:
    """The reference notices a wrong mask (so the tests above can fail)."""
    q, k, v, levels, _, start, ref = case(heads=8, kv_heads=2, dim=64, n=1, dtype=mx.float32)
    out = cascade_fused.decode(q, k, v, k.shape[2], start, levels[:-1], 0.125)
    assert mx.abs(out - ref).max().item() > 1e-2
    out = cascade_fused.decode(q, k, v, k.shape[2], mx.zeros_like(start), levels, 0.125)  # padding attended
    assert mx.abs(out - ref).max().item() > 1e-2


def test_decode_is_opt_in() -> None:
    """Off unless OMLX_JOBS_CASCADE_FUSED_DECODE=1 (slower than the kernel path on an H200, bench/RESULTS.md)."""
    assert not Switches.from_env({}).cascade_fused_decode
    assert Switches.from_env({"OMLX_JOBS_CASCADE_FUSED_DECODE": "1"}).cascade_fused_decode


def test_fused_decode_through_the_engine_equals_todays_path(
    tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy ids of a job with one- and two-level prefixes and several groups per batch, decoded through
    cascade_fused.decode (forced on the CPU), equal those with every row holding a copy of its prefix."""
    fused = switched(cascade_fused_decode=True, fused_rows_per_call=3)  # every level referenced
    decoded = count_calls(monkeypatch, cascade_fused, "decode")
    prompts = job_prompts(seed=5)
    on = run_job(tiny_loaded, prompts, use=True, batch=8, switches=fused)
    assert decoded() > 0
    assert on == run_job(tiny_loaded, prompts, use=False, batch=8, switches=Switches.from_env())

"""CPU prefill attention (worker/attention/cpu_prefill.py): causal blocks of queries equal mlx's attention over
every key."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from omlx_jobs.defaults import Switches
from omlx_jobs.worker.attention import cpu_prefill
from omlx_jobs.worker.backend.model import ModelBackend
from omlx_jobs.worker.models.loaded import LoadedModel
from tests.cascade_cases import count_calls


def qkv(b: int, n: int, total: int, heads: int = 8, kv_heads: int = 2, dim: int = 64) -> tuple[mx.array, ...]:
    mx.random.seed(n + total)
    return (
        mx.random.normal((b, heads, n, dim)),
        mx.random.normal((b, kv_heads, total, dim)),
        mx.random.normal((b, kv_heads, total, dim)),
    )


@pytest.mark.parametrize("n,offset", [(100, 0), (37, 60), (64, 200)])
def test_equals_mlx_attention_for_causal_and_batch_masks(n: int, offset: int) -> None:
    """ "causal", and BatchKVCache's boolean masks with left and right padding; blocks of 16 queries (the last one
    partial), queries at the end of a cache that already holds `offset` keys."""
    q, k, v = qkv(3, n, n + offset)
    scale = 64**-0.5
    masks: list[Any] = [
        "causal",
        create_causal_mask(n, offset, left_padding=mx.array([0, 5, 11])),
        create_causal_mask(n, offset, right_padding=mx.array([0, 3, 9]), left_padding=mx.array([2, 0, 4])),
    ]
    for mask in masks:
        assert cpu_prefill.applies(q, k, None, mask, None)
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        got = cpu_prefill.attention(q, k, v, scale, mask, block=16)
        assert got.shape == want.shape and got.dtype == want.dtype
        # Rows whose queries see no key at all (right padding) are garbage either way: compare the others.
        if not isinstance(mask, str):
            seen = mx.broadcast_to(mask.any(axis=-1, keepdims=True), want.shape[:-1] + (1,))
            want, got = mx.where(seen, want, 0.0), mx.where(seen, got, 0.0)
        assert mx.abs(got - want).max().item() < 2e-5


def test_a_wrong_cut_is_caught() -> None:
    """Queries that lose keys they can see differ (so the test above can fail)."""
    q, k, v = qkv(1, 40, 40)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    got = cpu_prefill.attention(q, k[:, :, 5:], v[:, :, 5:], 0.125, "causal", block=16)
    assert mx.abs(got - want).max().item() > 1e-2


def test_what_keeps_mlxs_path() -> None:
    q, k, _ = qkv(1, 40, 40)
    causal = create_causal_mask(40, 0)
    assert cpu_prefill.applies(q, k, None, causal, None)
    assert not cpu_prefill.applies(q[:, :, :1], k[:, :, :1], None, None, None)  # a decode step
    assert not cpu_prefill.applies(q[:, :, :8], k[:, :, :8], None, "causal", None)  # too short to gain
    assert not cpu_prefill.applies(q, k, None, mx.where(causal, 0.0, -1e9), None)  # additive: could be anything
    assert not cpu_prefill.applies(q, k, None, None, None)  # no mask: not causal
    assert not cpu_prefill.applies(q, k, None, causal, mx.zeros((8,)))  # sinks

    class Cascade:
        def cascade_layout(self) -> Any: ...

    assert not cpu_prefill.applies(q, k, Cascade(), causal, None)  # cascade.py attends to its levels
    assert not cpu_prefill.applies(q, k, RotatingKVCache(max_size=64), causal, None)  # keys not in position order
    assert cpu_prefill.applies(q, k, KVCache(), causal, None)
    assert cpu_prefill.applies(q, k, BatchKVCache([0]), causal, None)


def test_a_warm_up_prefill_through_the_model(tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's prefill (two rows of different lengths, chunks of 64) gives the logits mlx's path gives."""
    sizes = {"eos": [0], "batch_size": 4, "prefill_batch_size": 4, "prefill_step": 64}
    blocks = count_calls(monkeypatch, cpu_prefill, "attention")
    suffixes = [[(7 * i) % 370 + 3 for i in range(150)], [(11 * i) % 370 + 3 for i in range(90)]]
    want = [{149, 100}, {89, 3}]

    def logits(switches: Switches) -> list[dict[int, mx.array]]:
        backend = ModelBackend(tiny_loaded.model, switches=switches, **sizes)  # type: ignore[arg-type]
        return [d for _, d in backend.prefill([None, None], suffixes, want)]

    ours = logits(Switches())
    assert blocks() > 0
    theirs = logits(Switches(cpu_prefill=False))
    for a, b in zip(ours, theirs, strict=True):
        assert a.keys() == b.keys()
        for j in a:
            assert mx.abs(a[j] - b[j]).max().item() < 1e-4

"""Ragged decode attention (worker/attention/ragged.py, routed by attention/routing.py): what the kernel must
compute, and when the engine uses it.

The CUDA kernel itself runs only on an NVIDIA GPU: `bench/kernels/decode_step.py` prints its largest difference from
mlx's masked attention there. Here (CPU) the routing is checked with the mlx-ops reference in its place.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

from omlx_jobs.defaults import Switches
from omlx_jobs.worker.attention import routing
from omlx_jobs.worker.attention.kernels import cuda
from omlx_jobs.worker.attention.kernels import ragged as attention
from omlx_jobs.worker.attention.kernels import suffix as suffix_kernel
from omlx_jobs.worker.attention.options import Routing
from omlx_jobs.worker.engine.config import EngineConfig
from omlx_jobs.worker.engine.loop import Engine
from omlx_jobs.worker.engine.sequence import WorkItem
from omlx_jobs.worker.loading import load
from omlx_jobs.worker.models.loaded import LoadedModel
from tests.test_engine import greedy, mixed_prompts, run
from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def wide_loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny model with 64-wide heads, a size the kernel takes (the default tiny model's are 16)."""
    return load(str(build_tiny_model(tmp_path_factory.mktemp("wide") / "m", hidden_size=256)))


def test_reference_attends_from_each_rows_first_real_key() -> None:
    mx.random.seed(1)
    q = mx.random.normal((3, 4, 1, 64))
    k = mx.random.normal((3, 2, 20, 64))
    v = mx.random.normal((3, 2, 20, 64))
    start = mx.array([0, 7, 19], dtype=mx.int32)
    out = attention.ragged_reference(q, k, v, start, 0.125)
    for b, s in enumerate(start.tolist()):
        row = mx.fast.scaled_dot_product_attention(q[b : b + 1], k[b : b + 1, :, s:], v[b : b + 1, :, s:], scale=0.125)
        assert mx.allclose(out[b : b + 1], row, atol=1e-5), f"row {b}"


def test_engine_decodes_through_the_kernel_with_identical_tokens(
    wide_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = mixed_prompts(wide_loaded)  # different lengths: the decode batch is left-padded
    items = [WorkItem(i, p, greedy(8)) for i, p in enumerate(prompts)]
    # Cascade off: every row is a BatchKVCache (with it, rows with a prefix take the cascade kernel, see
    # tests/test_cascade_engine.py).
    switches = Switches(cascade=False)
    config = EngineConfig(completion_batch_size=6, prefill_batch_size=3, min_shared_tokens=8, switches=switches)
    stock = run(Engine(wide_loaded, config), items)

    calls: list[tuple[int, ...]] = []

    def spy(q: mx.array, k: mx.array, v: mx.array, start: mx.array, scale: float) -> mx.array:
        calls.append(tuple(q.shape))
        return attention.ragged_reference(q, k, v, start, scale)

    monkeypatch.setattr(attention, "available", lambda: True)  # as on CUDA, with the kernel's reference
    monkeypatch.setattr(attention, "ragged_decode", spy)
    engine = Engine(wide_loaded, config)
    assert engine.ragged
    routed = run(engine, items)
    assert calls and all(shape[2] == 1 for shape in calls)  # decode steps only, never a prefill
    assert max(shape[0] for shape in calls) > 1
    for i in range(len(prompts)):
        assert routed[i].choices[0].token_ids == stock[i].choices[0].token_ids, f"prompt {i}"


def test_outside_its_routing_the_wrapper_is_mlx_lms_own_path(
    wide_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert routing.install(wide_loaded.model)
    calls = []
    kernel = Routing(ragged=lambda *a: calls.append(1) or attention.ragged_reference(*a))
    with routing.active(kernel):
        pass
    monkeypatch.setattr(attention, "ragged_decode", kernel.ragged)  # not on CUDA here: no engine routes to it
    run(Engine(wide_loaded, EngineConfig()), [WorkItem(0, mixed_prompts(wide_loaded)[0], greedy(4))])
    assert calls == []


def test_only_on_cuda_and_only_for_checked_models_and_shapes(tiny_model_dir: Path) -> None:
    assert not attention.available()  # these tests run on the CPU
    assert Engine(load(str(tiny_model_dir))).ragged is False
    assert routing.install(SimpleNamespace(model_type="gemma3")) is False
    assert attention.supported(32, 8, 128) and attention.supported(8, 8, 64)
    assert not attention.supported(4, 2, 16)  # head size
    assert not attention.supported(64, 2, 128)  # too many query heads per kv head for registers
    assert not attention.supported(12, 8, 128)


def test_kernel_names_carry_a_hash_of_their_code() -> None:
    """mlx caches compiled kernels on disk by name: a changed kernel must not run an old binary."""
    a = cuda.kernel_name("omlx_k", "out[0] = 1;", "")
    assert a == cuda.kernel_name("omlx_k", "out[0] = 1;", "") and a.startswith("omlx_k_")
    assert a != cuda.kernel_name("omlx_k", "out[0] = 2;", "")
    assert a != cuda.kernel_name("omlx_k", "out[0] = 1;", "#define X 1\n")


def test_the_decode_kernels_share_one_online_softmax_loop() -> None:
    """The ragged kernel and the cascade suffix kernel are one loop (cuda.decode_source), the suffix kernel starting
    each head from the prefix's parts; each source holds the loop once, and their names (hashed) differ."""
    loop = "for (int j = start[b] + w; j < length; j += BN)"
    for source in (attention.SOURCE, suffix_kernel.SOURCE):
        assert source.count(loop) == 1 and source.endswith(cuda._KEYS_AND_COMBINE)
    assert "lse_pre" in suffix_kernel.SOURCE and "lse_pre" not in attention.SOURCE
    names = {cuda.kernel_name("k", s, cuda.DECODE_HEADER) for s in (attention.SOURCE, suffix_kernel.SOURCE)}
    assert len(names) == 2

"""Models for benchmarks: the tiny test model, any real model, or random weights in a real model's shape."""

from __future__ import annotations

import math
import random
import tempfile
from pathlib import Path
from typing import Any

QWEN3_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        hidden_size=1024,
        num_hidden_layers=28,
        intermediate_size=3072,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        hidden_size=4096,
        num_hidden_layers=36,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
}


class IdsTokenizer:
    """Enough of a tokenizer for token-id prompts: no EOS, no chat template, ids decoded as numbers."""

    eos_token_ids: frozenset[int] = frozenset()
    bos_token = None
    chat_template = None

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


POOL = 1 << 22
"""Random values `init="pool"` cuts every weight from (16 MB of float32)."""


def pooled_weights(shapes: list[tuple[int, ...]], dt: Any, seed: int = 0) -> list[Any]:
    """Weights for `shapes` cut from one pool of POOL normal values at a random offset each (tiled if larger):
    no per-value random draws, so 0.6B parameters build in seconds on a CPU (fp32 draws of each value took 30 s
    on two cores). The values repeat with period POOL, harmless for timing (not for quality)."""
    import mlx.core as mx

    key = mx.random.key(seed)
    pool = (mx.random.normal((POOL,), key=key) * 0.02).astype(dt)
    rng = random.Random(seed)
    out = []
    for shape in shapes:
        size = math.prod(shape)
        if len(shape) == 1:
            out.append(mx.ones(shape, dtype=dt))
            continue
        if size <= POOL:  # a window of the pool (a view: no copy)
            start = rng.randrange(POOL - size + 1)
            out.append(pool[start : start + size].reshape(shape))
        else:
            out.append(mx.tile(pool, (-(-size // POOL),))[:size].reshape(shape))
    return out


def random_qwen3(shape: str, dtype: str | None = None, init: str = "normal") -> Any:
    """Random weights in a Qwen3 shape: `init="normal"` draws each value (as every earlier figure was measured),
    `"pool"` cuts them from one pool of values (pooled_weights: seconds instead of minutes on a CPU)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import qwen3

    from omlx_jobs.worker.models.loaded import LoadedModel

    config = dict(
        model_type="qwen3",
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        **QWEN3_SHAPES[shape],
    )
    model = qwen3.Model(qwen3.ModelArgs(**config))
    dt = getattr(mx, dtype or "bfloat16")
    mx.random.seed(0)
    flat = tree_flatten(model.parameters())
    if init == "pool":
        params = list(zip([k for k, _ in flat], pooled_weights([tuple(v.shape) for _, v in flat], dt), strict=True))
    else:
        params = [
            (k, mx.ones(v.shape, dtype=dt) if v.ndim == 1 else (mx.random.normal(v.shape) * 0.02).astype(dt))
            for k, v in flat
        ]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return LoadedModel(
        ref=f"random:{shape}",
        path=Path("."),
        model=model,
        tokenizer=IdsTokenizer(),
        config=config,
        identity=f"random-{shape}-{dtype}" + ("-pool" if init == "pool" else ""),
        context_length=40960,
    )


def load_bench_model(spec: str, dtype: str | None = None, init: str = "normal") -> Any:
    from omlx_jobs.worker.loading import load

    if spec == "tiny":
        from tests.tiny_model import build_tiny_model

        return load(str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", context_length=8192)))
    if spec.startswith("random:"):
        return random_qwen3(spec.split(":", 1)[1], dtype, init)
    return load(spec)

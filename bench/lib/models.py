"""Models for benchmarks: the tiny test model, any real model, or random weights in a real model's shape."""

from __future__ import annotations

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


def random_qwen3(shape: str, dtype: str | None = None) -> Any:
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
    params = [
        (k, mx.ones(v.shape, dtype=dt) if v.ndim == 1 else (mx.random.normal(v.shape) * 0.02).astype(dt))
        for k, v in tree_flatten(model.parameters())
    ]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return LoadedModel(
        ref=f"random:{shape}",
        path=Path("."),
        model=model,
        tokenizer=IdsTokenizer(),
        config=config,
        identity=f"random-{shape}-{dtype}",
        context_length=40960,
    )


def load_bench_model(spec: str, dtype: str | None = None) -> Any:
    from omlx_jobs.worker.loading import load

    if spec == "tiny":
        from tests.tiny_model import build_tiny_model

        return load(str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", context_length=8192)))
    if spec.startswith("random:"):
        return random_qwen3(spec.split(":", 1)[1], dtype)
    return load(spec)

"""Embeddings on a tiny random decoder (qwen3 through mlx-lm) and a tiny random BERT (through mlx-embeddings), with
a sentence-transformers pooling config written here: batched vectors equal one-at-a-time vectors and a reference
from the model's own forward pass and the declared pooling; dimensions truncates and renormalises; base64
decodes to the float vector; requests of the wrong kind, over-long items and undeclared dimensions fail alone
with typed errors."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from omlx_jobs.errors import ErrorCode, FinishReason
from omlx_jobs.jobs.embeddings import EMBEDDINGS_URL
from omlx_jobs.jobs.formats import parse_line
from omlx_jobs.jobs.output import embeddings_body
from omlx_jobs.store.vectors import StoredVectors
from omlx_jobs.worker.embeddings.engine import EmbeddingEngine
from omlx_jobs.worker.embeddings.model import EmbeddingModel
from omlx_jobs.worker.engine.results import completion_row
from omlx_jobs.worker.engine.sequence import WorkItem
from omlx_jobs.worker.loading import engine_for, load
from omlx_jobs.worker.prompts import PromptError
from tests.tiny_embedding import build_tiny_bert, build_tiny_embedding

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris",
    "What is the capital of France? Paris is the capital of France. Summarize it.",
    "good morning",
    "Extract the names, dates and places from this document.",
]


@pytest.fixture(scope="module", params=["lasttoken", "mean"])
def embedder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> EmbeddingEngine:
    path = build_tiny_embedding(tmp_path_factory.mktemp(f"embed-{request.param}"), pooling=request.param)
    engine = engine_for(load(str(path)))
    assert isinstance(engine, EmbeddingEngine)
    return engine


def embed(engine: EmbeddingEngine, bodies: list[dict[str, Any]]) -> list[StoredVectors]:
    """Run one line per body through the engine, as the shard runner does; the stored vectors in order."""
    items = []
    for key, body in enumerate(bodies):
        parsed = parse_line(json.dumps(body), key + 1)
        prompt = engine.loaded.prompt(parsed.endpoint, parsed.body)
        items.append(WorkItem(key, prompt.tokens, None, prompt))  # type: ignore[arg-type]
    got: dict[int, Any] = {}
    engine.run(items, lambda results: got.update({r.key: r for r in results}))
    rows = [completion_row(got[k]) for k in range(len(bodies))]
    assert all(r.finish_reason == FinishReason.EMBEDDED for r in rows)
    return [StoredVectors.decode(r.vectors or b"") for r in rows]


def reference(loaded: EmbeddingModel, text: str) -> np.ndarray:
    """The model's forward pass on one input alone (hidden states before lm_head) and its declared pooling."""
    ids = loaded.tokenizer.encode(text)
    hidden = loaded.model.model(mx.array([ids]))[0].astype(mx.float32)
    pooled = hidden[-1] if loaded.embedding.pooling == "lasttoken" else hidden.mean(axis=0)
    v = np.array(pooled)
    return v / np.linalg.norm(v)


def test_batched_vectors_equal_one_at_a_time_and_the_reference(embedder: EmbeddingEngine) -> None:
    together = embed(embedder, [{"input": TEXTS}])[0]
    alone = [embed(embedder, [{"input": t}])[0] for t in TEXTS]
    assert together.count == len(TEXTS) and together.dim == 64
    assert len({len(embedder.loaded.tokenizer.encode(t)) for t in TEXTS}) > 3  # lengths differ in the batch
    for i, text in enumerate(TEXTS):
        batched = np.array(together.vector(i))
        np.testing.assert_allclose(batched, alone[i].vector(0), atol=2e-5)
        np.testing.assert_allclose(batched, reference(embedder.loaded, text), atol=2e-5)
        assert abs(np.linalg.norm(batched) - 1) < 1e-5
    # Lines of different lengths in one page batch across requests too.
    per_line = embed(embedder, [{"input": t} for t in TEXTS])
    for i in range(len(TEXTS)):
        np.testing.assert_allclose(per_line[i].vector(0), together.vector(i), atol=2e-5)


def test_dimensions_truncate_and_renormalise(embedder: EmbeddingEngine) -> None:
    full, cut = embed(embedder, [{"input": TEXTS[0]}, {"input": TEXTS[0], "dimensions": 16}])
    assert cut.dim == 16
    head = np.array(full.vector(0))[:16]
    np.testing.assert_allclose(cut.vector(0), head / np.linalg.norm(head), atol=1e-6)


def test_base64_decodes_to_the_float_vector(embedder: EmbeddingEngine) -> None:
    floats, b64 = embed(embedder, [{"input": TEXTS[:2]}, {"input": TEXTS[:2], "encoding_format": "base64"}])
    row = SimpleNamespace(vectors=b64.encode(), prompt_tokens=7)
    body = embeddings_body(row, "tiny")
    for i in range(2):
        decoded = np.frombuffer(base64.b64decode(body["data"][i]["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.array(b64.vector(i), dtype="<f4"))  # exactly the stored float32
        np.testing.assert_allclose(decoded, floats.vector(i), atol=1e-6)
    plain = embeddings_body(SimpleNamespace(vectors=floats.encode(), prompt_tokens=7), "tiny")
    assert plain["data"][1]["embedding"] == floats.vector(1) and plain["usage"]["total_tokens"] == 7


def test_token_id_inputs_embed_like_their_text(embedder: EmbeddingEngine) -> None:
    ids = embedder.loaded.tokenizer.encode(TEXTS[1])
    text, tokens = embed(embedder, [{"input": TEXTS[1]}, {"input": ids}])
    np.testing.assert_allclose(text.vector(0), tokens.vector(0), atol=1e-6)


def test_requests_that_cannot_run_fail_with_typed_errors(embedder: EmbeddingEngine, tiny_loaded: Any) -> None:
    loaded = embedder.loaded
    with pytest.raises(PromptError) as chat:
        loaded.prompt("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat.value.code is ErrorCode.EMBEDDING_MODEL_ONLY
    with pytest.raises(PromptError) as gen:
        tiny_loaded.prompt(EMBEDDINGS_URL, {"input": ["hi"]})
    assert gen.value.code is ErrorCode.NOT_AN_EMBEDDING_MODEL
    with pytest.raises(PromptError) as long:
        loaded.prompt(EMBEDDINGS_URL, {"input": ["ok", "word " * 600]})
    assert long.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and "input[1]" in long.value.message
    with pytest.raises(PromptError) as wide:
        loaded.prompt(EMBEDDINGS_URL, {"input": ["ok"], "dimensions": 65})
    assert wide.value.code is ErrorCode.DIMENSIONS_NOT_SUPPORTED


def test_dimensions_need_a_model_that_declares_matryoshka(tmp_path: Path) -> None:
    loaded = load(str(build_tiny_embedding(tmp_path / "m", matryoshka=False, pooling="cls", prefix="Query: ")))
    assert loaded.embedding.pooling == "cls" and loaded.embedding.prefix == "Query: "  # type: ignore[attr-defined]
    with pytest.raises(PromptError) as exc:
        loaded.prompt(EMBEDDINGS_URL, {"input": ["ok"], "dimensions": 8})
    assert exc.value.code is ErrorCode.DIMENSIONS_NOT_SUPPORTED and "Matryoshka" in exc.value.message
    prompt = loaded.prompt(EMBEDDINGS_URL, {"input": ["ok"]})
    assert list(prompt.items[0]) == loaded.tokenizer.encode("Query: ok")  # type: ignore[attr-defined]


@pytest.fixture(scope="module", params=["mean", "cls"])
def bert_engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> EmbeddingEngine:
    path = build_tiny_bert(tmp_path_factory.mktemp(f"bert-{request.param}"), pooling=request.param)
    engine = engine_for(load(str(path)))
    assert isinstance(engine, EmbeddingEngine) and not engine.loaded.causal  # mlx-embeddings' BERT
    return engine


def test_a_tiny_bert_batches_like_one_at_a_time_and_its_reference(bert_engine: EmbeddingEngine) -> None:
    loaded = bert_engine.loaded
    together = embed(bert_engine, [{"input": TEXTS}])[0]
    for i, text in enumerate(TEXTS):
        ids = loaded.tokenizer.encode(text)
        hidden = np.array(loaded.model(mx.array([ids])).last_hidden_state[0])  # its forward pass, alone
        ref = hidden[0] if loaded.embedding.pooling == "cls" else hidden.mean(axis=0)
        alone = embed(bert_engine, [{"input": text}])[0]
        np.testing.assert_allclose(together.vector(i), alone.vector(0), atol=2e-5)
        np.testing.assert_allclose(together.vector(i), ref / np.linalg.norm(ref), atol=2e-5)
    if loaded.embedding.pooling == "mean":  # mlx-embeddings' own batch call pools the same way (mean, normalized)
        batch = loaded.tokenizer(TEXTS, padding=True, return_tensors="np")
        out = loaded.model(mx.array(batch["input_ids"]), attention_mask=mx.array(batch["attention_mask"]))
        own = np.array(out.text_embeds)
        for i in range(len(TEXTS)):
            np.testing.assert_allclose(together.vector(i), own[i], atol=2e-5)

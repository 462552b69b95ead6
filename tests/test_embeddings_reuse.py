"""Prefix reuse for a causal embedding model (worker/embeddings/prefix.py, reuse.py): inputs that share an
instruction prefix compute it once, and their vectors equal the vectors computed without reuse and a reference from
the model's own forward pass over each whole input (a tiny random fp32 qwen3, inputs of different lengths, several
batches from one prefix); the prefix positions count as cached tokens except for the row charged with them; a mean
with sentence-transformers' include_prompt off leaves the prompt out either way; never on an encoder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from omlx_jobs.jobs.formats import parse_line
from omlx_jobs.jobs.output import embeddings_body
from omlx_jobs.store.vectors import StoredVectors
from omlx_jobs.worker.embeddings.engine import EmbeddingEngine
from omlx_jobs.worker.embeddings.model import EmbeddingModel
from omlx_jobs.worker.embeddings.prefix import PrefixGroup, computed_tokens, prefix_groups
from omlx_jobs.worker.engine.config import EngineConfig
from omlx_jobs.worker.engine.results import ItemResult, RunStats, completion_row
from omlx_jobs.worker.engine.sequence import WorkItem
from omlx_jobs.worker.loading import load
from tests.tiny_embedding import build_tiny_embedding

PREFIX = "Instruct: Given a question, find the passage that answers it\nQuery: "
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris",
    "What is the capital of France? Paris is the capital of France. Summarize it.",
    "good morning",
    "Extract the names, dates and places from this document.",
    "the answer",
]


def test_prefix_groups_share_at_least_min_tokens_and_leave_each_row_a_token() -> None:
    rows = [[1, 2, 3, 4, 9], [1, 2, 3, 4, 5, 6], [7, 8], [1, 2, 3, 4], [7, 8, 1], [5]]
    groups = prefix_groups(rows, 3)
    assert groups == [PrefixGroup(3, [3, 1, 0]), PrefixGroup(0, [2, 4, 5])]  # in token order
    assert computed_tokens(rows, groups) == 3 + (1 + 3 + 2) + (2 + 3 + 1)
    assert prefix_groups(rows, 2)[1:] == [PrefixGroup(0, [2, 4, 5])]  # [7, 8] keeps its last token: it shares 1
    assert prefix_groups(rows, 1)[1:] == [PrefixGroup(1, [2, 4]), PrefixGroup(0, [5])]
    assert prefix_groups([[1, 2], [1, 2]], 1) == [PrefixGroup(1, [0, 1])]  # duplicates keep one own token
    assert prefix_groups(rows, 99) == [PrefixGroup(0, list(range(6)))]


def loaded_model(tmp: Path, pooling: str, include_prompt: bool = True) -> EmbeddingModel:
    path = build_tiny_embedding(tmp / f"m-{pooling}-{include_prompt}", pooling=pooling, prefix=PREFIX)
    if not include_prompt:
        cfg = json.loads((path / "1_Pooling" / "config.json").read_text())
        (path / "1_Pooling" / "config.json").write_text(json.dumps({**cfg, "include_prompt": False}))
    loaded = load(str(path))
    assert isinstance(loaded, EmbeddingModel) and loaded.embedding.include_prompt is include_prompt
    return loaded


def run(engine: EmbeddingEngine, bodies: list[dict[str, Any]]) -> tuple[list[ItemResult], RunStats]:
    items = []
    for key, body in enumerate(bodies):
        parsed = parse_line(json.dumps(body), key + 1)
        prompt = engine.loaded.prompt(parsed.endpoint, parsed.body)
        items.append(WorkItem(key, prompt.tokens, None, prompt))  # type: ignore[arg-type]
    got: dict[int, ItemResult] = {}
    stats = engine.run(items, lambda results: got.update({r.key: r for r in results}))
    return [got[k] for k in range(len(bodies))], stats


def reference(loaded: EmbeddingModel, ids: list[int], skip: int) -> np.ndarray:
    """The model's forward pass over the whole input alone, pooled as declared (a mean from position `skip`)."""
    hidden = np.array(loaded.model.model(mx.array([ids]))[0].astype(mx.float32))
    v = hidden[-1] if loaded.embedding.pooling == "lasttoken" else hidden[skip:].mean(axis=0)
    return v / np.linalg.norm(v)


@pytest.mark.parametrize(("pooling", "include_prompt"), [("lasttoken", True), ("mean", True), ("mean", False)])
def test_reused_prefix_vectors_equal_vectors_without_reuse(tmp_path: Path, pooling: str, include_prompt: bool) -> None:
    loaded = loaded_model(tmp_path, pooling, include_prompt)
    # A small budget: each group's suffixes run in several batches from the one prefix.
    reuse = EmbeddingEngine(loaded, EngineConfig(min_shared_tokens=8), token_budget=48)
    plain = EmbeddingEngine(loaded, EngineConfig(prefix_cache=False), token_budget=48)
    assert reuse.reuse and not plain.reuse
    ids = loaded.tokenizer.encode("no instruction here, just words")
    bodies = [{"input": TEXTS[:4]}, {"input": TEXTS[4]}, {"input": TEXTS[5:] + TEXTS[:1]}, {"input": ids}]
    got, stats = run(reuse, bodies)
    want, plain_stats = run(plain, bodies)
    # Lengths padded to a multiple of 16 (as on CUDA, where each attention shape costs a cuDNN plan): the same.
    padded = EmbeddingEngine(loaded, EngineConfig(min_shared_tokens=8), token_budget=48, pad_to=16)
    for g, p in zip(got, run(padded, bodies)[0], strict=True):
        gv, pv = StoredVectors.decode(g.vectors or b""), StoredVectors.decode(p.vectors or b"")
        for i in range(gv.count):
            np.testing.assert_allclose(gv.vector(i), pv.vector(i), atol=2e-5)
    prefix_len = len(loaded.tokenizer.encode(PREFIX)) - 2  # what all inputs surely share (BPE may merge the end)
    skip = 0 if include_prompt else len(loaded.tokenizer.encode(PREFIX)) - 1
    texts = [TEXTS[:4], [TEXTS[4]], TEXTS[5:] + TEXTS[:1]]
    for line, (g, w) in enumerate(zip(got, want, strict=True)):
        gv, wv = StoredVectors.decode(g.vectors or b""), StoredVectors.decode(w.vectors or b"")
        assert gv.count == wv.count and g.prompt_tokens == w.prompt_tokens
        for i in range(gv.count):
            np.testing.assert_allclose(gv.vector(i), wv.vector(i), atol=2e-5)
            whole = ids if line == 3 else loaded.tokenizer.encode(PREFIX + texts[line][i])
            np.testing.assert_allclose(gv.vector(i), reference(loaded, whole, 0 if line == 3 else skip), atol=2e-5)
    assert stats.prompt_tokens == plain_stats.prompt_tokens == plain_stats.prefill_tokens
    assert stats.prefill_tokens <= stats.prompt_tokens - 5 * prefix_len  # 7 prefixed items: the prefix runs once
    assert sum(r.cached_tokens for r in got) == stats.prompt_tokens - stats.prefill_tokens  # all charged once
    assert all(r.cached_tokens == 0 for r in want) and got[3].cached_tokens == 0  # the token-id line shares nothing
    assert sum(1 for r in got if r.cached_tokens) >= 2
    usage = embeddings_body(completion_row(got[0]), "m")["usage"]  # as export writes it
    assert usage["prompt_tokens"] == usage["total_tokens"] == got[0].prompt_tokens
    assert usage["prompt_tokens_details"]["cached_tokens"] == got[0].cached_tokens > 0
    assert "prompt_tokens_details" not in embeddings_body(completion_row(want[0]), "m")["usage"]  # OpenAI's shape


def test_include_prompt_off_leaves_the_prompt_out_of_the_mean(tmp_path: Path) -> None:
    with_prompt, without = loaded_model(tmp_path, "mean"), loaded_model(tmp_path, "mean", include_prompt=False)
    a = StoredVectors.decode(run(EmbeddingEngine(with_prompt), [{"input": TEXTS[0]}])[0][0].vectors or b"")
    b = StoredVectors.decode(run(EmbeddingEngine(without), [{"input": TEXTS[0]}])[0][0].vectors or b"")
    assert float(np.abs(np.array(a.vector(0)) - np.array(b.vector(0))).max()) > 1e-3
    ids = list(without.tokenizer.encode(PREFIX + TEXTS[0]))
    skip = len(without.tokenizer.encode(PREFIX)) - 1  # sentence-transformers' prompt_length
    assert without.prompt("/v1/embeddings", {"input": [TEXTS[0], ids]}).starts == (skip, 0)  # ids are as given


def test_an_encoder_never_reuses_a_prefix(tmp_path: Path) -> None:
    pytest.importorskip("mlx_embeddings")
    from tests.tiny_embedding import build_tiny_bert

    engine = EmbeddingEngine(load(str(build_tiny_bert(tmp_path / "bert"))), EngineConfig(min_shared_tokens=1))
    assert not engine.loaded.causal and not engine.reuse
    assert [g.prefix for g in engine._groups([[2, 10, 11, 12, 3], [2, 10, 11, 13, 3]])] == [0]

"""Embeddings through `serve`: a batch with endpoint /v1/embeddings, run by a real worker process on a tiny
decoder embedding model, read back with the official openai client (files.content), every output line's body
validated by its CreateEmbeddingResponse; a chat line in the same file is refused when the batch is created."""

from __future__ import annotations

import base64
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from openai.types import CreateEmbeddingResponse

from omlx_jobs.store.vectors import StoredVectors
from tests.api_harness import chat_line, live_server, openai_client, write_lines
from tests.test_api import KEY, Env, jsonl, upload, wait_for
from tests.tiny_embedding import build_tiny_embedding

EMBED = "/v1/embeddings"


def embed_line(i: int, **body: Any) -> dict[str, Any]:
    return {"custom_id": f"e-{i}", "method": "POST", "url": EMBED, "body": {"model": "tiny", **body}}


def page_json(server: str, path: str) -> Any:
    req = urllib.request.Request(f"{server}{path}", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_embedding(tmp_path_factory.mktemp("embed-api") / "m")


@pytest.fixture
def env(tmp_path: Path, redis_url: str, embed_model: Path) -> Iterator[Env]:
    e = Env(tmp_path, redis_url, embed_model)
    yield e
    e.close()


def test_a_serve_batch_of_embeddings_validates_with_the_openai_client(env: Env) -> None:
    lines = [
        embed_line(0, input="hello world"),
        embed_line(1, input=["good morning", "The quick brown fox jumps over the lazy dog.", "x"]),
        embed_line(2, input=[[5, 6, 7], [8, 9]], encoding_format="base64"),
        embed_line(3, input="Paris is the capital of France", dimensions=16),
        embed_line(4, input=["ok", "word " * 600]),  # its second item is past the 512-token context
    ]
    with live_server(env.config()) as server:
        client = openai_client(server)
        f = upload(client, write_lines(env.tmp / "in.jsonl", lines))
        batch = client.batches.create(input_file_id=f.id, endpoint=EMBED, completion_window="24h")
        assert batch.endpoint == EMBED and batch.status == "in_progress"
        proc = env.worker()
        assert proc.wait(timeout=300) == 0, env.logs()
        done = wait_for("completed", lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b)
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (4, 1)
        assert done.output_file_id and done.error_file_id
        results = jsonl(client.files.content(done.output_file_id).text)
        errors = jsonl(client.files.content(done.error_file_id).text)
        page = wait_for(  # the page: outcomes counted as "embedded", a request row previewed as embeddings
            "outcomes", lambda: (j := page_json(server, f"/api/jobs/{batch.id}")).get("outcomes") and j
        )
        rows = page_json(server, f"/api/jobs/{batch.id}/requests")
    assert page["outcomes"] == {"embedded": 4, "context_length_exceeded": 1}
    assert "3 input(s): good morning" in json.dumps(rows)
    assert [r["custom_id"] for r in results] == ["e-0", "e-1", "e-2", "e-3"]
    raw = results[2]["response"]["body"]["data"][0]["embedding"]  # base64, as asked
    for d in results[2]["response"]["body"]["data"]:  # decoded as the client's embeddings.create decodes base64
        d["embedding"] = np.frombuffer(base64.b64decode(d["embedding"]), dtype="float32").tolist()
    bodies = [CreateEmbeddingResponse.model_validate(r["response"]["body"]) for r in results]
    assert [len(b.data) for b in bodies] == [1, 3, 2, 1]
    assert all(b.object == "list" and b.usage.prompt_tokens == b.usage.total_tokens > 0 for b in bodies)
    assert [d.index for d in bodies[1].data] == [0, 1, 2] and len(bodies[1].data[0].embedding) == 64
    assert len(bodies[3].data[0].embedding) == 16
    assert abs(np.linalg.norm(bodies[3].data[0].embedding) - 1) < 1e-5
    vector = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    assert vector.shape == (64,) and abs(np.linalg.norm(vector) - 1) < 1e-5
    error = errors[0]["response"]["body"]["error"]
    assert errors[0]["custom_id"] == "e-4" and error["code"] == "context_length_exceeded"
    assert "input[1]" in error["message"]


def test_a_file_mixing_embeddings_and_chat_is_refused_naming_the_line(env: Env) -> None:
    with live_server(env.config()) as server:
        client = openai_client(server)
        f = upload(client, write_lines(env.tmp / "mixed.jsonl", [embed_line(0, input="a"), chat_line(1)]))
        with pytest.raises(openai.BadRequestError) as exc:
            client.batches.create(input_file_id=f.id, endpoint=EMBED, completion_window="24h")
    assert "line 2" in str(exc.value) and "/v1/chat/completions" in str(exc.value)


def test_stored_vectors_round_trip() -> None:
    stored = StoredVectors.from_floats([[0.5, -1.0, 2.0], [0.0, 1.0, 0.25]], base64=True)
    back = StoredVectors.decode(stored.encode())
    assert (back.count, back.dim, back.base64) == (2, 3, True) and back.vector(1) == [0.0, 1.0, 0.25]
    assert len(stored.encode()) == 12 + 4 * 6

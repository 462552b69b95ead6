"""API keys as tenants (issue 21, 10): with two keys, each sees only its own files and batches (another's answer
404, as if absent), an admin key sees all; the official openai client against a live server on loopback."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from omlx_jobs.api import ServeConfig
from omlx_jobs.api.tenants import Tenant, key_id
from omlx_jobs.store import open_store
from omlx_jobs.store.files import Files
from tests.api_harness import chat_line, live_server, openai_client, write_lines

ALICE, BOB, ADMIN = "alice-key-0001", "bob-key-000002", "admin-key-0003"
CHAT = "/v1/chat/completions"


def _config(tmp_path: Path, redis_url: str, tiny_model_dir: Path) -> ServeConfig:
    return ServeConfig(
        db_url=f"sqlite:///{tmp_path / 'jobs.db'}",
        redis_url=redis_url,
        files_dir=tmp_path / "files",
        api_keys=(ALICE, BOB),
        admin_keys=(ADMIN,),
        models={"tiny": str(tiny_model_dir)},
        sweep_seconds=0.5,
    )


def _not_found(call: object) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        call()  # type: ignore[operator]
    assert exc.value.status_code == 404


def test_keys_see_only_their_own_objects(tmp_path: Path, redis_url: str, tiny_model_dir: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", [chat_line(i) for i in range(3)])
    with live_server(_config(tmp_path, redis_url, tiny_model_dir)) as url:
        alice, bob, admin = (openai_client(url, api_key=k) for k in (ALICE, BOB, ADMIN))
        with src.open("rb") as fh:
            fa = alice.files.create(file=fh, purpose="batch")
        with src.open("rb") as fh:
            fb = bob.files.create(file=fh, purpose="batch")

        assert [f.id for f in alice.files.list()] == [fa.id]
        assert [f.id for f in bob.files.list()] == [fb.id]
        assert {f.id for f in admin.files.list()} == {fa.id, fb.id}
        for call in (
            lambda: bob.files.retrieve(fa.id),
            lambda: bob.files.content(fa.id),
            lambda: bob.files.delete(fa.id),
            lambda: bob.batches.create(input_file_id=fa.id, endpoint=CHAT, completion_window="24h"),
        ):
            _not_found(call)
        assert alice.files.retrieve(fa.id).id == fa.id  # still there: Bob's delete touched nothing

        ba = alice.batches.create(input_file_id=fa.id, endpoint=CHAT, completion_window="24h")
        _not_found(lambda: bob.batches.retrieve(ba.id))
        _not_found(lambda: bob.batches.cancel(ba.id))
        assert [b.id for b in bob.batches.list()] == []
        assert [b.id for b in alice.batches.list()] == [ba.id]
        assert [b.id for b in admin.batches.list()] == [ba.id] and admin.batches.retrieve(ba.id).id == ba.id

        cancelled = alice.batches.cancel(ba.id)  # no worker: every request ends cancelled, in the error file
        assert cancelled.status in ("cancelling", "cancelled")
        done = alice.batches.retrieve(ba.id)
        assert done.status == "cancelled" and done.error_file_id
        assert len(alice.files.content(done.error_file_id).text.splitlines()) == 3
        _not_found(lambda: bob.files.content(done.error_file_id))  # the batch's files belong to its tenant
        assert done.error_file_id in {f.id for f in alice.files.list()} - {f.id for f in bob.files.list()}
        assert admin.files.content(done.error_file_id).text == alice.files.content(done.error_file_id).text
        admin.files.delete(fb.id)  # an admin acts on anyone's objects
        _not_found(lambda: bob.files.retrieve(fb.id))

    store = open_store(url=f"sqlite:///{tmp_path / 'jobs.db'}")
    try:
        owners = {f.id: f.owner for f in Files(store).page(after=None, limit=10, descending=True, purpose=None)}
        assert owners[fa.id] == key_id(ALICE) and ALICE not in str(owners)  # a hash, never the key
    finally:
        store.close()


def test_objects_without_an_owner_are_everyones(tmp_path: Path, redis_url: str, tiny_model_dir: Path) -> None:
    """Files made by a keyless server, or before keys were tenants, stay visible to every key."""
    config = _config(tmp_path, redis_url, tiny_model_dir)
    with live_server(config) as url:
        store = open_store(url=config.db_url)
        try:
            Files(store).add(id="file-000000000000000000000001", purpose="batch", kind="input", filename="old.jsonl")
        finally:
            store.close()
        for key in (ALICE, BOB):
            assert "file-000000000000000000000001" in {f.id for f in openai_client(url, api_key=key).files.list()}


def test_tenant_rules() -> None:
    a, admin, everyone = Tenant(key_id(ALICE)), Tenant(key_id(ADMIN), admin=True), Tenant()
    assert a.sees(key_id(ALICE)) and a.sees(None) and not a.sees(key_id(BOB))
    assert admin.sees(key_id(BOB)) and admin.scope is None and admin.owner == key_id(ADMIN)
    assert everyone.sees(key_id(BOB)) and everyone.owner is None
    assert key_id(ALICE) != key_id(BOB) and len(key_id(ALICE)) == 36


def test_the_pages_json_is_scoped_to_the_key(tmp_path: Path, redis_url: str, tiny_model_dir: Path) -> None:
    """The page's JSON endpoints scope jobs as files and batches are: Bob neither lists, reads, pages the
    requests of, nor cancels Alice's batch (404, as if absent); the admin key sees it."""
    import httpx2 as httpx

    src = write_lines(tmp_path / "in.jsonl", [chat_line(i) for i in range(3)])
    with live_server(_config(tmp_path, redis_url, tiny_model_dir)) as url:
        alice = openai_client(url, api_key=ALICE)
        with src.open("rb") as fh:
            fa = alice.files.create(file=fh, purpose="batch")
        ba = alice.batches.create(input_file_id=fa.id, endpoint=CHAT, completion_window="24h")
        root = url.removesuffix("/v1")

        def get(key: str, path: str) -> httpx.Response:
            return httpx.get(root + path, headers={"Authorization": f"Bearer {key}"})

        listed = {k: [j["id"] for j in get(k, "/api/jobs").json()["jobs"]] for k in (ALICE, BOB, ADMIN)}
        assert listed[ALICE] == [ba.id] and listed[ADMIN] == [ba.id] and listed[BOB] == []
        for path in (f"/api/jobs/{ba.id}", f"/api/jobs/{ba.id}/requests", f"/api/jobs/{ba.id}/requests/0"):
            assert get(BOB, path).status_code == 404, path
            assert get(ALICE, path).status_code == 200, path
            assert get(ADMIN, path).status_code == 200, path
        cancel = httpx.post(root + f"/api/jobs/{ba.id}/cancel", headers={"Authorization": f"Bearer {BOB}"})
        assert cancel.status_code == 404
        assert alice.batches.retrieve(ba.id).status not in ("cancelling", "cancelled")

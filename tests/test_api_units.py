"""The server's pure parts, without HTTP, Redis or SQL: model resolution, keys and the request guard, settings,
ids, the upload scan, the Batch object against the openai client's types, plot buckets."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from starlette.datastructures import Headers

from omlx_jobs.api.auth import check, key_matches
from omlx_jobs.api.batches import batch_object
from omlx_jobs.api.config import ConfigError, check_listen, is_loopback, parse_api_keys, parse_models
from omlx_jobs.api.errors import BadRequest, Forbidden, Unauthorized
from omlx_jobs.api.ids import is_file_id, new_id
from omlx_jobs.api.models import resolve_model, scan_file
from omlx_jobs.api.uploads import safe_filename
from omlx_jobs.store.batches import BatchInfo
from omlx_jobs.store.db import JobCounts, JobInfo
from omlx_jobs.store.reports import bucket_seconds


def test_a_model_resolves_by_alias_then_by_live_worker() -> None:
    aliases = {"gpt-4o-mini": "mlx-community/Qwen3-0.6B-4bit"}
    assert resolve_model({"gpt-4o-mini": 1}, aliases, set()) == ("gpt-4o-mini", "mlx-community/Qwen3-0.6B-4bit")
    assert resolve_model({"gguf:/m.gguf": 3}, aliases, {"gguf:/m.gguf"}) == ("gguf:/m.gguf", "gguf:/m.gguf")
    assert resolve_model({}, {}, {"only-one"}) == ("only-one", "only-one")  # shorthand lines name no model


@pytest.mark.parametrize(
    ("models", "aliases", "live", "code", "words"),
    [
        ({"gpt-5": 4}, {"a": "A"}, {"b"}, "model_not_found", ["'gpt-5'", "line 4", "'a'", "'b'", "--model gpt-5"]),
        ({"a": 1, "b": 9}, {"a": "A", "b": "B"}, set(), "mixed_models", ["2 models", "line 1", "line 9", "one model"]),
        ({}, {"a": "A", "b": "B"}, set(), "model_not_found", ["body.model", "'a'", "'b'"]),
        ({}, {}, set(), "model_not_found", ["omlx-jobs worker --model"]),
    ],
)
def test_unresolvable_models_are_clear_400s(
    models: dict[str, int], aliases: dict[str, str], live: set[str], code: str, words: list[str]
) -> None:
    with pytest.raises(BadRequest) as exc:
        resolve_model(models, aliases, live)
    assert exc.value.status == 400 and exc.value.code == code
    for word in words:
        assert word in exc.value.message


def test_settings_parse_and_refuse_what_cannot_work(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_models(["tiny=/models/tiny", "gguf:/a=b.gguf", "mlx-community/X"]) == {
        "tiny": "/models/tiny",
        "gguf:/a": "b.gguf",  # the first '=' splits; quote paths with '=' as NAME=PATH
        "mlx-community/X": "mlx-community/X",
    }
    with pytest.raises(ConfigError):
        parse_models(["=x"])
    monkeypatch.setenv("OMLX_JOBS_API_KEYS", " key-from-env-1, ,key-from-cli-1")
    assert parse_api_keys(("key-from-cli-1",)) == ("key-from-cli-1", "key-from-env-1")
    with pytest.raises(ConfigError, match="at least 8"):
        parse_api_keys(("short",), env="")
    for host in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"):
        assert is_loopback(host), host
        check_listen(host, ())
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.com"):
        assert not is_loopback(host), host
        with pytest.raises(ConfigError, match="--api-key"):
            check_listen(host, ())
        check_listen(host, ("a-long-key",))


def test_the_guard_checks_keys_origins_and_hosts() -> None:
    keys = ("first-key-0001", "second-key-002")
    assert key_matches("second-key-002", keys) and not key_matches("second-key-00", keys)

    def h(**kv: str) -> Headers:
        return Headers({k.replace("_", "-"): v for k, v in kv.items()})

    with pytest.raises(Unauthorized, match="no API key"):
        check("GET", "/v1/files", h(host="127.0.0.1:8000"), keys)
    with pytest.raises(Unauthorized, match="incorrect"):
        check("GET", "/metrics", h(host="x", authorization="Bearer nope-nope-nope"), keys)
    check("GET", "/v1/files", h(host="x", authorization="Bearer first-key-0001"), keys)
    check("GET", "/static/app.js", h(host="x"), keys)  # the page's assets hold no data
    check("GET", "/", h(host="x"), keys)
    with pytest.raises(Forbidden):  # another site's form, even with a key the browser cannot know
        check(
            "POST",
            "/api/jobs/j/cancel",
            h(host="srv:8000", origin="http://evil", authorization="Bearer first-key-0001"),
            keys,
        )
    with pytest.raises(Forbidden):
        check("POST", "/v1/files", h(host="srv:8000", sec_fetch_site="cross-site"), keys)
    check(
        "POST", "/v1/files", h(host="srv:8000", origin="http://srv:8000", authorization="Bearer first-key-0001"), keys
    )
    # Without keys: loopback names only (DNS rebinding), no credentials asked.
    check("POST", "/v1/files", h(host="localhost:8000"), ())
    with pytest.raises(Forbidden, match="loopback"):
        check("GET", "/v1/files", h(host="rebind.example:8000"), ())


def test_ids_sort_by_creation_and_only_checked_ids_name_files() -> None:
    a = new_id("file-")
    time.sleep(0.002)
    b = new_id("file-")
    assert a < b and is_file_id(a) and len(a) == len("file-") + 24
    for bad in ("file-../../etc/passwd", "file-ABC", "file-" + "0" * 25, "../file-" + "0" * 24, ""):
        assert not is_file_id(bad)
    assert safe_filename("../../etc/pass\x00wd\n") == "passwd"
    assert safe_filename("C:\\Users\\me\\in.jsonl") == "in.jsonl"
    assert safe_filename("") == "upload.jsonl"


def test_the_scan_finds_models_urls_and_lines(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(
        "\n".join(
            [
                json.dumps(
                    {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m1"}}
                ),
                "",
                "{broken",
                json.dumps({"prompt": "hi", "model": "m2"}),
                json.dumps({"prompt": "no model"}),
                json.dumps({"custom_id": "b", "url": "/v1/completions", "body": {"model": "m1", "prompt": "x"}}),
            ]
        )
    )
    scan = scan_file(src)
    assert scan.lines == 5
    assert scan.models == {"m1": 1, "m2": 4}
    assert scan.urls == {"/v1/chat/completions": 1, "/v1/completions": 6}


def _job(**kw: object) -> JobInfo:
    base = dict.fromkeys(JobInfo.__dataclass_fields__)
    base.update(
        id="batch_x", model="m", status="in_progress", total=2, options={}, created_at=1.0, prefill_tokens=0,
        trie_min_tokens=0, cache_hits=0, cache_misses=0, cache_evictions=0, cache_peak_bytes=0,
    )  # fmt: skip
    base.update(kw)
    return JobInfo(**base)  # type: ignore[arg-type]


def test_the_batch_object_validates_strictly_against_the_openai_types() -> None:
    from openai.types import Batch

    batch = BatchInfo(
        "batch_x", "file-x", "/v1/chat/completions", "24h", "tiny", None, 10.0, 86410.0, None, None, None, None, None
    )
    counts = JobCounts(2, 2, 0, 0, 0, 0, 0, 0, None, None)
    obj = batch_object(batch, _job(in_progress_at=11.5), counts)
    assert obj["output_file_id"] is None and obj["error_file_id"] is None and obj["errors"] is None
    parsed = Batch.model_validate(obj)
    assert parsed.status == "in_progress" and parsed.expires_at == 86410 and parsed.in_progress_at == 11

    errors = [{"line": 3, "field": "body.temperature", "custom_id": "q", "code": "out_of_range", "message": "bad"}]
    failed = batch_object(
        batch, _job(status="failed", failed_at=12.0, errors=errors), JobCounts(0, 0, 0, 0, 0, 0, 0, 0, None, None)
    )
    parsed = Batch.model_validate(failed)
    assert parsed.errors is not None and parsed.errors.data is not None
    assert (parsed.errors.data[0].line, parsed.errors.data[0].param) == (3, "body.temperature")
    assert set(obj) >= set(Batch.model_fields)  # every field present, null rather than missing


def test_plot_buckets_are_round_and_bounded() -> None:
    assert bucket_seconds(30, 60) == 1 and bucket_seconds(61, 60) == 2 and bucket_seconds(3000, 60) == 60
    assert bucket_seconds(10 * 86400, 60) == 3600 * 4
    for span in (1, 59, 600, 7200, 86400):
        assert span / bucket_seconds(span, 60) <= 60


def test_the_server_and_the_client_commands_never_import_mlx() -> None:
    """DESIGN decision 7: `serve`, `submit`, `status` and the store work on a machine without MLX."""
    import subprocess
    import sys

    code = (
        "import sys; import omlx_jobs.api.app, omlx_jobs.cli, omlx_jobs.jobs.submit, omlx_jobs.store; "
        "bad = sorted(m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_lm', 'mlx_vlm'))); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr

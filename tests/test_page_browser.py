"""The web page in a real browser: headless Chromium from Debian's package loads the page of a running job
(served with an API key, typed into the page), and the test reads the rendered DOM: the job row, the progress,
the throughput plot, the workers; it cancels the job with the button, saves screenshots, and checks that
no request went to any origin but the server's."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api_harness import chat_line, live_server, openai_client, write_lines
from tests.cdp import Browser, chromium_path
from tests.test_api import KEY, Env, create, upload, wait_for


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    if chromium_path() is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing (scripts/setup installs it with apt-get)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    b = Browser(tmp_path)
    yield b
    b.close()


@pytest.fixture
def env(tmp_path: Path, redis_url: str, tiny_model_dir: Path) -> Iterator[Env]:
    e = Env(tmp_path, redis_url, tiny_model_dir)
    yield e
    e.close()


def test_the_page_shows_a_running_job_and_cancels_it(env: Env, browser: Browser, tmp_path: Path) -> None:
    with live_server(env.config(page_refresh_seconds=0.5)) as url:
        client = openai_client(url)
        # Long enough to still be running while the page is read (~100 s of work on the tiny model); cancelled.
        lines = [chat_line(i, max_tokens=400) for i in range(1000)]
        lines[7]["body"]["messages"][1]["content"] = "word " * 900  # over the context: one error to show
        batch = create(client, upload(client, write_lines(tmp_path / "in.jsonl", lines)).id)
        env.worker("--batch-size", "1", burst=False)
        wait_for("results", lambda: env.store.counts(batch.id).completed >= 12, logs=env.logs(), poll=0.05)

        browser.goto(f"{url}/")
        browser.wait_for("!document.getElementById('auth').hidden")  # the server wants a key
        browser.eval(
            f"document.getElementById('auth-key').value = {KEY!r};"
            "document.getElementById('auth-form').requestSubmit(); true"
        )
        row = f"document.querySelector('tr[data-job-id=\"{batch.id}\"]')"
        browser.wait_for(f"!!{row}")
        assert browser.eval(f"{row}.querySelector('.status').textContent") == "in_progress"
        assert 0 < browser.eval(f"{row}.querySelector('progress').value") < 1
        assert browser.eval(f"{row}.cells[3].textContent") == str(env.model)  # the model that runs: the worker's
        browser.wait_for("document.querySelectorAll('#workers tbody tr').length === 1")
        assert browser.eval("document.querySelector('#workers tbody tr').cells[3].textContent") == batch.id
        assert "ago" in browser.eval("document.querySelector('#workers tbody tr').cells[4].textContent")
        browser.screenshot(tmp_path / "jobs.png")

        browser.eval(f"{row}.querySelector('a').click(); true")  # to the job's page; the key stays in the tab
        browser.wait_for("document.getElementById('job-title').textContent.startsWith('batch_')")
        browser.wait_for("Number(document.getElementById('throughput-plot').dataset.points) >= 1")
        assert browser.eval("location.pathname") == f"/jobs/{batch.id}"
        progress = browser.eval("document.getElementById('job-progress').value")
        assert 0 < progress < 1
        assert "requests" in browser.eval("document.getElementById('job-progress-text').textContent")
        assert browser.eval("document.getElementById('job-eta').textContent").startswith("ETA ")
        plot = "document.querySelector('#throughput-plot polyline.series-completion')"
        points = browser.eval(f"{plot}.getAttribute('points')")
        assert len(points.split()) >= 1 and all("," in p for p in points.split())
        assert browser.eval("document.querySelector('#throughput-plot polyline.series-prompt') !== null")
        stats = browser.eval("document.getElementById('job-stats').innerText")
        assert "cache-hit share" in stats and "computed ÷ minimum" in stats
        error_row = browser.wait_for("[...document.querySelectorAll('#errors tbody tr')].map(r => r.innerText)")
        assert "req-7" in error_row[0] and "context_length_exceeded" in error_row[0]
        browser.screenshot(tmp_path / "job.png")

        browser.eval("document.getElementById('cancel').click(); true")
        browser.pump(0.5)
        browser.wait_for("document.getElementById('job-status').textContent === 'cancelled'", timeout=60)
        browser.wait_for("document.getElementById('cancel').hidden")
        counts = env.store.counts(batch.id)
        assert counts.cancelled > 0 and counts.completed >= 12 and counts.pending == 0
        browser.screenshot(tmp_path / "cancelled.png")

    assert browser.exceptions == []
    assert browser.requests, "the browser made no request"
    foreign = [u for u in browser.requests if not (u.startswith(url + "/") or u.startswith(("data:", "about:")))]
    assert foreign == [], foreign
    assert any(u.endswith("/static/app.js") for u in browser.requests)
    assert (tmp_path / "job.png").stat().st_size > 10_000

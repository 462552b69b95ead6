"""The web page in a real browser: headless Chromium from Debian's package loads the page while real workers run
real jobs (served with an API key, typed into the page), and the tests read the rendered DOM: live tokens per
second before any request finished, an ETA against the true end, the bar of completed, failed and cancelled
requests, input errors with their lines, a request found by custom_id with its output, the workers' tab, a
"no such job" page; they check that no request went to any origin but the server's, and save screenshots
(copied to $OMLX_PAGE_SCREENSHOTS when set: docs/images/ holds the README's)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api_harness import chat_line, live_server, openai_client, write_lines
from tests.cdp import Browser, chromium_path
from tests.test_api import KEY, Env, create, upload, wait_for
from tests.tiny_model import build_tiny_model

NO_EOS = {"0": -100, "1": -100, "2": -100}
"""logit_bias that bans the tiny models' special tokens: every answer runs to max_tokens (a steady job)."""


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    if chromium_path() is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing (scripts/setup installs it with apt-get)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    b = Browser(tmp_path)
    b.viewport(1280, 1400)
    yield b
    b.close()


@pytest.fixture
def env(tmp_path: Path, redis_url: str, tiny_model_dir: Path) -> Iterator[Env]:
    e = Env(tmp_path, redis_url, tiny_model_dir)
    yield e
    e.close()


@pytest.fixture(scope="module")
def slow_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A larger random model (wider, deeper, 2k context): a decode step is slow enough to watch."""
    return build_tiny_model(tmp_path_factory.mktemp("slow-model"), hidden_size=128, num_layers=4, context_length=2048)


def login(browser: Browser, url: str) -> None:
    browser.goto(url)
    browser.wait_for("!document.getElementById('auth').hidden")  # the server wants a key
    browser.eval(
        f"document.getElementById('auth-key').value = {KEY!r};"
        "document.getElementById('auth-form').requestSubmit(); true"
    )
    browser.wait_for("document.body.dataset.loaded === '1'")


def keep(path: Path, name: str) -> None:
    """Copy a screenshot to $OMLX_PAGE_SCREENSHOTS (the README's images) when that is set."""
    assert path.stat().st_size > 10_000
    target = os.environ.get("OMLX_PAGE_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, Path(target) / name)


def same_origin_only(browser: Browser, url: str) -> None:
    assert browser.exceptions == []
    assert browser.requests, "the browser made no request"
    foreign = [u for u in browser.requests if not (u.startswith(url + "/") or u.startswith(("data:", "about:")))]
    assert foreign == [], foreign
    assert any(u.endswith("/static/uPlot.iife.min.js") for u in browser.requests)


def cli(env: Env, *args: str) -> tuple[int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "omlx_jobs.cli", *args], env=env.env, capture_output=True, text=True, timeout=120
    )
    return proc.returncode, proc.stdout, proc.stderr


def metric_values(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    import httpx2 as httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def live_js(what: str) -> str:
    return f"Number(document.getElementById('job-now').dataset.{what} || 0)"


def test_live_figures_before_any_request_finishes_and_an_eta_near_the_truth(
    tmp_path: Path, redis_url: str, slow_model_dir: Path, browser: Browser
) -> None:
    env = Env(tmp_path, redis_url, slow_model_dir)
    try:
        with live_server(env.config(page_refresh_seconds=0.5)) as url:
            _watch_a_steady_job(env, url, browser, tmp_path)
            same_origin_only(browser, url)
    finally:
        env.close()


def _watch_a_steady_job(env: Env, url: str, browser: Browser, tmp_path: Path) -> None:
    n = 96
    client = openai_client(url)
    lines = [chat_line(i, max_tokens=400, logit_bias=NO_EOS) for i in range(n)]
    batch = create(client, upload(client, write_lines(tmp_path / "steady.jsonl", lines)).id)
    env.worker("--batch-size", "16", "--prefill-batch-size", "8", "--model-name", "slow-tiny", burst=False)
    login(browser, f"{url}/jobs/{batch.id}")

    # Tokens per second and requests in flight show while the first requests are still generating.
    browser.wait_for(f"{live_js('generated')} > 0 && {live_js('inflight')} > 0", timeout=120)
    assert env.store.counts(batch.id).completed == 0, "a request finished before the page showed a rate"
    assert browser.eval(f"{live_js('prompt')}") >= 0
    assert "tok/s" in browser.eval("document.getElementById('job-now').textContent")
    assert browser.eval("document.getElementById('job-model').textContent") == "tiny"  # the batch's name for it
    code, out, err = cli(env, "status", batch.id, "--json")
    assert code == 0, err
    status = json.loads(out)
    assert status["live"]["generated_tokens_per_second"] > 0 and status["live"]["requests_in_flight"] > 0
    assert status["live"]["workers"][0]["generated_tokens_per_second"] > 0
    assert status["request_counts"]["completed"] == 0 and status["eta"]["state"] in ("estimating", "tokens")
    assert status["model_name"] == "tiny" and status["model"] == str(env.model)  # the path: in --json only
    code, text, _ = cli(env, "status", batch.id)
    assert "generated" in text and "in flight" in text and str(env.model) not in text.split("waiting")[0]
    values = metric_values(url)
    assert values[("omlx_job_tokens_per_second", (("job", batch.id), ("kind", "generated"), ("model", "tiny")))] > 0
    assert values[("omlx_requests_in_flight", ())] > 0
    worker = [k for k in values if k[0] == "omlx_worker_tokens_per_second" and ("kind", "generated") in k[1]]
    assert worker and values[worker[0]] > 0 and ("model", "slow-tiny") in worker[0][1]
    code, text, _ = cli(env, "workers")
    assert "slow-tiny" in text and "GEN/S" in text

    # At half-way the page's ETA is within 2x of how long the rest actually takes.
    wait_for("half of the requests", lambda: env.store.counts(batch.id).completed >= n // 2, poll=0.05)
    browser.pump(1.2)  # a refresh or two after the half-way results
    eta = browser.eval("Object.assign({}, document.getElementById('job-eta').dataset)")
    read_at = time.monotonic()
    assert eta["state"] == "tokens", eta
    browser.screenshot(tmp_path / "running.png", full_page=True)
    keep(tmp_path / "running.png", "page-running-job.png")
    wait_for("the job", lambda: env.store.get_job(batch.id).status == "completed", timeout=300, poll=0.1)
    truth = time.monotonic() - read_at
    print(f"ETA at half-way {float(eta['seconds']):.1f} s; the rest took {truth:.1f} s")
    assert truth / 2 <= float(eta["seconds"]) <= truth * 2, (eta, truth)
    assert browser.eval("Number(document.getElementById('throughput-plot').dataset.points)") >= 2


def test_the_page_shows_a_running_job_and_cancels_it(env: Env, browser: Browser, tmp_path: Path) -> None:
    with live_server(env.config(page_refresh_seconds=0.5)) as url:
        client = openai_client(url)
        # Long enough to still be running while the page is read (~100 s of work on the tiny model); cancelled.
        lines = [chat_line(i, max_tokens=400) for i in range(1000)]
        lines[7]["body"]["messages"][1]["content"] = "word " * 900  # over the context: one error to show
        batch = create(client, upload(client, write_lines(tmp_path / "in.jsonl", lines)).id)
        env.worker("--batch-size", "1", burst=False)
        wait_for("results", lambda: env.store.counts(batch.id).completed >= 12, logs=env.logs(), poll=0.05)

        login(browser, f"{url}/")
        row = f"document.querySelector('tr[data-job-id=\"{batch.id}\"]')"
        browser.wait_for(f"!!{row}")
        assert browser.eval(f"{row}.querySelector('.status').textContent") == "in_progress"
        assert browser.eval(f"Number({row}.querySelector('.bar').dataset.completed)") >= 12
        assert browser.eval(f"{row}.cells[3].textContent") == "tiny"  # the short name, never the path

        browser.eval("document.getElementById('tab-workers').click(); true")  # the workers have a tab of their own
        browser.wait_for("document.querySelectorAll('#workers tbody tr').length === 1")
        worker_row = browser.eval("[...document.querySelector('#workers tbody tr').cells].map(c => c.textContent)")
        assert worker_row[1] == "busy" and worker_row[2] == env.model.name and batch.id in worker_row[6]
        assert "ago" in worker_row[7]
        browser.eval("document.querySelector('#workers tbody tr a').click(); true")  # to the job it runs

        browser.wait_for("document.getElementById('job-title').textContent.startsWith('batch_')")
        assert browser.eval("location.pathname") == f"/jobs/{batch.id}"
        assert "requests" in browser.eval("document.getElementById('job-progress-text').textContent")
        stats = browser.eval("document.getElementById('job-stats').innerText")
        assert "cache-hit share" in stats and "computed ÷ minimum" in stats
        error_row = browser.wait_for("[...document.querySelectorAll('#errors tbody tr')].map(r => r.innerText)")
        assert "req-7" in error_row[0] and "context_length_exceeded" in error_row[0]
        outcomes = browser.wait_for("[...document.querySelectorAll('#outcomes tbody tr')].map(r => r.dataset.outcome)")
        assert "context_length_exceeded" in outcomes and ("stop" in outcomes or "length" in outcomes)

        browser.eval("document.getElementById('cancel').click(); true")
        browser.pump(0.5)
        browser.wait_for("document.getElementById('job-status').textContent === 'cancelled'", timeout=60)
        browser.wait_for("document.getElementById('cancel').hidden")
        counts = env.store.counts(batch.id)
        assert counts.cancelled > 0 and counts.completed >= 12 and counts.failed == 1 and counts.pending == 0
        # Three colours, in proportion, and never 100% done.
        bar = browser.eval(
            "[...document.querySelectorAll('#job-bar span')].map(s => [s.className, s.getBoundingClientRect().width])"
        )
        widths = dict(bar)
        assert set(widths) == {"completed", "failed", "cancelled"}
        assert widths["cancelled"] / widths["completed"] == pytest.approx(counts.cancelled / counts.completed, rel=0.05)
        text = browser.eval("document.getElementById('job-progress-text').textContent")
        assert "100" not in text and f"{counts.completed} / 1,000 completed" in text and "cancelled" in text
        assert browser.eval("document.getElementById('job-eta').textContent") == ""
        browser.screenshot(tmp_path / "cancelled.png", full_page=True)
        keep(tmp_path / "cancelled.png", "page-cancelled-job.png")
        _, out, _ = cli(env, "jobs")
        line = next(x for x in out.splitlines() if x.startswith(batch.id))
        assert f"{counts.completed}/1000 ok, 1 failed, {counts.cancelled} cancelled" in line
        assert line.endswith(" tiny") and str(env.model) not in line
        assert "nothing was cancelled" in cli(env, "cancel", batch.id)[1]

        browser.goto(f"{url}/")  # the list shows it the same way
        browser.wait_for(f"!!{row} && {row}.querySelector('.status').textContent === 'cancelled'")
        assert browser.eval(f"{row}.querySelectorAll('.bar span').length") == 3
        same_origin_only(browser, url)


def test_a_batch_rejected_for_bad_lines_shows_them(env: Env, browser: Browser, tmp_path: Path) -> None:
    with live_server(env.config(page_refresh_seconds=0.5)) as url:
        client = openai_client(url)
        lines: list[Any] = [chat_line(i) for i in range(6)]
        lines[2] = "{not json"
        lines[4]["body"]["temperature"] = 9
        batch = create(client, upload(client, write_lines(tmp_path / "bad.jsonl", lines)).id)
        assert batch.status == "failed"
        login(browser, f"{url}/jobs/{batch.id}")
        browser.wait_for("!document.getElementById('input-errors').hidden")
        rows = browser.eval("[...document.querySelectorAll('#validation-errors tbody tr')].map(r => r.innerText)")
        assert len(rows) == 2
        assert rows[0].startswith("3") and rows[1].startswith("5") and "temperature" in rows[1]
        text = browser.eval("document.getElementById('job-progress-text').textContent")
        assert "100" not in text and "rejected at submit: 2 bad line(s)" in text
        assert browser.eval("document.querySelectorAll('#job-bar span').length") == 0  # nothing ran: an empty bar
        browser.screenshot(tmp_path / "failed.png", full_page=True)
        keep(tmp_path / "failed.png", "page-failed-job.png")

        browser.goto(f"{url}/jobs/batch_does_not_exist")  # an unknown id: a page that says so, and a way back
        browser.wait_for("!document.getElementById('missing-view').hidden")
        assert "batch_does_not_exist" in browser.eval("document.getElementById('missing-text').textContent")
        assert browser.eval("document.querySelector('#missing-view a').getAttribute('href')") == "/"
        assert browser.eval("document.getElementById('job-view').hidden")
        same_origin_only(browser, url)


def test_a_request_found_by_custom_id_shows_its_output(env: Env, browser: Browser, tmp_path: Path) -> None:
    with live_server(env.config(page_refresh_seconds=1.0)) as url:
        client = openai_client(url)
        lines = [chat_line(i, max_tokens=3 + i % 20) for i in range(70)]
        lines[40]["body"]["messages"][1]["content"] = "word " * 900  # fails alone: context_length_exceeded
        batch = create(client, upload(client, write_lines(tmp_path / "in.jsonl", lines)).id)
        assert env.worker().wait(timeout=300) == 0, env.logs()
        assert env.store.get_job(batch.id).status == "completed"
        login(browser, f"{url}/jobs/{batch.id}")
        rows = "[...document.querySelectorAll('#requests tbody tr')]"
        browser.wait_for(f"{rows}.length === 25")
        assert browser.eval(f"{rows}.map(r => r.dataset.customId)") == [f"req-{i}" for i in range(25)]
        browser.eval("document.getElementById('req-next').click(); true")  # the next page, from the server
        browser.wait_for(f"{rows}[0].dataset.customId === 'req-25'")
        browser.eval("document.getElementById('req-prev').click(); true")
        browser.wait_for(f"{rows}[0].dataset.customId === 'req-0'")

        browser.eval(
            "document.getElementById('req-q').value = 'req-37';"
            "document.getElementById('request-filters').requestSubmit(); true"
        )
        browser.wait_for(f"{rows}.length === 1 && {rows}[0].dataset.customId === 'req-37'")
        stored = next(r for r in env.store.iter_requests(batch.id) if r.custom_id == "req-37")
        cells = browser.eval(f"[...{rows}[0].cells].map(c => c.textContent)")
        assert cells[2] == "completed" and cells[3] == stored.finish_reason
        assert cells[6].startswith(stored.output_text[:100].rstrip()) and "question 37" in cells[5]
        browser.eval(f"{rows}[0].querySelector('td.id a').click(); true")  # the whole request and its result
        browser.wait_for("document.getElementById('request-detail').dataset.customId === 'req-37'")
        result = json.loads(browser.eval("document.getElementById('detail-output').textContent"))
        assert result["custom_id"] == "req-37"
        assert result["response"]["body"]["choices"][0]["message"]["content"] == stored.output_text
        line = json.loads(browser.eval("document.getElementById('detail-input').textContent"))
        assert line["body"]["messages"][1]["content"] == "question 37"
        browser.screenshot(tmp_path / "requests.png", full_page=True)
        keep(tmp_path / "requests.png", "page-requests-table.png")

        # An outcome in the breakdown filters the table to its requests.
        browser.eval("document.querySelector('#outcomes tr[data-outcome=\"context_length_exceeded\"] a').click(); true")
        browser.wait_for(f"{rows}.length === 1 && {rows}[0].dataset.customId === 'req-40'")
        histograms = browser.eval("Number(document.getElementById('hist-completion').dataset.points)")
        assert histograms >= 2
        _the_list_filters_and_searches(env, browser, url, tmp_path, batch.id)
        same_origin_only(browser, url)


def _the_list_filters_and_searches(env: Env, browser: Browser, url: str, tmp_path: Path, done: str) -> None:
    """Beside the finished job: one rejected, one cancelled while queued, one waiting for a worker."""
    client = openai_client(url)
    rejected = create(client, upload(client, write_lines(tmp_path / "bad.jsonl", ["{oops"])).id)
    cancelled = create(client, upload(client, write_lines(tmp_path / "c.jsonl", [chat_line(i) for i in range(30)])).id)
    client.batches.cancel(cancelled.id)
    waiting = create(client, upload(client, write_lines(tmp_path / "w.jsonl", [chat_line(i) for i in range(40)])).id)
    browser.goto(f"{url}/")
    rows = "[...document.querySelectorAll('#jobs tbody tr')]"
    browser.wait_for(f"{rows}.length === 4")
    assert browser.eval(f"{rows}.map(r => r.dataset.jobId)") == [waiting.id, cancelled.id, rejected.id, done]
    browser.screenshot(tmp_path / "jobs.png")
    keep(tmp_path / "jobs.png", "page-job-list.png")
    browser.eval(
        "document.getElementById('filter-status').value = 'cancelled';"
        "document.getElementById('job-filters').requestSubmit(); true"
    )
    browser.wait_for(f"{rows}.length === 1 && {rows}[0].dataset.jobId === {cancelled.id!r}")
    browser.eval(
        "document.getElementById('filter-status').value = '';"
        f"document.getElementById('filter-q').value = {done[:20]!r};"
        "document.getElementById('job-filters').requestSubmit(); true"
    )
    browser.wait_for(f"{rows}.length >= 1 && {rows}.every(r => r.dataset.jobId.startsWith({done[:20]!r}))")

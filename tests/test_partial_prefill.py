"""After kills, the job's computed prompt tokens miss what killed runs prefilled (issue 21, finding 16): a run
adds its accounting when it ends, so `status` labels the figure partial and says how many runs never counted."""

from __future__ import annotations

from pathlib import Path

from omlx_jobs.cli.render import status_lines
from omlx_jobs.jobs import lifecycle
from omlx_jobs.jobs.submit import load_job
from omlx_jobs.store import Store


def test_killed_runs_mark_the_computed_figure_partial(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"custom_id": "r{i}", "prompt": "Hello {i}", "max_tokens": 2}}\n' for i in range(3)))
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    job = load_job(store, src, "m").job_id
    settled = store.start_run(job, 0, 3, "w1", "m")
    store.finish_run(settled, "done")
    store.start_run(job, 0, 3, "w2", "m")  # killed: never finished
    failed = store.start_run(job, 0, 3, "w2", "m")
    store.finish_run(failed, "failed", "boom")
    store.add_job_stats(job, prefill_tokens=10, trie_min_tokens=30)
    workers = store.job_workers(job)
    assert sorted((w.worker, w.unsettled_runs) for w in workers) == [("w1", 0), ("w2", 2)]

    running = lifecycle.summarize(store.get_job(job), store.counts(job), workers=workers)
    assert running["prefix"]["unsettled_runs"] == 2 and not running["prefix"]["partial"]  # still running: live

    store.transition(job, lifecycle.COMPLETED)
    ended = lifecycle.summarize(store.get_job(job), store.counts(job), workers=workers)
    assert ended["prefix"]["partial"]
    (line,) = [x for x in status_lines(ended) if x.startswith("prefix")]
    assert "computed 10 (partial: 2 shard run(s) were killed or failed" in line and "minimum 30" in line

    ok = lifecycle.summarize(store.get_job(job), store.counts(job), workers=[w for w in workers if w.worker == "w1"])
    assert not ok["prefix"]["partial"]
    assert "partial" not in next(x for x in status_lines(ok) if x.startswith("prefix"))

"""A FIFO (or another non-file) planted in --cache-dir never hangs the worker (issue 21, finding 17): the disk
tier opens nothing that is not a regular file, and opens its own files without blocking."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")

from omlx_jobs.worker.cache.disk import DiskCache, read_regular
from omlx_jobs.worker.prompts import token_key


def within(seconds: float, fn):  # type: ignore[no-untyped-def]
    """fn() in a thread; fails (instead of hanging the suite) if it blocks."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked on a FIFO"
    return out[0]


def test_fifos_in_the_cache_folder_are_ignored(tmp_path: Path) -> None:
    folder = tmp_path / "model-x"
    folder.mkdir()
    key = token_key([1, 2, 3, 4])
    probe = DiskCache(tmp_path, "model-x", max_bytes=1 << 20)
    target = probe._path(key)
    os.mkfifo(target)  # where the key's cache file would be
    os.mkfifo(target.with_suffix(".tokens"))
    os.mkfifo(folder / "other.tokens")
    (folder / "other.safetensors").write_bytes(b"x")
    (folder / "third.safetensors").mkdir()
    (folder / "third.tokens").write_bytes(key)

    disk = within(5, lambda: DiskCache(tmp_path, "model-x", max_bytes=1 << 20))
    assert len(disk) == 0
    assert within(5, lambda: disk.load(key)) is None
    assert disk.best_prefix(key, trimmable=True) is None
    assert within(5, lambda: read_regular(target)) is None
    assert read_regular(folder / "third.tokens") == key

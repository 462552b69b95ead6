"""--allow-files-from under a race (issue 21, 2): a thread swaps a folder inside the allowed one with a link to
outside while the worker's own fetch reads through it; no read ever returns the outside file. Both ways of
opening beneath the folder run: openat2 (this kernel has it) and the walk of O_NOFOLLOW components (macOS,
older kernels)."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from omlx_jobs.jobs import beneath, images
from omlx_jobs.jobs.images import ImageAccess, ImageSourceError

INSIDE = b"\x89PNG\r\n\x1a\n inside the allowed folder"
OUTSIDE = b"\x89PNG\r\n\x1a\n SECRET outside the allowed folder"
READS = 3000
AT_FDCWD, RENAME_EXCHANGE = -100, 2


@pytest.fixture(params=["openat2", "walk"])
def opener(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "walk":
        monkeypatch.setitem(beneath._state, "openat2", False)
    elif not beneath._state["openat2"]:
        pytest.skip("this kernel has no openat2")
    return str(request.param)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """allowed/d/cat.png (inside), allowed/link -> ../outside, outside/cat.png (the secret)."""
    (tmp_path / "allowed" / "d").mkdir(parents=True)
    (tmp_path / "allowed" / "d" / "cat.png").write_bytes(INSIDE)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "cat.png").write_bytes(OUTSIDE)
    (tmp_path / "allowed" / "link").symlink_to(tmp_path / "outside")
    return tmp_path


def _exchange() -> object:
    """renameat2(RENAME_EXCHANGE) from glibc when it has it: an atomic swap of a folder and a link."""
    libc = ctypes.CDLL(None, use_errno=True)
    return getattr(libc, "renameat2", None)


def _flip(allowed: Path, stop: threading.Event, swaps: list[int]) -> None:
    a, b = os.fsencode(allowed / "d"), os.fsencode(allowed / "link")
    renameat2 = _exchange()
    while not stop.is_set():
        if renameat2 is not None and renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) == 0:
            swaps[0] += 1
            continue
        if renameat2 is not None and ctypes.get_errno() not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(ctypes.get_errno(), "renameat2")
        renameat2 = None  # the file system or libc cannot exchange: swap by three renames instead
        os.rename(allowed / "d", allowed / "d.tmp")
        os.rename(allowed / "link", allowed / "d")
        os.rename(allowed / "d.tmp", allowed / "link")
        swaps[0] += 1


@pytest.fixture
def flipping(tree: Path) -> Iterator[list[int]]:
    stop, swaps = threading.Event(), [0]
    thread = threading.Thread(target=_flip, args=(tree / "allowed", stop, swaps), daemon=True)
    thread.start()
    try:
        yield swaps
    finally:
        stop.set()
        thread.join(timeout=10)


def test_a_swapped_link_never_reads_outside(tree: Path, opener: str, flipping: list[int]) -> None:
    from omlx_jobs.worker.vision.inputs.images import ImageError, fetch

    access = ImageAccess.create([tree / "allowed"])
    url = str(tree / "allowed" / "d" / "cat.png")
    got = {"inside": 0, "refused": 0}
    for _ in range(READS):
        try:
            data = fetch(url, access)  # the worker's own fetch: classify (resolve and check), then open
        except ImageError:
            got["refused"] += 1
            continue
        assert data != OUTSIDE, f"read the file outside the allowed folder ({opener})"
        assert data == INSIDE
        got["inside"] += 1
    assert flipping[0] > 100, "the flipper must have swapped the folder many times"
    # Both states were seen: the race window was open, and reads through the folder still succeed.
    assert got["inside"] > 0 and got["refused"] > 0, got


def test_open_beneath_refuses_links_on_the_way_and_at_the_end(tree: Path, opener: str) -> None:
    allowed = tree / "allowed"
    os.close(beneath.open_beneath(allowed, "d/cat.png"))
    (allowed / "d" / "last.png").symlink_to(tree / "outside" / "cat.png")
    for relative in ("link/cat.png", "d/last.png"):
        with pytest.raises(beneath.EscapeRefused):
            beneath.open_beneath(allowed, relative)
    for relative in ("../outside/cat.png", "/etc/passwd"):
        with pytest.raises(beneath.EscapeRefused):
            beneath.open_beneath(allowed, relative)
    with pytest.raises(FileNotFoundError):
        beneath.open_beneath(allowed, "d/none.png")


def test_a_fifo_swapped_in_after_the_check_does_not_hang(tree: Path, opener: str) -> None:
    access = ImageAccess.create([tree / "allowed"])
    path = tree / "allowed" / "d" / "cat.png"
    source = images.classify(str(path), access)  # a regular file when checked
    path.unlink()
    os.mkfifo(path)  # no writer will ever come
    t0 = time.monotonic()
    with pytest.raises(ImageSourceError) as exc:
        images.read_confined(source, access)
    assert exc.value.code == "invalid_image" and time.monotonic() - t0 < 5

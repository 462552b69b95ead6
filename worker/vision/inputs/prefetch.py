"""Remote images fetched ahead, several at once: a page's http(s) images go to a small thread pool.

Each fetch keeps its own total deadline (jobs/fetch.py), so a slow server costs one deadline for the images
fetched together, not one per image in turn, and rows planned meanwhile do not wait for fetches started early.
At most `ahead` fetches are started and not yet taken: memory stays bounded.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from omlx_jobs.jobs.images import ImageAccess
from omlx_jobs.worker.vision.inputs.images import fetch


def is_remote(url: str) -> bool:
    return url.startswith(("http://", "https://"))


class RemotePrefetch:
    """Fetches of remote image URLs, started ahead of the prompts that need them, under one ImageAccess."""

    def __init__(self, access: ImageAccess, *, workers: int = 8, ahead: int = 32) -> None:
        self.access, self.ahead = access, ahead
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="omlx-image-fetch")
        self._started: dict[str, Future[bytes]] = {}
        self._waiting: deque[str] = deque()

    def want(self, urls: list[str]) -> None:
        """Fetch these remote URLs soon."""
        self._waiting.extend(u for u in dict.fromkeys(urls) if u not in self._started and u not in self._waiting)
        while self._waiting and len(self._started) < self.ahead:
            url = self._waiting.popleft()
            self._started[url] = self._pool.submit(fetch, url, self.access)

    def take(self, url: str, access: ImageAccess) -> bytes:
        """The bytes of `url` (a media.Fetcher): from a fetch started ahead, else fetched now; ImageError as fetch."""
        future = self._started.pop(url, None) if access == self.access else None
        self.want([])  # start the next one waiting
        return future.result() if future is not None else fetch(url, access)

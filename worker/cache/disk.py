"""Disk tier of the prefix cache: warm-up prefixes saved with mlx-lm's save_prompt_cache.

Files live in DIR/<model identity>/<hash of the token ids>.safetensors, beside a .tokens file holding the
token ids, so a later job or a restarted worker finds the longest saved prefix. Size is capped; the least
recently used files go first. A corrupt or mismatched file is removed and ignored, never a crash.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from omlx_jobs.worker.cache.positioned import positioned
from omlx_jobs.worker.prompts import common_prefix, positions

log = logging.getLogger(__name__)


class DiskCache:
    def __init__(self, root: str | os.PathLike[str], model_identity: str, max_bytes: int) -> None:
        self.model_identity = model_identity
        self.dir = Path(root).expanduser() / model_identity
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.max_bytes = max_bytes
        self._index: dict[bytes, Path] = {}
        for tok_file in self.dir.glob("*.tokens"):
            data = tok_file.with_suffix(".safetensors")
            tokens = read_regular(tok_file) if is_regular(data) else None
            if tokens is not None:
                self._index[tokens] = data
            elif not data.exists() and is_regular(tok_file):
                tok_file.unlink(missing_ok=True)
            else:  # a FIFO, a device, a link or a folder planted in the cache folder: never opened, never waited on
                log.warning("ignoring %s in the prefix cache folder: not a regular file", tok_file)

    def _path(self, key: bytes) -> Path:
        return self.dir / f"{hashlib.sha256(key).hexdigest()[:40]}.safetensors"

    def __len__(self) -> int:
        return len(self._index)

    def best_prefix(self, key: bytes, *, trimmable: bool, min_tokens: int = 1) -> tuple[bytes, int] | None:
        """The saved key sharing the longest prefix (at least `min_tokens`) with `key`.

        Without trimmable caches only saved keys that are whole prefixes of `key` count.
        """
        best: tuple[bytes, int] | None = None
        for saved in self._index:
            shared = common_prefix(saved, key)
            if not trimmable and shared != positions(saved):
                continue
            if shared >= min_tokens and (best is None or shared > best[1]):
                best = (saved, shared)
        return best

    def load(self, key: bytes) -> list[Any] | None:
        path = self._index.get(key) or self._path(key)
        if not is_regular(path):  # absent, or not a file we wrote (a FIFO would block the open for ever)
            return None
        try:
            cache, meta = load_prompt_cache(str(path), return_metadata=True)
            if meta.get("model") != self.model_identity or meta.get("tokens") != key.hex():
                raise ValueError("file does not match this model or prefix")
        except Exception as exc:
            log.warning("ignoring unusable prefix cache file %s (%s); removing it", path, exc)
            self._drop(key, path)
            return None
        with contextlib.suppress(OSError):  # recency only; the file may have just been removed by another worker
            os.utime(path)
        if "rope_breaks" in meta:  # a vision model's caches: their RoPE offsets after each image
            breaks = tuple((int(p), int(d)) for p, d in json.loads(meta["rope_breaks"]))
            return positioned(cache, breaks)
        return cache

    def save(self, key: bytes, cache: list[Any]) -> None:
        """Write a prefix's cache file. It never raises: a full disk or a read-only folder is logged and the
        prefix stays in memory only (the disk tier is an optimization, and must not stop generation)."""
        tmp: str | None = None
        path, placed = self._path(key), False
        try:
            if path.exists():
                os.utime(path)
                return
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".safetensors")
            os.close(fd)
            meta = {"model": self.model_identity, "tokens": key.hex()}
            breaks = getattr(cache[0], "breaks", None) if cache else None
            if breaks is not None:  # mlx-lm saves its own cache classes: the offsets go in the metadata
                meta["rope_breaks"] = json.dumps([list(b) for b in breaks])
                cache = [_plain(c) for c in cache]
            save_prompt_cache(tmp, cache, metadata=meta)
            os.replace(tmp, path)
            tmp, placed = None, True
            _write_replacing(path.with_suffix(".tokens"), key)
            self._index[key] = path
            self._enforce_cap()
        except Exception as exc:
            log.warning("could not save a prefix cache file in %s: %s", self.dir, exc)
            with contextlib.suppress(OSError):
                if tmp is not None:
                    Path(tmp).unlink(missing_ok=True)
                if placed and key not in self._index:  # without its .tokens file no later start would find it
                    path.unlink(missing_ok=True)

    def _drop(self, key: bytes, path: Path) -> None:
        self._index.pop(key, None)
        path.unlink(missing_ok=True)
        path.with_suffix(".tokens").unlink(missing_ok=True)

    def _enforce_cap(self) -> None:
        files = [(p.stat().st_mtime, p.stat().st_size, k, p) for k, p in self._index.items() if p.exists()]
        total = sum(f[1] for f in files)
        for _, size, key, path in sorted(files):
            if total <= self.max_bytes:
                break
            self._drop(key, path)
            total -= size


def is_regular(path: Path) -> bool:
    """A regular file, not followed through a link (lstat): never a FIFO, a device or a folder."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def read_regular(path: Path, limit: int = 64 * 1024**2) -> bytes | None:
    """The bytes of a regular file, opened without blocking and without following a link; None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read(limit)


def _write_replacing(path: Path, data: bytes) -> None:
    """Write through a temporary file and rename over `path`: whatever was there (a FIFO too) is replaced, not
    opened."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _plain(c: Any) -> Any:
    """A KVCache subclass's keys and values as mlx-lm's own KVCache (what save_prompt_cache can name)."""
    if type(c) is KVCache or not isinstance(c, KVCache):
        return c
    k = KVCache()
    k.keys, k.values, k.offset = c.keys, c.values, c.offset
    return k

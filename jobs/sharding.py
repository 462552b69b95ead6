"""Prefix-aware shards: a sort key per request, and the cut of the sorted job into contiguous shards. Pure.

Submit has no tokenizer, so it orders requests by a canonical text rendering of the prompt (system messages
first, then the rest in order). The key is the CRC-32 of successive chunks of that text: keys compare in
C, a key is small, and requests sharing a text prefix of k whole chunks share the key's first k units, so
sorting by key puts them next to each other (a trie's depth-first order, at chunk granularity). Chunks
grow with depth (64 characters, about 16 tokens, then longer), so a key stays under 200 bytes.

The cut walks the sorted keys once with a bounded buffer. Each shard ends near `size` requests, at the
boundary in [size/2, 3*size/2] that shares the least prefix with its neighbour: a group of requests sharing
a prefix is kept whole when it fits, and a larger one is split where it branches highest.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from omlx_jobs.jobs.embeddings import canonical_text as embeddings_text
from omlx_jobs.jobs.formats import CHAT_URL, EMBEDDINGS_URL

DEFAULT_SHARD_SIZE = 1024
"""Requests per shard. A worker holds a shard's rows and prompt tokens in memory (tens of MB at this size),
and its batch drains at the end of each shard, so much smaller shards cost throughput."""

CHUNK_CHARS = (64,) * 8 + (128,) * 8 + (256,) * 8 + (512,) * 8 + (1024,) * 8
"""UTF-8 bytes per key chunk (characters, for ASCII text); beyond their sum (15,872) requests tie and keep
file order."""
UNIT = 4
"""Bytes per chunk in a key."""

_SYSTEM_ROLES = ("system", "developer")


def canonical_text(endpoint: str, body: dict[str, Any]) -> str:
    """The prompt as text that is equal for requests whose prompts are equal, and shares their prefixes.

    Chat messages: system (and developer) messages first, then the others in order, each as role and content
    between separators; completion prompts as given (token-id prompts as their numbers). The endpoint comes
    first, so chat and completion prompts never share a group.
    """
    if endpoint == EMBEDDINGS_URL:
        return embeddings_text(body)
    if endpoint == CHAT_URL:
        messages = body.get("messages") or []
        ordered = [m for m in messages if m["role"] in _SYSTEM_ROLES]
        ordered += [m for m in messages if m["role"] not in _SYSTEM_ROLES]
        return "c\x1d" + "".join(f"{m['role']}\x1f{m['content']}\x1e" for m in ordered)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return "t\x1d" + ",".join(map(str, prompt))
    return "p\x1d" + str(prompt or "")


def _bounds() -> list[tuple[int, int]]:
    out, start = [], 0
    for size in CHUNK_CHARS:
        out.append((start, start + size))
        start += size
    return out


_BOUNDS = _bounds()


def prefix_key(text: str) -> bytes:
    """The sort key of a canonical text: one 4-byte CRC-32 per chunk of its UTF-8 bytes (see CHUNK_CHARS)."""
    data = text.encode("utf-8", "surrogatepass")
    crcs = [zlib.crc32(data[lo:hi]) for lo, hi in _BOUNDS if lo < len(data)]
    return struct.pack(f">{len(crcs)}I", *crcs)


def request_key(endpoint: str, body: dict[str, Any]) -> bytes:
    return prefix_key(canonical_text(endpoint, body))


def shared_units(a: bytes | None, b: bytes | None) -> int:
    """Leading key chunks two keys share (0 when either is missing: an invalid line has no key)."""
    if not a or not b or a[:UNIT] != b[:UNIT]:
        return 0
    hi = min(len(a), len(b)) // UNIT
    if a[: hi * UNIT] == b[: hi * UNIT]:
        return hi
    lo = 1  # a[:lo] == b[:lo] holds, a[:hi] != b[:hi]: binary search over C-level slice compares
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * UNIT] == b[: mid * UNIT]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class Cut:
    """A shard [first, end) of the sorted order, with the prefix groups of its first and last request and
    how many of its requests belong to each (a group: consecutive requests sharing a key chunk)."""

    first: int
    end: int
    group_first: int
    group_last: int
    lead_rows: int
    tail_rows: int


def cut_shards(keys: Iterable[bytes | None], size: int = DEFAULT_SHARD_SIZE) -> Iterator[Cut]:
    """Cut keys (in sorted order) into shards of about `size` (between size/2 and 3*size/2, the last one
    possibly smaller), each ending where its last and the next request share the fewest key chunks."""
    if size < 1:
        raise ValueError("the shard size must be at least 1")
    lo, hi = max(1, size // 2), size + size // 2
    start = 0  # first position of the open shard
    depth: list[int] = []  # depth[i]: chunks shared by rows start+i-1 and start+i (depth[0] unused)
    group: list[int] = []  # group number of row start+i
    prev: bytes | None = None
    g = -1
    for key in keys:
        d = shared_units(prev, key)  # 0 for the first key (prev is None)
        if d == 0:
            g += 1
        depth.append(d)
        group.append(g)
        prev = key
        if len(depth) > hi:  # rows start..start+hi seen: every boundary of the window is known
            b = _best_boundary(depth, lo, hi, size)
            yield _cut(start, b, group)
            start += b
            depth, group = depth[b:], group[b:]
            depth[0] = 0
    if depth:
        yield _cut(start, len(depth), group)


def _best_boundary(depth: list[int], lo: int, hi: int, size: int) -> int:
    """The boundary b in [lo, hi] (the shard is rows [0, b)) with the least shared prefix, nearest to size."""
    return min(range(lo, hi + 1), key=lambda b: (depth[b], abs(b - size)))


def _cut(start: int, length: int, group: list[int]) -> Cut:
    first_group, last_group = group[0], group[length - 1]
    lead = next((i for i in range(length) if group[i] != first_group), length)
    tail = next((i for i in range(length) if group[length - 1 - i] != last_group), length)
    return Cut(start, start + length, first_group, last_group, lead, tail)

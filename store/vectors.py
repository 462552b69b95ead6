"""Embedding vectors as the store keeps them (`requests.vectors`): float32 bytes, not JSON text.

One blob per request: a 12-byte header (b"OV", a version byte, a flags byte, then the item count and the
dimension as little-endian uint32), then count x dim float32 little-endian values. A 1,024-dim vector costs
4,108 bytes stored (4,096 + its share of the header) against ~12 KB as JSON floats. The flags keep how the
request asked to have them written back (bit 0: base64), so export needs no request body. Pure: array and
struct only (no numpy on the client side).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

_HEADER = struct.Struct("<2sBBII")
_MAGIC, _VERSION = b"OV", 1
_BASE64 = 1


@dataclass(frozen=True)
class StoredVectors:
    """A request's vectors: `count` of `dim` float32 values each, in `data` (little-endian)."""

    count: int
    dim: int
    data: bytes
    base64: bool = False

    @classmethod
    def from_floats(cls, vectors: Sequence[Sequence[float]], *, base64: bool = False) -> StoredVectors:
        """Vectors as lists of floats (each of one dimension)."""
        dim = len(vectors[0]) if vectors else 0
        values = array("f")
        for v in vectors:
            if len(v) != dim:
                raise ValueError(f"vectors of different dimensions ({len(v)} and {dim})")
            values.extend(v)
        return cls(len(vectors), dim, _little(values).tobytes(), base64)

    @classmethod
    def from_bytes(cls, count: int, dim: int, data: bytes, *, base64: bool = False) -> StoredVectors:
        """Vectors already as float32 little-endian bytes (a worker's numpy buffer)."""
        if len(data) != 4 * count * dim:
            raise ValueError(f"{len(data)} bytes do not hold {count} vectors of {dim} float32")
        return cls(count, dim, bytes(data), base64)

    def encode(self) -> bytes:
        return _HEADER.pack(_MAGIC, _VERSION, _BASE64 if self.base64 else 0, self.count, self.dim) + self.data

    @classmethod
    def decode(cls, blob: bytes) -> StoredVectors:
        magic, version, flags, count, dim = _HEADER.unpack_from(blob)
        if magic != _MAGIC or version != _VERSION:
            raise ValueError("not a stored vectors blob (or a newer version of one)")
        data = bytes(blob[_HEADER.size :])
        return cls.from_bytes(count, dim, data, base64=bool(flags & _BASE64))

    def vector_bytes(self, i: int) -> bytes:
        """Vector `i` as float32 little-endian bytes (what OpenAI's base64 encoding holds)."""
        width = 4 * self.dim
        return self.data[i * width : (i + 1) * width]

    def vector(self, i: int) -> list[float]:
        """Vector `i` as Python floats (each float32 value exactly)."""
        values = array("f")
        values.frombytes(self.vector_bytes(i))
        return _little(values).tolist()


def _little(values: array) -> array:
    """`values` as little-endian (swapped in place on a big-endian machine)."""
    if sys.byteorder == "big":
        values.byteswap()
    return values

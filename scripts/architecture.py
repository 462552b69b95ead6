#!/usr/bin/env python3
"""Check docs/architecture.md against the package's files: every module listed once, nothing listed that is gone.

    python3 scripts/architecture.py          # lists missing and stale entries; exit 1 if there are any
    python3 scripts/architecture.py --draft  # also prints a draft line for each missing module, from its docstring

docs/architecture.md lists modules as markdown list items, one a line: - `worker/engine.py` — what it holds.
tests/test_docs.py runs the same check.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
NOT_PACKAGE = {"tests", "bench", "scripts", "docs", "examples", "build", "dist"}
ENTRY = re.compile(r"^- `([^`]+\.py)` — \S", re.M)


def package_modules(root: Path = ROOT) -> list[str]:
    """Every .py file of the package (the repository root is `omlx_jobs`), relative to the root."""
    found = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        if parts[0] in NOT_PACKAGE or any(p.startswith(".") or p.endswith(".egg-info") for p in parts[:-1]):
            continue
        found.append("/".join(parts))
    return sorted(found)


def listed_modules(text: str) -> list[str]:
    """The modules docs/architecture.md lists, in its order."""
    return ENTRY.findall(text)


def draft(module: str, root: Path = ROOT) -> str:
    """A list line for a module, from the first sentence of its docstring (to edit, not to keep as is)."""
    doc = ast.get_docstring(ast.parse((root / module).read_text())) or "TODO"
    first = " ".join(doc.split("\n\n")[0].split())
    return f"- `{module}` — {first}"


def main() -> int:
    listed = listed_modules(DOC.read_text())
    modules = set(package_modules())
    missing = sorted(modules - set(listed))
    stale = sorted(set(listed) - modules)
    twice = sorted({m for m in listed if listed.count(m) > 1})
    for title, names in (("missing", missing), ("stale (no such file)", stale), ("listed twice", twice)):
        for name in names:
            print(f"{title}: {name}")
    if "--draft" in sys.argv[1:]:
        for name in missing:
            print(draft(name))
    return 1 if missing or stale or twice else 0


if __name__ == "__main__":
    sys.exit(main())

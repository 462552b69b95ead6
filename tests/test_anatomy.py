"""The engine's shape stays as issue 9 left it: small modules and functions, one door to mlx-lm's internals,
one writer of cache lifetimes, leaf modules for errors and defaults. Reads source code only."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = sorted((ROOT / "worker").rglob("*.py"))
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400
BACKEND = "backend/"


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT / "worker"))


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def mlx_lm_private_names() -> set[str]:
    """Every `_name` that mlx-lm defines or reads: private functions, classes and attributes."""
    spec = importlib.util.find_spec("mlx_lm")
    assert spec is not None and spec.submodule_search_locations
    names: set[str] = set()
    for path in Path(next(iter(spec.submodule_search_locations))).rglob("*.py"):
        for node in ast.walk(tree(path)):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "name", None)
            if isinstance(name, str) and name.startswith("_") and not name.startswith("__"):
                names.add(name)
    return names


def test_worker_functions_and_modules_stay_small() -> None:
    long_functions, long_modules = [], []
    for path in WORKER:
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            long_modules.append(f"{rel(path)}: {lines} lines")
        for node in ast.walk(tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{rel(path)}:{node.lineno} {node.name}: {length} lines")
    assert long_modules == [], f"modules over {MAX_MODULE_LINES} lines hold two concepts: split them"
    assert long_functions == [], f"functions over {MAX_FUNCTION_LINES} lines: split them"


def test_only_the_backend_touches_mlx_lm_internals() -> None:
    private = mlx_lm_private_names()
    assert {"_merge_caches", "_right_pad_prompts", "_generation_batch", "_counters"} <= private
    found = []
    for path in WORKER:
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("mlx_lm", "mlx"):
                found += [f"{rel(path)}: imports {a.name}" for a in node.names if a.name.startswith("_")]
                if "BatchGenerator" in {a.name for a in node.names}:
                    found.append(f"{rel(path)}: imports BatchGenerator")
            # Our own private state is reached through self; mlx-lm's through the objects it hands us.
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                found.append(f"{rel(path)}:{node.lineno}: .{node.attr}")
    outside = [f for f in found if not f.startswith(BACKEND)]
    assert outside == [], "only worker/backend.py may use mlx-lm's private names or BatchGenerator"
    assert any(f.startswith(BACKEND) for f in found)  # the check sees the backend's own uses


def test_only_lifetimes_writes_pins_and_needed_until() -> None:
    writers = []
    for path in WORKER:
        for node in ast.walk(tree(path)):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr in ("pins", "needed_until"):
                        writers.append(f"{rel(path)}:{node.lineno}")
    assert writers and all(w.startswith("cache/lifetimes.py") for w in writers), writers


@pytest.mark.parametrize("name", ["errors.py", "defaults.py"])
def test_errors_and_defaults_are_leaf_modules(name: str) -> None:
    imported = set()
    for node in ast.walk(tree(ROOT / name)):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
    assert imported <= {"__future__", "collections.abc", "dataclasses", "enum", "os", "typing"}, imported


def test_the_cli_reads_defaults_instead_of_restating_them() -> None:
    from omlx_jobs import defaults

    values = {v for k, v in vars(defaults).items() if k.isupper() and isinstance(v, (int, float))}
    restated = []
    for node in ast.walk(tree(ROOT / "cli.py")):
        literal = isinstance(node, ast.keyword) and node.arg == "default" and isinstance(node.value, ast.Constant)
        if literal and (node.value.value in values or node.value.value in ("2GB", "10GB")):  # type: ignore[attr-defined]
            restated.append(f"cli.py:{node.value.lineno}: default={node.value.value!r}")  # type: ignore[attr-defined]
    assert restated == []

"""The house's shape: no import cycles, the folders layered store <- jobs <- {worker, api} <- {cli, bench}, worker's
subpackages of a readable size, small functions, one door to mlx-lm's internals, one writer of cache lifetimes,
leaf modules for errors and defaults, no environment read at import, typed codes. Reads source code only.

Each rule is a function over a source tree, run here on the repository and, in the tests of the rules themselves,
on a small tree with the violation planted, so that every rule is seen to fail when broken.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "omlx_jobs"
PACKAGE_DIRS = ("jobs", "store", "worker", "api", "cli")
"""The package's folders (cli may be cli.py or a cli/ package); top-level modules (errors.py, ...) are leaves."""
LAYERS = {"store": 0, "jobs": 1, "worker": 2, "api": 2, "cli": 3, "bench": 3}
"""A module may import its own folder's modules, lower layers' and the top-level leaves; nothing else of ours."""
MAX_FUNCTION_LINES = 60
MAX_SUBPACKAGE_LINES = 1500
BACKEND = "worker/backend/"


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def sources(root: Path, folders: tuple[str, ...] = PACKAGE_DIRS, *, top: bool = True) -> Iterator[Path]:
    """The package's modules under `root`: its folders (and a folder's same-named module, cli.py), and with `top`
    the top-level modules."""
    for folder in folders:
        if (root / folder).is_dir():
            yield from sorted((root / folder).rglob("*.py"))
        if (root / f"{folder}.py").is_file():
            yield root / f"{folder}.py"
    if top:
        yield from sorted(p for p in root.glob("*.py") if p.stem not in folders)


def module_name(root: Path, path: Path) -> str:
    """`worker/engine/loop.py` -> `worker.engine.loop`; a package's __init__ is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def imports_of(root: Path, path: Path, known: set[str]) -> set[str]:
    """Every module of ours `path` imports, at the top, inside functions or under TYPE_CHECKING alike. A name
    imported from a package is the submodule when there is one; the importer's own parent packages do not count
    (Python imports them first whatever the module imports)."""
    here = module_name(root, path)
    found = set()
    for node in ast.walk(tree(path)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if not name.startswith(PACKAGE + "."):
                continue
            name = name.removeprefix(PACKAGE + ".")
            while name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in known and not here.startswith(name + "."):
                found.add(name)
    return found


def import_graph(root: Path, folders: tuple[str, ...] = PACKAGE_DIRS) -> dict[str, set[str]]:
    paths = {module_name(root, p): p for p in sources(root, folders)}
    known = set(paths)
    return {m: imports_of(root, p, known) - {m} for m, p in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports that break the folders' layering (LAYERS): into a higher layer, or across folders of one layer."""
    bad = []
    for module, deps in graph.items():
        here = module.split(".")[0]
        for dep in deps:
            there = dep.split(".")[0]
            if there == here or there not in LAYERS:  # its own folder, or a top-level leaf
                continue
            if here not in LAYERS or LAYERS[there] >= LAYERS[here]:
                bad.append(f"{module} -> {dep}")
    return sorted(bad)


def subpackage_lines(root: Path) -> dict[str, int]:
    """Lines of each package under worker/ (its own modules, not its subpackages')."""
    out = {}
    for init in sorted((root / "worker").rglob("__init__.py")):
        folder = init.parent
        if folder != root / "worker":
            out[str(folder.relative_to(root))] = sum(len(p.read_text().splitlines()) for p in folder.glob("*.py"))
    return out


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    found = []
    for path in sources(root):
        for node in ast.walk(tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if length > limit:
                    found.append(f"{path.relative_to(root)}:{node.name}")
    return found


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


def mlx_lm_internals(root: Path, private: set[str]) -> list[str]:
    """Uses of mlx-lm's private names or of BatchGenerator, anywhere in the package."""
    found = []
    for path in sources(root):
        where = str(path.relative_to(root))
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("mlx_lm", "mlx"):
                found += [f"{where}: imports {a.name}" for a in node.names if a.name.startswith("_")]
                if "BatchGenerator" in {a.name for a in node.names}:
                    found.append(f"{where}: imports BatchGenerator")
            # Our own private state is reached through self; mlx-lm's through the objects it hands us.
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                found.append(f"{where}:{node.lineno}: .{node.attr}")
    return found


def environment_reads_at_import(root: Path) -> list[str]:
    """os.environ / os.getenv used outside any function: read when the module is imported."""
    found = []
    for path in sources(root):
        body = tree(path)
        functions = [f for f in ast.walk(body) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
        inside = {id(n) for f in functions for n in ast.walk(f)}
        for node in ast.walk(body):
            reads = isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
            if reads and isinstance(node.value, ast.Name) and node.value.id == "os" and id(node) not in inside:
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def local_imports_without_a_reason(root: Path) -> list[str]:
    """Function-local imports under worker/ of our own modules (a cycle dodged), or without a comment saying why
    (an optional dependency, or MLX kept off the client path)."""
    found = []
    for path in sorted((root / "worker").rglob("*.py")):
        lines = path.read_text().splitlines()
        functions = [f for f in ast.walk(tree(path)) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in {id(n): n for f in functions for n in ast.walk(f)}.values():
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            if (module or "").startswith(PACKAGE) or "#" not in lines[node.lineno - 1]:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {module}")
    return found


def _not_codes(body: ast.Module) -> set[int]:
    """Constants that are not a code even when they spell one: docstrings, f-string parts, dict keys (a field's
    name, `{"timeout": 30}`), and the value of an OpenAI error's `type` field (`"type": "server_error"`, or
    `type = "server_error"` on an API error class), which shares one word with our codes."""
    skip = set()
    for node in ast.walk(body):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skip.add(id(first.value))
        elif isinstance(node, ast.JoinedStr):
            skip |= {id(v) for v in node.values}
        elif isinstance(node, ast.Dict):
            skip |= {id(k) for k in node.keys if k is not None}
            skip |= {
                id(v)
                for k, v in zip(node.keys, node.values, strict=True)
                if isinstance(k, ast.Constant) and k.value == "type"
            }
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "type" for t in node.targets):
            skip.add(id(node.value))
    return skip


def typed_literals(root: Path) -> list[str]:
    """String literals equal to an ErrorCode value anywhere in the package but errors.py, or to a FinishReason value
    under worker/ (elsewhere "stop" and "length" are mostly request fields): use the members."""
    from omlx_jobs.errors import ErrorCode, FinishReason

    codes = {c.value for c in ErrorCode}
    reasons = {r.value for r in FinishReason}
    found = []
    for path in sources(root):
        where = str(path.relative_to(root))
        if where == "errors.py":
            continue
        values = codes | reasons if where.startswith("worker/") else codes
        body = tree(path)
        skip = _not_codes(body)
        for node in ast.walk(body):
            if isinstance(node, ast.Constant) and node.value in values and id(node) not in skip:
                found.append(f"{where}:{node.lineno}: {node.value!r}")
    return found


def unlisted_packages(root: Path) -> list[str]:
    """Package folders the wheel would leave out: pyproject.toml lists packages one by one (the repository root
    is the package, which setuptools' find cannot name)."""
    block = re.search(r"^packages = \[(.*?)\]", (root / "pyproject.toml").read_text(), re.M | re.S)
    listed = set(re.findall(r'"([\w.]+)"', block.group(1) if block else ""))
    found = []
    for init in sorted(root.rglob("__init__.py")):
        rel = init.parent.relative_to(root)
        if rel.parts and rel.parts[0] in PACKAGE_DIRS:
            name = ".".join((PACKAGE, *rel.parts))
            if name not in listed:
                found.append(name)
    return found


# ---- the rules, on this repository -------------------------------------------------------------------------


def test_no_import_cycles() -> None:
    assert cycles(import_graph(ROOT)) == []


def test_the_folders_are_layered() -> None:
    graph = import_graph(ROOT, (*PACKAGE_DIRS, "bench"))
    assert upward_imports(graph) == []


def test_worker_subpackages_stay_readable() -> None:
    sizes = subpackage_lines(ROOT)
    assert {"worker/engine", "worker/backend", "worker/attention"} <= set(sizes)
    assert {k: v for k, v in sizes.items() if v > MAX_SUBPACKAGE_LINES} == {}, "split the subpackage by concept"


def test_functions_stay_small() -> None:
    assert long_functions(ROOT) == [], f"functions over {MAX_FUNCTION_LINES} lines"


def test_only_the_backend_touches_mlx_lm_internals() -> None:
    private = mlx_lm_private_names()
    assert {"_merge_caches", "_right_pad_prompts", "_generation_batch", "_counters"} <= private
    found = mlx_lm_internals(ROOT, private)
    assert [f for f in found if not f.startswith(BACKEND)] == [], "only worker/backend/ may use mlx-lm's internals"
    assert any(f.startswith(BACKEND) for f in found)  # the check sees the backend's own uses


def test_no_module_reads_the_environment_at_import() -> None:
    """(worker/__init__ calls models/blas.preload_blas, which reads OMLX_JOBS_BLAS: it must run before mlx.core is
    imported, so it runs when the worker package is; that is the one read at import, inside a function.)"""
    assert environment_reads_at_import(ROOT) == []


def test_function_local_imports_in_the_worker_say_why() -> None:
    assert local_imports_without_a_reason(ROOT) == []


def test_the_package_uses_typed_codes_and_finish_reasons() -> None:
    """No string literal outside errors.py equals an ErrorCode value (bench/ and scripts/ are tools around the
    package, not in it); under worker/ none equals a FinishReason value either."""
    assert typed_literals(ROOT) == []


def test_the_wheel_lists_every_package() -> None:
    assert unlisted_packages(ROOT) == []


def test_only_lifetimes_writes_pins_and_needed_until() -> None:
    writers = []
    for path in sorted((ROOT / "worker").rglob("*.py")):
        for node in ast.walk(tree(path)):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr in ("pins", "needed_until"):
                        writers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert writers and all(w.startswith("worker/cache/lifetimes.py") for w in writers), writers


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
    for path in sources(ROOT, ("cli",), top=False):
        for node in ast.walk(tree(path)):
            literal = isinstance(node, ast.keyword) and node.arg == "default" and isinstance(node.value, ast.Constant)
            if literal and (node.value.value in values or node.value.value in ("2GB", "10GB")):  # type: ignore[attr-defined]
                restated.append(f"{path.relative_to(ROOT)}:{node.value.lineno}: default={node.value.value!r}")  # type: ignore[attr-defined]
    assert restated == []


# ---- the rules themselves: each catches a planted violation ------------------------------------------------


def plant(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_planted_cycle_is_caught(tmp_path: Path) -> None:
    root = plant(
        tmp_path,
        {
            "worker/__init__.py": "",
            "worker/a.py": "from omlx_jobs.worker import b\n",
            "worker/b.py": "def f():\n    from omlx_jobs.worker.a import x  # inside a function: still an edge\n",
            "worker/c.py": "from omlx_jobs.worker.a import y\n",
        },
    )
    assert cycles(import_graph(root)) == [["worker.a", "worker.b"]]


def test_a_planted_upward_import_is_caught(tmp_path: Path) -> None:
    root = plant(
        tmp_path,
        {
            "store/db.py": "from omlx_jobs.jobs import formats\n",
            "jobs/formats.py": "from omlx_jobs.errors import ErrorCode\n",
            "api/app.py": "from omlx_jobs.worker import engine\n",
            "worker/engine.py": "from omlx_jobs.store import db\n",
            "cli/main.py": "from omlx_jobs.worker import engine\nfrom omlx_jobs.api import app\n",
            "errors.py": "",
        },
    )
    graph = import_graph(root, (*PACKAGE_DIRS, "bench"))
    assert upward_imports(graph) == ["api.app -> worker.engine", "store.db -> jobs.formats"]


def test_a_planted_oversize_subpackage_is_caught(tmp_path: Path) -> None:
    long = "x = 1\n" * (MAX_SUBPACKAGE_LINES // 2 + 1)
    files = {"worker/__init__.py": "", "worker/big/__init__.py": "", "worker/big/a.py": long, "worker/big/b.py": long}
    root = plant(tmp_path, {**files, "worker/big/small/__init__.py": "", "worker/big/small/c.py": "x = 1\n"})
    sizes = subpackage_lines(root)
    assert sizes["worker/big"] > MAX_SUBPACKAGE_LINES >= sizes["worker/big/small"]


def test_a_planted_long_function_is_caught_in_api_and_cli(tmp_path: Path) -> None:
    body = "    x = 1\n" * MAX_FUNCTION_LINES
    files = {"api/a.py": f"def f():\n{body}", "cli.py": f"def g():\n{body}", "jobs/ok.py": "def h(): ..."}
    root = plant(tmp_path, files)
    assert sorted(long_functions(root)) == ["api/a.py:f", "cli.py:g"]
    root = plant(tmp_path / "package", {"cli/__init__.py": "", "cli/run.py": f"async def g():\n{body}"})
    assert long_functions(root) == ["cli/run.py:g"]


def test_a_planted_use_of_mlx_lm_internals_is_caught(tmp_path: Path) -> None:
    root = plant(
        tmp_path,
        {
            "api/a.py": "from mlx_lm.generate import BatchGenerator\n",
            "cli.py": "def f(gen):\n    return gen._generation_batch\n",
            "worker/backend/ok.py": "from mlx_lm.generate import _merge_caches\n",
        },
    )
    found = mlx_lm_internals(root, {"_generation_batch", "_merge_caches"})
    outside = sorted(f for f in found if not f.startswith(BACKEND))
    assert outside == ["api/a.py: imports BatchGenerator", "cli.py:2: ._generation_batch"]
    assert [f for f in found if f.startswith(BACKEND)] == ["worker/backend/ok.py: imports _merge_caches"]


def test_a_planted_environment_read_at_import_is_caught(tmp_path: Path) -> None:
    at_import = "import os\nFLAG = os.environ.get('X')\n"
    when_called = "import os\ndef f():\n    return os.getenv('X')\n"
    root = plant(tmp_path, {"worker/a.py": at_import, "worker/b.py": when_called})
    assert environment_reads_at_import(root) == ["worker/a.py:2"]


def test_planted_function_local_imports_are_caught(tmp_path: Path) -> None:
    root = plant(
        tmp_path,
        {
            "worker/a.py": (
                "def f():\n"
                "    from omlx_jobs.worker import b  # a cycle dodged, comment or not\n"
                "    import json\n"
                "    from PIL import Image  # Pillow is optional\n"
            )
        },
    )
    assert local_imports_without_a_reason(root) == ["worker/a.py:2: omlx_jobs.worker", "worker/a.py:3: json"]


def test_a_planted_literal_code_is_caught(tmp_path: Path) -> None:
    root = plant(tmp_path, {"worker/a.py": "CODE = 'engine_error'\nWHY = 'stop'\nOK = f'stop {1}'\n"})
    assert typed_literals(root) == ["worker/a.py:1: 'engine_error'", "worker/a.py:2: 'stop'"]


def test_a_planted_literal_code_is_caught_across_the_package(tmp_path: Path) -> None:
    files = {
        "errors.py": "X = 'invalid_json'\n",  # the codes' own home
        "jobs/a.py": (
            '"""A docstring may say invalid_json."""\n'
            "def f():\n"
            '    """invalid_json"""\n'
            "    raise BadValue('invalid_json', 'x', 'no')\n"
            "STOP = {'stop': 1}  # a request field, outside worker/\n"
        ),
        "api/b.py": (
            "body = {'type': 'server_error', 'code': 'server_error', 'timeout': 1}\n"
            "class E:\n"
            "    type = 'server_error'\n"
        ),
        "store/c.py": "def g(row):\n    return row.error_code == 'worker_lost'\n",
        "cli/d.py": "CODES = ('timeout',)\n",
    }
    root = plant(tmp_path, files)
    assert sorted(typed_literals(root)) == [
        "api/b.py:1: 'server_error'",
        "cli/d.py:1: 'timeout'",
        "jobs/a.py:4: 'invalid_json'",
        "store/c.py:2: 'worker_lost'",
    ]


def test_a_planted_unlisted_package_is_caught(tmp_path: Path) -> None:
    pyproject = '[tool.setuptools]\npackages = ["omlx_jobs", "omlx_jobs.worker"]\n'
    root = plant(tmp_path, {"pyproject.toml": pyproject, "worker/__init__.py": "", "worker/new/__init__.py": ""})
    assert unlisted_packages(root) == ["omlx_jobs.worker.new"]
    assert re.fullmatch(r"[\w.]+", unlisted_packages(root)[0])

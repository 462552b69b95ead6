"""The docs stay true to the code: every module is in docs/architecture.md, every link from the README and docs/
resolves (anchors included), and docs/configuration.md lists exactly the environment variables the code reads.
Reads files only."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
ENV_NAME = re.compile(r"\bOMLX_[A-Z0-9_]*[A-Z0-9]\b")
CODE_SUFFIXES = {".py", ".yaml", ".yml", ".toml"}


def architecture_script() -> ModuleType:
    """scripts/architecture.py, the check the lead runs by hand, loaded by path (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("architecture_check", ROOT / "scripts" / "architecture.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_module_of_the_package_is_in_architecture_md() -> None:
    check = architecture_script()
    modules = check.package_modules()
    assert {"cli/app.py", "jobs/formats.py", "worker/entry.py", "store/migrations/env.py"} <= set(modules)
    assert not any(m.startswith(("tests/", "bench/", "scripts/")) for m in modules)
    listed = check.listed_modules((DOCS / "architecture.md").read_text())
    missing = sorted(set(modules) - set(listed))
    assert missing == [], "add these to docs/architecture.md (scripts/architecture.py --draft prints lines)"
    assert sorted(set(listed) - set(modules)) == [], "docs/architecture.md lists modules that are gone"
    assert len(listed) == len(set(listed)), "a module is listed twice"


def test_the_architecture_check_sees_missing_and_stale_entries(tmp_path: Path) -> None:
    check = architecture_script()
    for name in ("__init__.py", "a.py", "pkg/__init__.py", "pkg/b.py", "tests/t.py", "bench/x.py", ".venv/v.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text('"""B does b."""\n')
    assert check.package_modules(tmp_path) == ["__init__.py", "a.py", "pkg/__init__.py", "pkg/b.py"]
    doc = "- `a.py` — a\n- `pkg/gone.py` — was here\n- `pkg/b.py`: not the list format\n"
    assert check.listed_modules(doc) == ["a.py", "pkg/gone.py"]
    assert check.draft("pkg/b.py", tmp_path) == "- `pkg/b.py` — B does b."


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)  # a `# comment` in a code block is no heading
    for match in re.finditer(r"^#{1,6} (.+)$", text, re.M):
        base = slug(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def local_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("doc", ["README.md", *sorted(f"docs/{p.name}" for p in DOCS.glob("*.md"))])
def test_links_resolve(doc: str) -> None:
    source = ROOT / doc
    broken = []
    for target in local_links(source):
        file_part, _, anchor = target.partition("#")
        dest = (source.parent / file_part).resolve() if file_part else source
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{target}: no heading with that anchor")
    assert broken == [], f"{doc}: broken links"


def test_the_readme_links_every_doc() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in local_links(ROOT / "README.md")}
    assert {p.resolve() for p in DOCS.glob("*.md")} - linked == set(), "a doc the README does not link"


def code_files() -> list[Path]:
    skip = {".git", ".venv", "build", "docs"}
    files = [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]
    return [p for p in files if p.suffix in CODE_SUFFIXES or p.name == "Dockerfile" or p.parent.name == "scripts"]


def environ_reads(path: Path) -> set[str]:
    """Names read through os.environ / os.getenv, and click's envvar=, as string literals."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            is_env = (owner == "os.environ" and node.func.attr in ("get", "setdefault", "pop")) or (
                owner == "os" and node.func.attr == "getenv"
            )
            if is_env and node.args and isinstance(node.args[0], ast.Constant):
                names.add(node.args[0].value)
            names |= {k.value.value for k in node.keywords if k.arg == "envvar" and isinstance(k.value, ast.Constant)}
        is_item = isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ"
        if is_item and isinstance(node.slice, ast.Constant):  # type: ignore[union-attr]
            names.add(node.slice.value)  # type: ignore[union-attr]
    return names


def documented_variables() -> set[str]:
    text = (DOCS / "configuration.md").read_text()
    return set(re.findall(r"^\| `([A-Z][A-Z0-9_]+)` \|", text, re.M))


def test_configuration_lists_every_environment_variable_the_code_reads() -> None:
    files = code_files()
    package = [p for p in files if p.suffix == ".py" and p.relative_to(ROOT).parts[0] not in ("tests", "bench")]
    in_code = {name for p in files for name in ENV_NAME.findall(p.read_text(errors="replace"))}
    in_code |= {name for p in package for name in environ_reads(p)}
    documented = documented_variables()
    assert {"OMLX_JOBS_CASCADE", "OMLX_JOBS_REDIS_URL", "XDG_DATA_HOME"} <= in_code  # the scan sees them
    assert sorted(in_code - documented) == [], "read by the code but not in docs/configuration.md"
    words = {w for p in files for w in re.findall(r"\b[A-Z][A-Z0-9_]+\b", p.read_text(errors="replace"))}
    assert sorted(documented - words) == [], "in docs/configuration.md but nowhere in the code"

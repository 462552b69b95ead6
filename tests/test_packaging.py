"""The wheel: one import package `omlx_jobs` with the console script, installable into a fresh venv."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (whl,) = out.glob("omlx_jobs-*.whl")
    return whl


def test_wheel_holds_one_package_and_the_console_script(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    for module in (
        "cli/__init__.py",
        "cli/app.py",
        "jobs/formats.py",
        "jobs/queue.py",
        "store/db.py",
        "worker/engine/loop.py",
        "worker/engine/planner.py",
        # Migrations ship in the wheel, so an installed package upgrades its database when it opens it.
        "store/migrations/env.py",
        "store/migrations/versions/0001_baseline.py",
        "store/migrations/versions/0002_shards.py",
        "api/app.py",
        "api/static/index.html",
        "api/static/app.js",
        "api/static/app.css",
        "api/static/favicon.svg",
        "api/static/uPlot.iife.min.js",  # vendored (api/static/VENDOR.txt): the page loads nothing from elsewhere
        "api/static/uPlot.min.css",
        "api/static/uPlot.LICENSE",
        "store/migrations/versions/0006_live_ticks.py",
        "store/migrations/versions/0008_embeddings.py",
    ):
        assert f"omlx_jobs/{module}" in names
    assert not any(n.startswith(("tests/", "bench/", "omlx_jobs/tests/", "omlx_jobs/bench/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "omlx-jobs = omlx_jobs.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: mlx==0.32.4" in metadata and "Requires-Dist: mlx-lm==0.32.2" in metadata


def test_wheel_installs_and_runs_in_a_fresh_venv(wheel: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # Dependencies come from the test environment's site-packages (added as a path, so its editable
    # install of this repo is not picked up); the package itself only from the wheel.
    site = Path(
        subprocess.check_output(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
    where = subprocess.check_output(
        [str(py), "-c", "import omlx_jobs, os; print(os.path.dirname(omlx_jobs.__file__))"], text=True, cwd=tmp_path
    ).strip()
    assert where.startswith(str(venv)), where
    sample = tmp_path / "in.jsonl"
    sample.write_text('{"prompt": "hello", "max_tokens": 3}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    proc = subprocess.run(
        [
            str(venv / "bin" / "omlx-jobs"),
            "run",
            str(sample),
            "--model",
            str(tiny_model_dir),
            "-o",
            str(tmp_path / "out.jsonl"),
            "--db",
            str(tmp_path / "jobs.db"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2


def test_vision_extra_and_the_lean_test_install_agree(wheel: Path) -> None:
    """Users install the vision extra in full; scripts/setup installs mlx-vlm without its requirements and only
    the ones our vision code imports. Each of those satisfies mlx-vlm's own specifier, so the two agree."""
    from importlib import metadata

    from packaging.requirements import Requirement

    names = zipfile.ZipFile(wheel).namelist()
    ours = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert 'Requires-Dist: mlx-vlm==0.7.10; extra == "vision"' in ours
    assert 'Requires-Dist: Pillow>=10.3; extra == "vision"' in ours
    assert metadata.version("mlx-vlm") == "0.7.10"
    needed = {"mlx", "transformers", "pillow", "requests", "jinja2", "numpy", "tqdm", "sentencepiece"}
    checked = set()
    for text in metadata.requires("mlx-vlm") or []:
        req = Requirement(text)
        name = req.name.lower()
        if req.marker is not None or name not in needed:
            continue
        assert req.specifier.contains(metadata.version(req.name), prereleases=True), (text, metadata.version(name))
        checked.add(name)
    assert checked == needed

"""The package installs: ``python -m build`` makes an sdist and a wheel (from the sdist); the wheel, installed into
a new venv, imports and runs its command line from a directory outside the checkout.

The venv borrows this environment's dependencies (torch, numpy, ...) through a path line in a .pth file instead
of installing them again. A path line does not process the .pth files of that directory, so the checkout's
editable install there is not seen: the test checks that ``normlab`` is imported from the new venv."""

from __future__ import annotations

import json
import os
import re
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT, needs

import normlab

pytestmark = pytest.mark.slow


def run(cmd, cwd: Path, **kw) -> subprocess.CompletedProcess:
    """Run outside the checkout: cwd elsewhere and no PYTHONPATH, so only what is installed can be imported."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH")}
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, **kw
    )
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> tuple[Path, Path, str]:
    """(sdist, wheel, build log): the wheel is built from the sdist, as ``python -m build`` does by default."""
    needs("build")
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: the build backend is this environment's setuptools (the dev extra), nothing is downloaded
    proc = run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT], cwd=out)
    (sdist,), (wheel,) = list(out.glob("*.tar.gz")), list(out.glob("*.whl"))
    return sdist, wheel, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> Path:
    """A new venv with the wheel installed (no pip of its own: this environment's pip installs into it)."""
    env_dir = tmp_path_factory.mktemp("venv") / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", env_dir], cwd=env_dir.parent)
    python = env_dir / "bin" / "python"
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=env_dir).stdout
    (Path(purelib.strip()) / "_borrowed_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", dist[1]],
        cwd=env_dir,
    )
    return env_dir


def test_the_build_prints_no_deprecation_warning(dist):
    assert not re.search(r"deprecat", dist[2], flags=re.I), dist[2]


def test_the_wheel_holds_the_package_and_nothing_else(dist):
    names = zipfile.ZipFile(dist[1]).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"normlab", f"normlab-{normlab.__version__}.dist-info"}, tops  # no tests/, docs/, runs/, build/
    assert "normlab/py.typed" in names  # type checkers read normlab's annotations
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "normlab").rglob("*.py")}
    assert sources <= set(names), sorted(sources - set(names))  # every module, subpackages included
    entry_points = zipfile.ZipFile(dist[1]).read(f"normlab-{normlab.__version__}.dist-info/entry_points.txt")
    assert "normlab = normlab.cli:main" in entry_points.decode()


def test_the_sdist_builds_the_same_package(dist):
    root = f"normlab-{normlab.__version__}"
    names = {m.name for m in tarfile.open(dist[0]).getmembers()}
    for required in (
        "pyproject.toml",
        "README.md",
        "normlab/__init__.py",
        "normlab/py.typed",
        "normlab/cli/__init__.py",
    ):
        assert f"{root}/{required}" in names, required
    assert not any(n.startswith((f"{root}/runs", f"{root}/docs/_build", f"{root}/.venv")) for n in names)


def test_the_version_has_one_source():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "normlab.__version__"}


def test_the_installed_wheel_imports_from_the_venv(venv, tmp_path):
    code = (
        "import importlib.metadata, json, normlab; print(json.dumps([normlab.__file__, normlab.__version__, "
        "importlib.metadata.version('normlab')]))"
    )
    path, version, metadata = json.loads(run([venv / "bin" / "python", "-c", code], cwd=tmp_path).stdout)
    assert Path(path).resolve().is_relative_to(venv.resolve()), path  # not the checkout's editable install
    assert version == metadata == normlab.__version__


def test_the_installed_command_prints_its_version_and_help(venv, tmp_path):
    version = run([venv / "bin" / "normlab", "--version"], cwd=tmp_path).stdout
    assert version.strip() == f"normlab {normlab.__version__}"
    help_text = run([venv / "bin" / "normlab", "--help"], cwd=tmp_path).stdout
    assert "usage: normlab" in help_text and "demo" in help_text and "--version" in help_text


def test_the_installed_quick_demo_writes_its_report(venv, tmp_path):
    cwd, out = tmp_path / "cwd", tmp_path / "demo"
    cwd.mkdir()
    proc = run(
        [
            venv / "bin" / "normlab",
            "demo",
            "--quick",
            "--out",
            out,
            "--workers",
            "1",
            "--threads",
            "1",
            "--no-progress",
        ],
        cwd=cwd,
    )
    report = (out / "report.md").read_text()
    table = [line for line in report.splitlines() if line.startswith("| ")][:3]  # the claims table opens it
    assert table and all(line in proc.stdout for line in table)  # the terminal shows the claims table ...
    assert "report: " in proc.stdout and "report.md" in proc.stdout  # ... and the report's path
    summary = json.loads((out / "demo.json").read_text())
    assert "protocol" in summary
    for section in ("lr_sweep", "batch_size", "collapse"):
        assert json.loads((out / section / "results.json").read_text()), section
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs and all(name in report for name in pngs), (pngs, report[:500])  # the report shows every plot
    assert not list(cwd.iterdir())  # nothing written outside --out

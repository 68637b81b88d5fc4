"""The package installs: ``python -m build`` makes an sdist and a wheel (from the sdist), neither carrying the lab
(lab/: the paper's demo, reproduction and benchmark are not the package); the wheel, installed with its declared
dependencies into a new, isolated venv, runs its commands (``normlab compare``, ``normlab train --dataset mnist1d``)
from a directory outside the checkout.

The venv sees nothing of this environment (no ``--system-site-packages``, no path lines): pip installs the wheel with
what its metadata requires and nothing else, torch at the Makefile's pin (the CPU wheel on this machine's disk). The
other dependencies are downloaded once into a wheel cache (``NORMLAB_WHEEL_CACHE``, default
``~/.cache/normlab-wheel-test``), from which later runs install without the network. A dependency that cannot be
fetched skips these tests, or fails them under ``make test`` (``NORMLAB_REQUIRE_EXTRAS=1``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT, needs

import normlab

pytestmark = pytest.mark.slow

# One source for the torch pin: the Makefile's (pip takes that release from this machine's disk).
TORCH_PIN = re.search(r"^TORCH_PIN \?= (\S+)$", (ROOT / "Makefile").read_text(), flags=re.M).group(1)
CACHE = Path(os.environ.get("NORMLAB_WHEEL_CACHE", Path.home() / ".cache" / "normlab-wheel-test"))


def run(cmd, cwd: Path, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """Run outside the checkout: cwd elsewhere and no PYTHONPATH, so only what is installed can be imported."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "VIRTUAL_ENV")
    }
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, **kw
    )
    if check:
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


def _install(python: Path, wheel: Path, cwd: Path) -> subprocess.CompletedProcess:
    """Install the wheel and its declared dependencies from the wheel cache alone (no index)."""
    cmd = [python, "-m", "pip", "install", "-q", "--no-index", "--find-links", CACHE, wheel, TORCH_PIN]
    return run(cmd, cwd=cwd, check=False)


def _fill_cache(python: Path, wheel: Path, cwd: Path) -> None:
    """Download the wheel's dependencies (and torch at the pin) into the cache; skip, or fail under make test, if
    they cannot be fetched."""
    CACHE.mkdir(parents=True, exist_ok=True)
    proc = run([python, "-m", "pip", "download", "-q", "-d", CACHE, wheel, TORCH_PIN], cwd=cwd, check=False)
    for stale in CACHE.glob("normlab-*.whl"):  # the wheel under test is installed from its own path only
        stale.unlink()
    if proc.returncode != 0:
        message = f"the wheel's dependencies could not be fetched into {CACHE}:\n{proc.stderr[-2000:]}"
        if os.environ.get("NORMLAB_REQUIRE_EXTRAS") == "1":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> Path:
    """A new venv (its own pip, no access to this environment's packages) with the wheel and its dependencies."""
    env_dir = tmp_path_factory.mktemp("venv") / "venv"
    run([sys.executable, "-m", "venv", env_dir], cwd=env_dir.parent)
    python = env_dir / "bin" / "python"
    if _install(python, dist[1], env_dir).returncode != 0:  # first run, or a dependency newer than the cache
        _fill_cache(python, dist[1], env_dir)
        proc = _install(python, dist[1], env_dir)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return env_dir


def test_the_build_prints_no_deprecation_warning(dist):
    assert not re.search(r"deprecat", dist[2], flags=re.I), dist[2]


# What belongs to the lab (lab/normlab_lab, lab/scripts, lab/docs) and not to the package, by the names it had in
# the package before it moved out: none of them may be in the wheel or the sdist's package.
LAB_NAMES = ("normlab_lab", "verdicts", "experiments/demo", "experiments/reproduce", "experiments/capsules")
LAB_NAMES += ("cli/demo.py", "cli/reproduce.py", "cli/capsules.py", "collapse_bench", "demo_record", "reproduce_record")


def test_the_wheel_holds_the_package_and_nothing_else(dist):
    names = zipfile.ZipFile(dist[1]).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"normlab", f"normlab-{normlab.__version__}.dist-info"}, tops  # no tests/, docs/, runs/, build/
    lab = [n for n in names if any(word in n for word in LAB_NAMES)]
    assert not lab, lab  # the lab is not the package
    assert not [n for n in names if n.endswith(".py") and b"normlab_lab" in zipfile.ZipFile(dist[1]).read(n)]
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
    package = [n for n in names if n.startswith(f"{root}/normlab/")]
    assert package and not [n for n in package if any(word in n for word in LAB_NAMES)]
    assert not [n for n in names if n.startswith((f"{root}/lab/normlab_lab", f"{root}/normlab_lab"))]


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


def test_the_venv_holds_only_the_declared_dependencies(venv, tmp_path):
    """Isolated: no site-packages of this environment reachable, and an optional extra's package is absent."""
    code = (
        "import importlib.util, json, sys, sysconfig; print(json.dumps([sys.path, sysconfig.get_paths()['purelib'], "
        "[m for m in ('mnist1d', 'torch', 'pytest', 'ray', 'timm') if importlib.util.find_spec(m)]]))"
    )
    path, purelib, found = json.loads(run([venv / "bin" / "python", "-c", code], cwd=tmp_path).stdout)
    site_dirs = [p for p in path if p.endswith("-packages")]
    assert site_dirs and all(Path(p).resolve().is_relative_to(venv.resolve()) for p in site_dirs), path
    assert not list(Path(purelib).glob("*.pth")) or not any(
        line.strip().startswith("/") for pth in Path(purelib).glob("*.pth") for line in pth.read_text().splitlines()
    )
    assert found == ["mnist1d", "torch"], found  # the main job's data is a core dependency; dev and extras are not


def test_the_installed_command_prints_its_version_and_help(venv, tmp_path):
    version = run([venv / "bin" / "normlab", "--version"], cwd=tmp_path).stdout
    assert version.strip() == f"normlab {normlab.__version__}"
    help_text = run([venv / "bin" / "normlab", "--help"], cwd=tmp_path).stdout
    assert "usage: normlab" in help_text and "compare" in help_text and "--version" in help_text
    assert "demo" not in help_text and not (venv / "bin" / "normlab-lab").exists()  # the lab is not installed


def test_the_installed_compare_writes_its_report(venv, tmp_path):
    cwd, out = tmp_path / "cwd", tmp_path / "grid"
    cwd.mkdir()
    cmd = [venv / "bin" / "normlab", "compare", "--norms", "none,bn,pws", "--lrs", "0.05,0.2", "--seeds", "100"]
    cmd += ["--epochs", "1", "--width", "0.125", "--max-steps-per-epoch", "3", "--workers", "1", "--threads", "1"]
    proc = run([*cmd, "--no-progress", "--out", out], cwd=cwd)
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] and len(results["cells"]) == 6
    report = (out / "results.md").read_text()
    assert "| pws | 0.2 | 64 | 1 |" in report and "Headline effects" not in report  # no paper verdict
    assert "report: " in proc.stdout and "results.md" in proc.stdout
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs and all(name in report for name in pngs), (pngs, report[:500])  # the report shows every plot
    assert not list(cwd.iterdir())  # nothing written outside --out


def test_the_installed_command_trains_on_mnist1d(venv, tmp_path):
    out = tmp_path / "run"
    cmd = [venv / "bin" / "normlab", "train", "--dataset", "mnist1d", "--model", "plain1d", "--width", "0.25"]
    cmd += ["--num-samples", "500", "--epochs", "1", "--max-steps-per-epoch", "3", "--threads", "1", "--out", out]
    proc = run(cmd, cwd=tmp_path)
    assert "final test acc" in proc.stdout, proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["dataset"] == "mnist1d", summary

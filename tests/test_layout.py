"""The shape of the package: the library never imports the runner or the CLI, no import cycles, short functions."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "normlab"
LIBRARY = ("normlab.functional", "normlab.nn", "normlab.convert", "normlab.monitor", "normlab.integrations")
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """normlab modules imported anywhere in the file (relative imports resolved)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("normlab")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.startswith("normlab"):
                out.add(base)
                out |= {f"{base}.{a.name}" for a in node.names}
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in files and m != name} for name, path in files.items()}


def test_library_never_imports_the_runner_or_the_cli():
    for name, deps in _graph().items():
        if name.startswith(LIBRARY):
            bad = sorted(d for d in deps if d.startswith(("normlab.runner", "normlab.cli")))
            assert not bad, f"{name} imports {bad}"


def test_no_import_cycles_between_modules():
    graph = _graph()
    # a package's __init__ re-exports its modules: edges from a package to its own submodules are not cycles
    edges = {n: {d for d in deps if not d.startswith(n + ".")} for n, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in edges.get(node, ()):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for n in edges:
        if n not in state:
            visit(n, [n])


def test_no_function_longer_than_80_lines():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


def test_no_file_points_outside_the_repository():
    for path in PACKAGE.rglob("*.py"):
        assert "REFERENCE.md" not in path.read_text(), path


def test_the_declared_torch_floor_is_the_release_the_tests_run_on():
    """pyproject's lowest torch is the Makefile's pin (the tests run on it), and the running torch satisfies it."""
    import re

    import torch

    root = Path(__file__).resolve().parents[1]
    floor = re.search(r'"torch>=([0-9.]+)"', (root / "pyproject.toml").read_text()).group(1)
    pin = re.search(r"TORCH_PIN \?= torch==([0-9.]+)", (root / "Makefile").read_text()).group(1)
    def release(v: str) -> tuple[int, ...]:
        parts = [int(p) for p in v.split("+")[0].split(".")]
        return tuple(parts + [0] * (3 - len(parts)))

    assert release(floor) == release(pin), f"pyproject declares torch>={floor}, make test runs torch=={pin}"
    assert release(torch.__version__) >= release(floor)

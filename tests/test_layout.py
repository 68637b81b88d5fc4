"""The shape of the package: the library never imports the runner or the CLI, no import cycles, short functions."""

from __future__ import annotations

import ast
import re
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
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(dep) :] + [dep]))
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


REPO = PACKAGE.parent
_CLIMB = re.compile(r"(?:\.\./)+[\w.\-/]*")  # a relative path that goes up
_ABSOLUTE = re.compile(r"(?<![\w.])/(?:work|tmp|home|root|mnt)/[\w.\-/]+")  # a path of one machine
_SHARED = re.compile(r"(?<![\w.])shared/")  # the folder beside the checkout that the repository does not hold
_DOC = re.compile(r"(?<![\w./])((?:docs|benchmarks|scripts|tests)/[\w.\-/]+\.\w+)")  # a file of the repository


def _outside_references(path: Path, text: str) -> list[str]:
    """What ``text`` (the file at ``path``) names outside the repository: a relative path that climbs above its
    root, an absolute path of one machine, the ``shared/`` folder, a repository file that does not exist."""
    bad = [m for m in _CLIMB.findall(text) if REPO not in (path.parent / m).resolve().parents]
    bad += _ABSOLUTE.findall(text) + _SHARED.findall(text)
    return bad + [m for m in _DOC.findall(text) if not (REPO / m.rstrip(".")).exists()]


def test_outside_references_are_found():
    inner = PACKAGE / "runner" / "x.py"
    assert _outside_references(inner, "see ../../../shared/notes.md") == ["../../../shared/notes.md", "shared/"]
    assert _outside_references(inner, "data under /work/main/runs") == ["/work/main/runs"]
    assert _outside_references(inner, "the protocol, docs/nothing_here.md") == ["docs/nothing_here.md"]
    assert _outside_references(inner, "../nn/registry.py, docs/capsules.md, OUT/results.md, 1/2") == []


def test_no_file_points_outside_the_repository():
    for path in PACKAGE.rglob("*"):
        if path.is_file() and path.suffix in (".py", ".md", ".txt", ".json", ".toml"):
            assert not _outside_references(path, path.read_text()), (path, _outside_references(path, path.read_text()))


def test_the_declared_torch_floor_is_the_release_the_tests_run_on():
    """pyproject's lowest torch is the Makefile's pin (the tests run on it), and the running torch satisfies it."""
    import torch

    root = Path(__file__).resolve().parents[1]
    floor = re.search(r'"torch>=([0-9.]+)"', (root / "pyproject.toml").read_text()).group(1)
    pin = re.search(r"TORCH_PIN \?= torch==([0-9.]+)", (root / "Makefile").read_text()).group(1)

    def release(v: str) -> tuple[int, ...]:
        parts = [int(p) for p in v.split("+")[0].split(".")]
        return tuple(parts + [0] * (3 - len(parts)))

    assert release(floor) == release(pin), f"pyproject declares torch>={floor}, make test runs torch=={pin}"
    assert release(torch.__version__) >= release(floor)


# ------------------------------------------------------------------------------------------ private names
PRIVATE_MODULES = ("normlab._functions", "normlab._dispatch")  # the machinery: may use each other's internals
# No exceptions beyond them: a module that other modules test with isinstance exports what they need (the
# BATCH_RENORM_TYPES / WS_CONV_TYPES / PWS_CONV_TYPES tuples of normlab.nn), never its private base classes.


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    base = node.module or ""
    if not node.level:
        return base
    package = module if is_package else module.rsplit(".", 1)[0]
    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(anchor + ([base] if base else []))


def _looked_up_module(node: ast.AST) -> str | None:
    """The normlab module named by ``sys.modules.get("normlab.x")``, ``sys.modules["normlab.x"]`` or
    ``importlib.import_module("normlab.x")``, else None."""
    if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
        func, arg = ast.unparse(node.func), node.args[0]
        if func in ("sys.modules.get", "importlib.import_module") and isinstance(arg, ast.Constant):
            return arg.value if str(arg.value).startswith("normlab") else None
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules":
        key = node.slice
        return key.value if isinstance(key, ast.Constant) and str(key.value).startswith("normlab") else None
    return None


def _private_uses(module: str, source: str, is_package: bool = False) -> list[str]:
    """Private names of other normlab modules that ``source`` (the module ``module``) uses: ``from X import _name``
    and ``X._name`` with X bound to a normlab module (``import normlab.x as X``, ``from normlab import x as X``,
    ``X = sys.modules.get("normlab.x")``)."""
    tree = ast.parse(source)
    aliases, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name: a.name for a in node.names if a.name.startswith("normlab")}
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node)
            if not base.startswith("normlab") or base == module:
                continue
            for a in node.names:
                if _private(a.name):
                    found.append(f"{module}: from {base} import {a.name}")
                aliases[a.asname or a.name] = f"{base}.{a.name}"
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            looked_up = _looked_up_module(node.value)
            if looked_up is not None and looked_up != module:
                aliases[node.targets[0].id] = looked_up
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if _private(node.attr):
                found.append(f"{module}: {node.value.id}.{node.attr} ({aliases[node.value.id]})")
    return found


def test_private_names_are_found():
    src = "from .. import functional as NF\nfrom normlab.functional import _clip\ny = NF._plain_eager(x) + NF.moments()"
    assert _private_uses("normlab.nn.batch_renorm", src) == [
        "normlab.nn.batch_renorm: from normlab.functional import _clip",
        "normlab.nn.batch_renorm: NF._plain_eager (normlab.functional)",
    ]
    ok = "import torch\nfrom .._dispatch import plain_eager\nfrom ._docs import fill\nz = torch._C\nself._x = 1"
    assert _private_uses("normlab.nn.switchable", ok) == []
    lookup = 'import sys\nna = sys.modules.get("normlab.integrations.timm")\nf = na._NormAct.forward, na.register'
    assert _private_uses("normlab.convert.fold", lookup) == [
        "normlab.convert.fold: na._NormAct (normlab.integrations.timm)"
    ]
    base = "from normlab.nn.weight_std import _StdConvNd, WS_CONV_TYPES\nimport sys\nt = sys.modules['timm.layers']._x"
    assert _private_uses("normlab.convert.convs", base) == [
        "normlab.convert.convs: from normlab.nn.weight_std import _StdConvNd"
    ]


def test_no_module_uses_another_modules_private_names():
    """Outside the private machinery modules, nothing reaches into another normlab module's ``_private`` names."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        if name not in PRIVATE_MODULES:
            found += _private_uses(name, path.read_text(), path.name == "__init__.py")
    assert not found, found


def _defining(predicate) -> set[str]:
    """The normlab modules whose code (docstrings and comments aside) has a node for which ``predicate`` holds."""
    out = set()
    for path in PACKAGE.rglob("*.py"):
        if any(predicate(node) for node in ast.walk(ast.parse(path.read_text()))):
            out.add(_module_name(path))
    return out


def _is_half_tuple(node) -> bool:
    names = {e.attr for e in getattr(node, "elts", ()) if isinstance(e, ast.Attribute)}
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and {"float16", "bfloat16"} <= names


def _is_channels_last(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr in ("channels_last", "channels_last_3d")


def test_half_dtypes_and_channels_last_detection_are_defined_once():
    assert _defining(_is_half_tuple) == {"normlab._dispatch"}
    assert _defining(_is_channels_last) == {"normlab._dispatch"}

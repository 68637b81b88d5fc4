"""The shape of the repository: the package (normlab) and, beside it, the lab (lab/normlab_lab and lab/scripts).

The library never imports the runner or the CLI; the package never imports the lab; the lab uses normlab's public
API only (names in a public module's ``__all__``); no import cycles anywhere (scripts included, imports inside
functions included), no module uses another module's private names, no function is longer than 80 lines.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "normlab"
LAB_ROOT = REPO / "lab"
LAB = LAB_ROOT / "normlab_lab"  # the lab's package
LAB_SCRIPTS = LAB_ROOT / "scripts"  # the scripts that produced the research record
LAB_TESTS = LAB_ROOT / "tests"
LIBRARY = ("normlab.functional", "normlab.nn", "normlab.convert", "normlab.monitor", "normlab.integrations")
MAX_FUNCTION_LINES = 80
OURS = ("normlab", "normlab_lab")  # the top-level packages whose modules these tests follow


def _module_name(path: Path) -> str:
    """``normlab.runner.io`` for normlab/runner/io.py, ``normlab_lab.demo`` for lab/normlab_lab/demo/__init__.py and
    ``lab.scripts.collapse_study`` for a script of the lab."""
    base = LAB_ROOT if path.is_relative_to(LAB) else REPO
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _ours(name: str) -> bool:
    return name.split(".")[0] in OURS


def _sources() -> dict[str, Path]:
    """Every module of the package and the lab, and every script of the lab, by module name."""
    paths = [*PACKAGE.rglob("*.py"), *LAB.rglob("*.py"), *LAB_SCRIPTS.glob("*.py")]
    return {_module_name(p): p for p in paths}


def _imports(path: Path, scripts: frozenset[str] = frozenset()) -> set[str]:
    """Our modules imported anywhere in the file (inside functions too; relative imports resolved); in a script, a
    sibling script imported by its bare name (``import other_script``, through ``sys.path``) is
    ``lab.scripts.other_script``."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if _ours(a.name)}
            out |= {f"lab.scripts.{a.name}" for a in node.names if a.name in scripts}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if _ours(base):
                out.add(base)
                out |= {f"{base}.{a.name}" for a in node.names}
            elif not node.level and base in scripts:
                out.add(f"lab.scripts.{base}")
    return out


def _graph() -> dict[str, set[str]]:
    files = _sources()
    scripts = frozenset(p.stem for p in LAB_SCRIPTS.glob("*.py"))
    return {name: {m for m in _imports(path, scripts) if m in files and m != name} for name, path in files.items()}


def test_library_never_imports_the_runner_or_the_cli():
    for name, deps in _graph().items():
        if name.startswith(LIBRARY):
            bad = sorted(d for d in deps if d.startswith(("normlab.runner", "normlab.cli")))
            assert not bad, f"{name} imports {bad}"


def test_the_package_never_imports_the_lab():
    """normlab stands alone (its wheel carries no lab): no import of normlab_lab, not even inside a function or by
    name through importlib."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        found += [f"{path.relative_to(REPO)}: {m}" for m in _imports(path) if m.startswith("normlab_lab")]
        found += [f"{path.relative_to(REPO)}: '{s}'" for s in re.findall(r"[\"'](normlab_lab[\w.]*)[\"']", text)]
    assert not found, found


_RECORD = re.compile(r"lab/docs|normlab[-_]lab|\brounds? \d|\bpilot|research record|calibration round", re.I)


def test_the_package_s_docstrings_and_help_say_what_not_how_it_was_chosen():
    """No calibration history in the package (rounds, pilots, the lab's record or commands): its docstrings and CLI
    help say what a setting does; docs/defaults.md says why, with links to the lab's record."""
    found = [
        f"{path.relative_to(REPO)}:{i}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if _RECORD.search(line)
    ]
    assert not found, found
    assert _RECORD.search("chosen in round 3 (lab/docs/monitor_calibration.md)") and not _RECORD.search("round(x, 3)")


def test_the_import_graph_covers_the_package_the_lab_and_its_scripts():
    graph = _graph()
    assert "normlab.runner.grid.execute" in graph["normlab.runner.experiments.compare"]
    assert "normlab_lab.demo.claims" in graph["normlab_lab.demo.report"]
    assert "normlab_lab.steps" in graph["lab.scripts.collapse_study"]  # a script's edges into the lab
    # an import inside a function and a sibling script imported by its bare name are edges too
    hidden = "def f():\n    from collapse_bench import run_name\n    import bench_setups\n"
    probe = LAB_SCRIPTS / "probe_hidden.py"
    try:
        probe.write_text(hidden)
        assert _imports(probe, frozenset({"collapse_bench", "bench_setups"})) == {
            "lab.scripts.collapse_bench",
            "lab.scripts.bench_setups",
        }
    finally:
        probe.unlink()


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
    for path in _sources().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


_CLIMB = re.compile(r"(?:\.\./)+[\w.\-/]*")  # a relative path that goes up
_ABSOLUTE = re.compile(r"(?<![\w.])/(?:work|tmp|home|root|mnt)/[\w.\-/]+")  # a path of one machine
_SHARED = re.compile(r"(?<![\w.])shared/")  # the folder beside the checkout that the repository does not hold
# a file of the repository (or of the lab, named from the repository's root or from the lab's)
_DOC = re.compile(r"(?<![\w./])((?:lab/)?(?:docs|benchmarks|scripts|tests|normlab_lab)/[\w.\-/]+\.\w+)")


def _outside_references(path: Path, text: str) -> list[str]:
    """What ``text`` (the file at ``path``) names outside the repository: a relative path that climbs above its
    root, an absolute path of one machine, the ``shared/`` folder, a repository file that does not exist."""
    bad = [m for m in _CLIMB.findall(text) if REPO not in (path.parent / m).resolve().parents]
    bad += _ABSOLUTE.findall(text) + _SHARED.findall(text)
    roots = (REPO, LAB_ROOT, path.parent)  # a path from the repository's root, the lab's, or the file's folder
    return bad + [m for m in _DOC.findall(text) if not any((r / m.rstrip(".")).exists() for r in roots)]


def test_outside_references_are_found():
    inner = PACKAGE / "runner" / "x.py"
    assert _outside_references(inner, "see ../../../shared/notes.md") == ["../../../shared/notes.md", "shared/"]
    assert _outside_references(inner, "data under /work/main/runs") == ["/work/main/runs"]
    assert _outside_references(inner, "the protocol, docs/nothing_here.md") == ["docs/nothing_here.md"]
    assert _outside_references(inner, "../nn/registry.py, lab/docs/capsules.md, OUT/results.md, 1/2") == []
    assert _outside_references(inner, "lab/docs/nothing_here.md, lab/scripts/x.py") == [
        "lab/docs/nothing_here.md",
        "lab/scripts/x.py",
    ]
    assert _outside_references(LAB / "x.py", "docs/reproduction.md of the lab, scripts/long_regime.py") == []


def test_no_file_points_outside_the_repository():
    for path in [*PACKAGE.rglob("*"), *LAB_ROOT.rglob("*")]:
        if path.is_file() and path.suffix in (".py", ".md", ".txt", ".json", ".toml") and "egg-info" not in str(path):
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
    """Our module named by ``sys.modules.get("normlab.x")``, ``sys.modules["normlab.x"]`` or
    ``importlib.import_module("normlab.x")``, else None."""
    if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
        func, arg = ast.unparse(node.func), node.args[0]
        if func in ("sys.modules.get", "importlib.import_module") and isinstance(arg, ast.Constant):
            return arg.value if _ours(str(arg.value)) else None
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules":
        key = node.slice
        return key.value if isinstance(key, ast.Constant) and _ours(str(key.value)) else None
    return None


def _module_aliases(module: str, tree: ast.AST, is_package: bool = False) -> dict[str, str]:
    """Each name bound to one of our modules or to a name imported from one (``import normlab.x as X``,
    ``from normlab import x as X``, ``X = sys.modules.get("normlab.x")``): name -> dotted target."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _ours(a.name):  # ``import normlab.x.y`` binds ``normlab``; ``import normlab.x.y as Y`` binds Y
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node)
            if _ours(base) and base != module:
                aliases |= {a.asname or a.name: f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            looked_up = _looked_up_module(node.value)
            if looked_up is not None and looked_up != module:
                aliases[node.targets[0].id] = looked_up
    return aliases


def _private_uses(module: str, source: str, is_package: bool = False) -> list[str]:
    """Private names of our other modules that ``source`` (the module ``module``) uses: ``from X import _name``
    and ``X._name`` with X bound to one of our modules (``import normlab.x as X``, ``from normlab import x as X``,
    ``X = sys.modules.get("normlab.x")``)."""
    tree = ast.parse(source)
    aliases, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name: a.name for a in node.names if _ours(a.name)}
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node)
            if not _ours(base) or base == module:
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
    """Outside the private machinery modules, nothing reaches into another module's ``_private`` names: in the
    package, in the lab and in the lab's scripts."""
    found = []
    for name, path in _sources().items():
        if name not in PRIVATE_MODULES:
            found += _private_uses(name, path.read_text(), path.name == "__init__.py")
    assert not found, found


# ------------------------------------------------------------------------------------------ the lab's API
def _public_name(target: str) -> str | None:
    """Why ``target`` (``normlab.x.y``: a module, or a name of a module) is not normlab's public API, or None when it
    is: a public module (no part starts with ``_``) that has ``__all__``, or a name in its module's ``__all__``."""
    parts = target.split(".")
    if any(_private(p) for p in parts):
        return f"{target}: a private name"
    try:
        module = importlib.import_module(target)
    except ImportError:
        module = None
    if module is not None:
        return None if hasattr(module, "__all__") else f"{target}: a module without __all__"
    owner = importlib.import_module(".".join(parts[:-1]))
    if parts[-1] not in getattr(owner, "__all__", ()):
        return f"{target}: not in {owner.__name__}.__all__"
    return None


def _normlab_uses(module: str, path: Path) -> list[str]:
    """Every normlab name ``path`` imports or reads from a normlab module (``from normlab.x import y``,
    ``import normlab.x as X`` then ``X.y``), as ``normlab.x.y``."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    aliases = {k: v for k, v in _module_aliases(module, tree, is_package).items() if v.split(".")[0] == "normlab"}
    used = set(aliases.values())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            target = aliases[node.value.id]
            if _is_module(target) and not (node.attr.startswith("__") and node.attr.endswith("__")):
                used.add(f"{target}.{node.attr}")
    return sorted(u for u in used if u != "normlab")


def _is_module(target: str) -> bool:
    try:
        importlib.import_module(target)
    except ImportError:
        return False
    return True


def test_the_public_api_check_finds_what_is_not_public():
    assert _public_name("normlab.runner.grid.execute.run_experiment") is None
    assert _public_name("normlab.runner.grid.execute") is None
    assert _public_name("normlab._dispatch.HALF") == "normlab._dispatch.HALF: a private name"
    assert _public_name("normlab.runner.grid.execute._cell_done") == (
        "normlab.runner.grid.execute._cell_done: a private name"
    )
    assert _public_name("normlab.runner.training.train.GUARD_MAX_RESCUES") == (
        "normlab.runner.training.train.GUARD_MAX_RESCUES: not in normlab.runner.training.train.__all__"
    )
    assert _public_name("normlab.runner.grid") == "normlab.runner.grid: a module without __all__"


def test_the_lab_uses_only_normlab_s_public_api():
    """The lab, its scripts and its tests import from normlab only names in a public module's ``__all__`` (and
    public modules that have one): what a user of the installed package could use."""
    bad = []
    files = {**_sources(), **{f"lab.tests.{p.stem}": p for p in LAB_TESTS.glob("*.py")}}
    for name, path in files.items():
        if name.startswith("normlab."):
            continue
        for target in _normlab_uses(name, path):
            why = _public_name(target)
            if why:
                bad.append(f"{path.relative_to(REPO)}: {why}")
    assert not bad, bad


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

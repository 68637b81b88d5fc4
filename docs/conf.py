"""Sphinx configuration of normlab's documentation: ``make docs`` builds it with warnings as errors.

``sphinx-build -W --keep-going -E -b html docs docs/_build/html``. The API pages (docs/api/*.rst) list every public name
of ``normlab.nn``, ``normlab.functional``, ``normlab.convert``, ``normlab.monitor``, ``normlab.integrations`` and the
runner's modules that other code builds on (tests/test_docs_build.py checks the list against each module's ``__all__``,
and that every normlab name the lab uses is there); the Markdown pages (the README, docs/*.md and the lab's pages,
included by docs/lab/) are read by myst-parser. References are checked (``nitpicky``): a reference to a normlab name
that is not documented fails the build; names of other projects (torch, Python, Lightning, TensorBoard) are not linked
(no network at build time, so no intersphinx) and are ignored below.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from sphinx.errors import PycodeError
from sphinx.pycode import ModuleAnalyzer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import normlab  # noqa: E402

project = "normlab"
author = "normlab contributors"
copyright = "normlab contributors"
release = version = normlab.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    # MathJax shipped in a package (copied into _build/html/_static/mathjax): the maths renders offline, no CDN.
    "sphinx-mathjax-offline",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path: list[str] = []

# --- autodoc and napoleon (torch-style docstrings: Args, Returns, Shape, Example) -------------------------------
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"
autodoc_inherit_docstrings = False  # torch.nn.Module's forward/extra_repr docstrings are not ours
autoclass_content = "class"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# torch's "Shape:" sections render as a titled block with their text as written (napoleon knows Example already).
napoleon_custom_sections = ["Shape"]
napoleon_use_rtype = False
# Args as one field list of "name (type) -- description"; the types are text, not references: torch-style types
# ("Tensor", "int, optional", "(N, C, *)") name no documented object.
napoleon_use_param = False
napoleon_use_keyword = False

# --- Markdown ---------------------------------------------------------------------------------------------------
myst_heading_anchors = 4  # the README links its own sections (#integrations-...)
myst_enable_extensions = ["dollarmath"]

# --- references -------------------------------------------------------------------------------------------------
nitpicky = True
# Other projects' and the standard library's names in signatures (torch.Tensor, collections.abc.Mapping, ...) are
# shown, not linked: intersphinx would need the network at build time. Python's builtins need no entry.
nitpick_ignore_regex = [
    (r"py:class", r"(torch|numpy|lightning|tensorboard|collections|os|pathlib|typing|argparse)(\..+)?")
]

# --- known problems (in files owned by others): the owner fixes them, then deletes the entry --------------------
# Each entry is exact and expires: tests/test_docs_build.py builds once without them (NORMLAB_DOCS_STRICT=1) and
# checks that exactly these references fail, so a fixed problem's entry must be removed and no other problem hides
# behind them. Docstrings are fixed at their source: a reference to a private name, a ``|x|`` read as a
# substitution or an argument list napoleon cannot parse is an error of the strict build, not an entry here.
#
# References to names that no API page documents: normlab.integrations.timm (public, but its module docstring's
# table is malformed reStructuredText, so docs/api/integrations.rst cannot include it until timm.py is fixed) and
# the private module normlab._dataflow (now normlab.convert.dataflow, referred to by its path).
#
# normlab/runner/grid/spec.py, on the API page since the lab builds on GridSpec: unqualified names in the docstrings of
# GridSpec (FieldError, the field ``norms``), expand_grid (TrainConfig) and unique (FieldError); qualified
# (``~normlab.runner.errors.FieldError``, ...) they resolve.
UNRESOLVED_REFERENCES: list[tuple[str, str]] = [
    ("py:class", "FieldError"),
    ("py:attr", "norms"),
    ("py:class", "TrainConfig"),
]
STRICT = os.environ.get("NORMLAB_DOCS_STRICT") == "1"  # build without the workarounds above
if not STRICT:
    nitpick_ignore = list(UNRESOLVED_REFERENCES)


# The shape notation of torch's docstrings, ``(N, C, *)``, ``(C_out, C_in/groups, *kernel)``: a ``*`` that opens
# a shape entry (after "(", ", " or "x ") and ends it (before ")" or ",") means "any number of dims"; it is
# escaped for reStructuredText (where it would open emphasis), outside ``literals`` and doctest lines. A convention
# of the docstrings, applied in the strict build too.
_SHAPE_STAR = re.compile(r"(?<=[(,\s])\*(?=[A-Za-z_0-9']*[),])")


def _escape_shape_stars(lines: list[str]) -> None:
    for i, line in enumerate(lines):
        if line.lstrip().startswith((">>>", "...")):
            continue
        parts = line.split("``")
        lines[i] = "``".join(_SHAPE_STAR.sub(r"\\*", p) if k % 2 == 0 else p for k, p in enumerate(parts))


def _defining_comment(name: str, obj) -> list[str]:
    """The ``#:`` comment of a constant in the module that defines it. autodoc reads the comments of the module a
    name is documented from, and normlab.nn and normlab.monitor re-export their submodules' constants."""
    package, attr = name.rsplit(".", 1)
    top = package.split(".")[0] + "."  # a name re-exported from another subpackage (normlab.runner.io's TEMP_SUFFIX)
    found = sorted(sys.modules.items(), key=lambda item: not item[0].startswith(package + "."))
    for module_name, module in found:
        if not module_name.startswith(top) or getattr(module, attr, None) is not obj:
            continue
        try:
            comment = ModuleAnalyzer.for_module(module_name).find_attr_docs().get(("", attr))
        except PycodeError:
            continue
        if comment:
            return list(comment)
    return []


def _fix_docstring(app, what, name, obj, options, lines):
    """Escape shape stars; give a constant its ``#:`` comment (a constant's own docstring is its type's: a tuple's,
    a dict's, which documents nothing of the constant)."""
    _escape_shape_stars(lines)
    if what == "data" and (not lines or (type(obj).__doc__ and "\n".join(lines).strip() == type(obj).__doc__.strip())):
        lines[:] = _defining_comment(name, obj)


# The lab's pages (lab/README.md, lab/docs/*.md) are in the site as docs/lab/..., pages that include them. A page of
# docs/ links them by their path in the repository, ../lab/... (what GitHub follows); in the site that is lab/...
_LAB_LINK = re.compile(r"\]\(\.\./lab/")


def _lab_links(app, docname, source):
    if "/" not in docname:  # a page of docs/ itself (docs/api/*.rst and the lab's pages link no lab page this way)
        source[0] = _LAB_LINK.sub("](lab/", source[0])


def setup(app):
    app.connect("autodoc-process-docstring", _fix_docstring)
    app.connect("source-read", _lab_links)

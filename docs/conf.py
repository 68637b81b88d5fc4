"""Sphinx configuration of normlab's documentation: ``make docs`` builds it with warnings as errors.

``sphinx-build -W --keep-going -E -b html docs docs/_build/html``. The API pages (docs/api/*.rst) list every public
name of ``normlab.nn``, ``normlab.functional``, ``normlab.convert``, ``normlab.monitor`` and
``normlab.integrations`` (tests/test_docs_build.py checks the list against each module's ``__all__``); the
Markdown pages (the README and docs/*.md) are read by myst-parser. References are checked (``nitpicky``): a
reference to a normlab name that is not documented fails the build; names of other projects (torch, Python,
Lightning, TensorBoard) are not linked (no network at build time, so no intersphinx) and are ignored below.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from pathlib import Path

from sphinx.util import logging

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import normlab  # noqa: E402

logger = logging.getLogger(__name__)

project = "normlab"
author = "normlab contributors"
copyright = "normlab contributors"
release = version = normlab.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
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
nitpick_ignore_regex = [(r"py:class", r"(torch|numpy|lightning|tensorboard|collections|os|pathlib|typing)(\..+)?")]

# --- known docstring problems (in files owned by others): the lead fixes them, then deletes the entry ----------
# Each entry is exact and expires: the build fails if an entry no longer matches its docstring, and
# tests/test_docs_build.py builds once without these workarounds (NORMLAB_DOCS_STRICT=1) and checks that exactly
# these entries fail, so a fixed docstring's entry must be removed and no other problem hides behind them.
#
# References to private names that autodoc does not document (the public page then lacks what they point to).
PRIVATE_REFERENCES = [
    ("py:class", "_BatchRenorm"),  # nn/batch_renorm.py BatchRenorm1d/2d, SyncBatchRenorm: "see _BatchRenorm" args
    ("py:class", "_WSConvNd"),  # nn/weight_std.py WSConv1d/2d/3d: formula and arguments only on the private base
    ("py:class", "_PWSConvNd"),  # nn/weight_std.py PWSConv1d/2d/3d: formula and arguments only on the private base
    ("py:class", "_BatchNormWithAffine"),  # functional.py batch_renorm: a private autograd Function
    ("py:class", "_SwitchableNormFn"),  # functional.py switchable_norm: a private autograd Function
    ("py:mod", "normlab._dataflow"),  # convert.py module docstring: a private module
    ("py:func", "squash"),  # nn/capsules.py PrimaryCapsules: normlab.nn has no squash (normlab.functional.squash)
]
# Invalid reStructuredText in docstrings: {defining object: [(text as written, text as it should be)]}.
# ``|s|`` is a substitution reference; an indented example needs ``::`` before it (LITERAL_TO_END: the text from
# ``old`` to the end of the docstring is a literal block).
DOCSTRING_FIXES = {
    "normlab.functional.squash": [("(|s|^2 of a float16\nvector overflows from |s| ~ 256)",
                                   "(``|s|^2`` of a float16\nvector overflows from ``|s| ~ 256``)")],
    "normlab.nn.capsules.margin_loss": [("capsule lengths |v_k|", "capsule lengths ``|v_k|``")],
}
STRICT = os.environ.get("NORMLAB_DOCS_STRICT") == "1"  # build without the workarounds above
if not STRICT:
    nitpick_ignore = list(PRIVATE_REFERENCES)


def _qualified_name(obj) -> str | None:
    """Where an object is defined (the place to fix its docstring): module.qualname, or a module's name."""
    if inspect.ismodule(obj):
        return obj.__name__
    obj = inspect.unwrap(obj)
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else None


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


def _fix_docstring(app, what, name, obj, options, lines):
    """Escape shape stars, then apply DOCSTRING_FIXES to exactly the listed objects; an entry that no longer
    matches is a build warning."""
    _escape_shape_stars(lines)
    if what == "data":  # a constant's docstring is its type's (tuple, dict): no documentation of the constant
        if lines and type(obj).__doc__ and "\n".join(lines).strip() == type(obj).__doc__.strip():
            lines.clear()
        return
    fixes = DOCSTRING_FIXES.get(_qualified_name(obj)) if not STRICT else None
    if not fixes:
        return
    text = "\n".join(lines)
    for old, new in fixes:
        if old not in text:
            logger.warning("docs/conf.py DOCSTRING_FIXES: the docstring of %s no longer contains %r; remove the "
                           "entry if the docstring was fixed", name, old)
        elif new == "LITERAL_TO_END":
            head, tail = text.split(old, 1)
            text = head + "\n::\n\n" + "\n".join("    " + line for line in (old + tail).strip("\n").split("\n"))
        else:
            text = text.replace(old, new)
    lines[:] = text.split("\n")


def setup(app):
    app.connect("autodoc-process-docstring", _fix_docstring)



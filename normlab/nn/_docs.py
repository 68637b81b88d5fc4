"""The docstrings of normlab's layer families: one template per family, filled in per class (``__doc__ = ...``)."""

from __future__ import annotations

import textwrap
from string import Template

# string.Template ($name), not str.format: the templates hold LaTeX, whose braces format would read as fields.


def fill(template: Template, example: str, optional: tuple[str, ...] = (), **fields: str) -> str:
    """``template`` with ``fields`` put in; the fields named in ``optional`` may be left out (empty then). The
    ``example`` is given unindented (doctest lines at column 0) and indented here to sit under ``Example:``."""
    fields = {name: "" for name in optional} | fields
    return template.substitute(fields, example=textwrap.indent(example.strip("\n"), " " * 8))

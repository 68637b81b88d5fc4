"""The project's own files agree with what pyproject.toml declares: the MIT LICENSE, CITATION.cff's version."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT

import normlab


def test_the_license_file_is_the_declared_mit_license():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == "MIT"
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "the normlab developers" in text
    assert "Permission is hereby granted, free of charge" in text and 'THE SOFTWARE IS PROVIDED "AS IS"' in text


def test_the_citation_file_names_this_version_and_license():
    text = (ROOT / "CITATION.cff").read_text()
    assert re.search(r"^cff-version: 1\.2\.0$", text, flags=re.M)
    assert re.search(rf"^version: {re.escape(normlab.__version__)}$", text, flags=re.M)
    assert re.search(r"^license: MIT$", text, flags=re.M) and re.search(r"^title: ", text, flags=re.M)

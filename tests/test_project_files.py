"""The project's own files agree with what pyproject.toml declares: the MIT LICENSE, CITATION.cff's version, extras
that never ask for another torch (and docs/integrations.md says how timm keeps yours)."""

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


# ------------------------------------------------------------------------- the extras keep the user's torch
_TORCHES = ("torch", "torchvision", "torchaudio")


def _requirement_name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_no_extra_asks_for_another_torch_and_the_docs_say_how_timm_keeps_yours():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for extra, reqs in project["optional-dependencies"].items():
        named = [r for r in reqs if _requirement_name(r) in _TORCHES]
        assert not named, f"extra {extra!r} names {named}: the user's torch must stay theirs"
    (torch_req,) = [r for r in project["dependencies"] if _requirement_name(r) == "torch"]
    assert re.fullmatch(r"torch>=[\d.]+", torch_req), torch_req  # a floor only, never a pin
    # docs/integrations.md: timm's install with torch and its torchvision pinned on one line (the Makefile's pins),
    # the CPU index, and --no-deps with what `import timm` then needs
    doc = (ROOT / "docs" / "integrations.md").read_text()
    make = (ROOT / "Makefile").read_text()
    torch_pin = re.search(r"TORCH_PIN \?= (\S+)", make).group(1)
    vision_pin = re.search(r"TORCHVISION_PIN \?= (\S+)", make).group(1)
    assert f'pip install -e ".[timm]" "{torch_pin}" "{vision_pin}"' in doc
    assert f'pip install "{vision_pin}" --index-url https://download.pytorch.org/whl/cpu' in doc
    assert 'pip install --no-deps "timm' in doc and "`import timm` imports torchvision" in doc
    timm_req = next(r for r in project["optional-dependencies"]["timm"] if _requirement_name(r) == "timm")
    assert f'"{timm_req}"' in doc  # the --no-deps line installs the extra's own timm range

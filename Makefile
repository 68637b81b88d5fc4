# The two commands: `make demo` and `make test`. Both set up what they need on a fresh machine: the package (normlab)
# and, beside it, the lab (lab/: normlab-lab, the paper's demo, reproduction and collapse benchmark), both editable.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned here (not in pyproject) so this machine takes its local CPU wheel instead of a CUDA build.
TORCH_PIN ?= torch==2.13.0
# `make test` also installs and tests the optional integrations; `make demo` needs only the core and the lab.
# The pin in the same pip command keeps pip from replacing torch.
EXTRAS ?= ray,tensorboard,lightning,onnx,timm,models,docs
# torchvision's wheel for this torch, without its dependencies (its own would pull a CUDA torch); only its Python
# parts are used (tests/torchvision_cpu.py).
TORCHVISION_PIN ?= torchvision==0.28.0

.PHONY: setup setup-extras test lint docs demo bench clean

$(VENV)/.installed: pyproject.toml lab/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev]" -e ./lab "$(TORCH_PIN)"
	touch $@

$(VENV)/.extras: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps "$(TORCHVISION_PIN)"
	$(PY) -m pip install -q -e ".[dev,$(EXTRAS)]" -e ./lab "$(TORCH_PIN)" "$(TORCHVISION_PIN)"
	$(PY) tests/torchvision_cpu.py --install
	touch $@

setup: $(VENV)/.installed

setup-extras: $(VENV)/.extras

# ruff check (lint rules) and ruff format --check (the code is as `ruff format` writes it: run that to mend), the
# package and the lab alike.
LINTED = normlab tests benchmarks docs lab
lint: setup
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

# The API reference, warnings as errors (-E: every page is read again, so no warning hides in a cached page);
# docs/_build is git-ignored.
docs: setup-extras
	OMP_NUM_THREADS=1 $(VENV)/bin/sphinx-build -W --keep-going -E -q -b html docs docs/_build/html
	@echo "docs: open docs/_build/html/index.html (maths rendered offline by the MathJax copied beside it)"

# tests/test_docs_build.py checks the build `make docs` made (NORMLAB_DOCS_HTML) instead of building it again.
# pytest runs the package's tests and the lab's (pyproject's testpaths: tests, lab/tests).
test: setup-extras lint docs
	NORMLAB_REQUIRE_EXTRAS=1 NORMLAB_DOCS_HTML=docs/_build/html $(PY) -m pytest -q

# The main job is the lab's: the paper's claims on MNIST-1D (report in runs/demo/report.md).
demo: setup
	$(VENV)/bin/normlab-lab demo --out runs/demo

bench: setup
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache docs/_build build dist lab/build lab/dist

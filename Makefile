# The two commands: `make demo` and `make test`. Both set up what they need on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned here (not in pyproject) so this machine takes its local CPU wheel instead of a CUDA build.
TORCH_PIN ?= torch==2.13.0
# The optional integrations are installed and tested too; the pin in the same command keeps pip from replacing torch.
EXTRAS ?= dev,ray,tensorboard,lightning,onnx

.PHONY: setup test lint demo bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]" "$(TORCH_PIN)"
	touch $@

setup: $(VENV)/.installed

lint: setup
	$(VENV)/bin/ruff check normlab tests benchmarks

test: setup lint
	NORMLAB_REQUIRE_EXTRAS=1 $(PY) -m pytest -q

demo: setup
	$(VENV)/bin/normlab demo --out runs/demo

bench: setup
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache

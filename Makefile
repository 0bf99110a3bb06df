# The README's commands. Each creates .venv when it is missing and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEV := $(VENV)/.dev-installed
DEMO := $(VENV)/.demo-installed
# The suites run on two processes (pytest-xdist): most of an end-to-end test is waiting on
# real servers and workers. XDIST= runs them in one.
XDIST ?= -n 2
# The suites with targets of their own (pyproject's addopts leaves them out too).
NOT_HEAVY := not chaos and not browser and not sleap and not registry

.PHONY: demo test test-postgresql test-slow chaos browser test-sleap test-registry lint bench docs clean \
	gpu-wheels gpu-check

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(DEMO): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[demo]'
	touch $@

$(DEV): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[dev,demo]'
	touch $@ $(DEMO)

## make demo: a local server on SQLite, two local workers, real training jobs (ARGS=--keep to stay up)
demo: $(DEMO)
	$(PY) examples/demo.py $(ARGS)

## make test: lint, types, import layers, then every test suite but what needs PostgreSQL
## (make test-postgresql) and the long end-to-end scenarios (make test-slow)
test: lint
	$(PY) -m pytest $(XDIST) -m '$(NOT_HEAVY) and not pg and not slow' $(PYTEST_ARGS)

## make test-postgresql: the integration (with fuzz) and e2e suites again, on PostgreSQL, and
## the store suite and backend tests on PostgreSQL
test-postgresql: $(DEV)
	GPUFLEET_TEST_BACKENDS=postgresql $(PY) -m pytest $(XDIST) tests/integration tests/e2e $(PYTEST_ARGS)
	$(PY) -m pytest $(XDIST) -m '$(NOT_HEAVY) and pg' tests/contract tests/backends $(PYTEST_ARGS)

## make test-slow: the long end-to-end scenarios (fair share among three users, slowloris,
## a server restart under webhooks), on SQLite
test-slow: $(DEV)
	$(PY) -m pytest $(XDIST) -m '$(NOT_HEAVY) and slow and not pg' $(PYTEST_ARGS)

## make chaos: the chaos suite at CI size (real servers and workers, seeded faults)
chaos: $(DEV)
	$(PY) -m pytest tests/chaos -m chaos -p no:cacheprovider $(PYTEST_ARGS)

## make browser: the dashboard in Debian's Chromium (apt-get install chromium) via Playwright;
## screenshots of each page in artifacts/screenshots
browser: $(DEV)
	$(PY) -m pytest tests/browser -m browser -p no:cacheprovider $(PYTEST_ARGS)

## make test-sleap: the real sleap-nn 0.3.5 on the CPU (its virtualenv, about 6 GB, is made
## once and kept in ~/.cache/gpufleet, or GPUFLEET_SLEAP_VENV)
test-sleap: $(DEV)
	$(PY) -m pytest tests/sleap -m sleap -p no:cacheprovider $(PYTEST_ARGS)

## make test-registry: a job's environment built by a real worker from PyPI itself (the network;
## uv's cache is kept between runs in ~/.cache/gpufleet-test-uv, or GPUFLEET_TEST_UV_CACHE)
test-registry: $(DEV)
	$(PY) -m pytest tests/registry -m registry -p no:cacheprovider $(PYTEST_ARGS)

lint: $(DEV)
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

## make bench: every figure of docs/performance.md's table, on SQLite and PostgreSQL
## (about 25 minutes; the RQ side needs redis-server on 127.0.0.1:6379)
PG_BENCH ?= postgresql://postgres@127.0.0.1:5432/test
bench: $(DEV)
	$(PY) bench/dispatch.py
	$(PY) bench/dispatch.py --db $(PG_BENCH)
	$(PY) bench/throughput.py
	$(PY) bench/claims.py
	$(PY) bench/claims.py --db $(PG_BENCH)
	$(PY) bench/claims.py --db $(PG_BENCH) --servers 2
	$(PY) bench/cli_start.py
	$(PY) bench/transfer.py
	$(PY) bench/heartbeats.py
	$(PY) bench/heartbeats.py --db $(PG_BENCH)
	$(PY) bench/growth.py
	$(PY) bench/growth.py --db $(PG_BENCH)

## make gpu-check: a server and a worker of this checkout on a machine with an NVIDIA GPU and
## PyTorch installed (never in CI): the real NVML, a pinned job, a CUDA out-of-memory. It
## installs build/gpu-wheels (make gpu-wheels, made here if missing) into a venv over the
## machine's own torch (GPU_PYTHON), so that machine needs no registry. ARGS=--dry-run
GPU_WHEELS ?= build/gpu-wheels
GPU_VENV ?= build/gpu-venv
GPU_PYTHON ?= python3
# empty: wheels for this venv's Python and platform; else pip download's target, e.g.
# --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
GPU_PLATFORM ?=
gpu-wheels: $(PY)
	rm -rf $(GPU_WHEELS)
	$(PY) -m pip wheel -q --no-deps --wheel-dir $(GPU_WHEELS) .
	$(PY) -m pip download -q --only-binary=:all: $(GPU_PLATFORM) --dest $(GPU_WHEELS) \
		$(GPU_WHEELS)/gpufleet-*.whl

gpu-check:
	test -d $(GPU_WHEELS) || $(MAKE) gpu-wheels
	$(GPU_PYTHON) -m venv --system-site-packages $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q --no-index --find-links $(GPU_WHEELS) gpufleet
	$(GPU_VENV)/bin/python -m pip install -q --no-index --find-links $(GPU_WHEELS) \
		--force-reinstall --no-deps gpufleet
	$(GPU_VENV)/bin/python bench/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

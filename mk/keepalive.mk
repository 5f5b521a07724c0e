# Keepalive GPU holder: its tests and latency bench (included by the Makefile).
.PHONY: test-keepalive bench-keepalive

test-keepalive:  ## keepalive tests
	$(PY) -m pytest -q tests/test_keepalive.py tests/test_keepalive_slurm.py

bench-keepalive:  ## keepalive latency benchmark
	$(PY) bench/keepalive_latency.py
	$(PY) bench/keepalive_latency.py --mode slurm

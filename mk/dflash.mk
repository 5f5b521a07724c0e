# DFlash, extraction and the bucketed shuffle: tests and the CPU bench (included by the Makefile).
.PHONY: test-dflash bench-bucketing

test-dflash:  ## DFlash, extraction and bucketing tests
	$(PY) -m pytest -q tests/test_bucketing.py tests/test_extract.py tests/test_dflash.py tests/test_dflash_slurm.py

bench-bucketing:  ## bucketed-shuffle CPU benchmark
	$(PY) bench/bucketing.py

# Trainer targets (included by the Makefile).

SAMPLE_DATA_DIR ?= runs/sample-data
SAMPLE_DATA_N   ?= 2000
# the model shape whose asset format the assets have (qwen35-2b: 1728+2048+2048 codes of 8192)
SAMPLE_DATA_SHAPE ?= qwen35-2b

# A small synthetic stage-1 dataset in the real format: one jsonl manifest per task, PNG
# images, 3D asset .npz files. `make sample-data SAMPLE_DATA_DIR=/tmp/d SAMPLE_DATA_N=500`
sample-data: venv  ## an example stage-1 dataset in runs/sample-data
	$(PY) -m train.stage1.synthetic --out $(SAMPLE_DATA_DIR) --samples $(SAMPLE_DATA_N) --shape $(SAMPLE_DATA_SHAPE)
	@echo "format: see the docstring of train/stage1/data.py; e.g. head -2 $(SAMPLE_DATA_DIR)/gen_img.jsonl"

# A tiny chat target (tiny Qwen3.5 + a BPE trained here, ChatML template) and conversations, for
# the regen -> extract -> dflash walk-through in README.md. `make sample-target SAMPLE_TARGET_DIR=...`
SAMPLE_TARGET_DIR ?= runs/sample-target
sample-target: venv  ## a tiny chat target + conversations in runs/sample-target (regen/extract/dflash on CPU)
	$(PY) -m train.common.sample_target --out $(SAMPLE_TARGET_DIR)

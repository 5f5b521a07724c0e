# Trainer targets (included by the Makefile).

SAMPLE_DATA_DIR ?= runs/sample-data
SAMPLE_DATA_N   ?= 2000

# A small synthetic stage-1 dataset in the real format: one jsonl manifest per task, PNG
# images, 3D token .npz files. `make sample-data SAMPLE_DATA_DIR=/tmp/d SAMPLE_DATA_N=500`
sample-data: venv
	$(PY) -m train.stage1.data --out $(SAMPLE_DATA_DIR) --samples $(SAMPLE_DATA_N)
	@echo "format: see the docstring of train/stage1/data.py; e.g. head -2 $(SAMPLE_DATA_DIR)/gen_img.jsonl"

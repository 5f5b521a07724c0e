#!/usr/bin/env bash
# Issue 27 on one H200 (no network, no Slurm): stage-1 as the user runs it, through the trainer.
#   install1  (needs .wheels/a and fla-core, flash-linear-attention, apache-tvm-ffi,
#             torch-c-dlpack-ext from .wheels/b) z3, transformers 5.23, flash-qla, loss kernels, fla,
#             submitit + cloudpickle (the trainer reads the Slurm layout through submitit)
#   install2  (needs tilelang from .wheels/b)
#   vlm       the qwen35-2b job preset's defaults (vision on), >= 30 timed steps, cold kernel caches:
#             on a fresh H200 FlashQLA's TileLang set alone compiles for > 8 minutes (bench/RESULTS.md),
#             so give this step a whole call (VLM_LIMIT=590)
#   text      the same preset text-only: --vision off with the text tasks' reference weights
#   warm      vision on again in a new process, warm caches: the first step's time
# DATA: a pre-generated `generate_synthetic(DIR, 500, shape="qwen35-2b")` (448-1024 px images);
# without it the trainer generates the same set in its run directory.
# Usage: DATA=DIR bench/stage1_vlm_h200.sh STEP...
set -u
out=${OUT:-/tmp/vlm-out}
mkdir -p "$out"
export PYTHONPATH=/tmp/gpuenv:$PWD LD_LIBRARY_PATH=/tmp/gpuenv/z3/lib PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/kcache/triton TORCHINDUCTOR_CACHE_DIR=/tmp/kcache/inductor
export TILELANG_CACHE_DIR=/tmp/kcache/tilelang HF_HOME=/tmp/kcache/hf
data=()
[ -n "${DATA:-}" ] && data=(--data-dir "$DATA")
TEXT_WEIGHTS='{"gen_txt": 293000, "und": 293000, "replay_text": 150000}'
bench() {  # NAME STEPS TIMEOUT TRAINER-ARGS...
  local name=$1 steps=$2 limit=$3
  shift 3
  timeout "$limit" python3 bench/multigpu.py stage1 --gpus 1 --deepspeed off --preset qwen35-2b --steps "$steps" \
    --skip 1 --timeout "$((limit - 10))" --work "/tmp/vlm-bench/$name" --jsonl "$out/$name.jsonl" -- "${data[@]}" "$@"
  cp "/tmp/vlm-bench/$name/stage1-qwen35-2b-1gpu/metrics.jsonl" "$out/$name-metrics.jsonl" 2>/dev/null
  grep -E "^# (kernels|warm-up|mixture|packing|compile|vision)" "/tmp/vlm-bench/$name/stage1-qwen35-2b-1gpu/logs/rank0.log" \
    > "$out/$name-header.txt" 2>/dev/null
}
for step in "$@"; do
  echo "== $step, $(date -u +%FT%TZ)"
  case $step in
  install1)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -m pip install -q --no-index --no-deps --target /tmp/gpuenv "${WHEELS1:-.wheels/a}"/*.whl || exit 1
    ;;
  install2)
    python3 -m pip install -q --no-index --no-deps --target /tmp/gpuenv "${WHEELS2:-.wheels/b}"/*.whl || exit 1
    python3 -c "import torch, fla, tilelang, flash_qla, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__)" || exit 1
    ;;
  vlm) bench vlm 31 "${VLM_LIMIT:-590}" ;;
  text) bench text 31 "${TEXT_LIMIT:-150}" --vision off --weights "$TEXT_WEIGHTS" ;;
  warm) bench warm 3 "${WARM_LIMIT:-150}" ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done

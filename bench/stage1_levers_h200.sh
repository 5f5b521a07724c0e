#!/usr/bin/env bash
# Issue 21's levers table on one H200: no network, no Slurm. Wheels come from the local wheel
# directories of bench/multigpu_h200.sh (kept out of git, each under the 64 MiB one upload to an
# offline GPU node may carry), installed with `pip install --no-index`:
#   .wheels/a  z3-solver, fla-core, flash-linear-attention, apache-tvm-ffi, torch-c-dlpack-ext,
#              cut-cross-entropy, liger-kernel (deepspeed is not used on one GPU)
#   .wheels/b  tilelang, transformers 5.23.0
#   .wheels/c  causal-conv1d (built for the node's torch and CUDA) and flash_qla 0.1.3 (pure Python,
#              131 KB: fla's FlashQLA gated-delta-rule backend for Hopper); both optional
# Steps, run in the order given on one machine (later steps use what earlier ones put in /tmp):
#   a b c    install those directories
#   quick    eager-2, compiled-2, flat-4, 0.8b-flat-4 (1 warm-up + 3 steps)
#   levers1  the 2B lever rows: compile, flat packing + varlen, more rows, varlen alone, tokens by memory
#   levers2  kernels (fla conv, GDN backends) against flat-4, the warm-cache first step, the 0.8B row,
#            drift, flat-2
# Each step starts no variant after 480 s (--budget-s), so it ends inside a 10-minute command; every
# new token shape pays one inductor compile of the regions (cold the first time, from the on-disk
# cache in a later process).
# The first run on a fresh machine pays the cold fla/tilelang compile (about 4 minutes) and the
# cold inductor compile (a minute or two); the kernel caches in /tmp/kcache serve the later steps.
# Results: $OUT/levers.jsonl and the printed table (bench/stage1_levers.py).
# Usage: bench/stage1_levers_h200.sh STEP...
set -u
out=${OUT:-/tmp/levers-out}
mkdir -p "$out"
export PYTHONPATH=/tmp/gpuenv:$PWD LD_LIBRARY_PATH=/tmp/gpuenv/z3/lib PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/kcache/triton TORCHINDUCTOR_CACHE_DIR=/tmp/kcache/inductor HF_HOME=/tmp/kcache/hf
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for step in "$@"; do
  echo "== $step, $(date -u +%FT%TZ)"
  case $step in
  a)
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
    python3 -m pip install -q --no-index --no-deps --target /tmp/gpuenv .wheels/a/*.whl || exit 1
    ;;
  b)
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/gpuenv .wheels/b/*.whl || exit 1
    python3 -c "import fla, tilelang, transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)" || exit 1
    ;;
  c)
    python3 -m pip install -q --no-index --no-deps --target /tmp/gpuenv .wheels/c/*.whl || exit 1
    python3 -c "import causal_conv1d; print('causal-conv1d', causal_conv1d.__version__)" || echo "no causal-conv1d: fla's conv"
    python3 -c "import flash_qla; print('flash_qla', flash_qla.__file__)" || echo "no flash_qla: GDN on fla+tilelang"
    ;;
  quick)
    python3 bench/stage1_levers.py --quick --out "$out" --budget-s 540
    ;;
  levers1)
    python3 bench/stage1_levers.py --out "$out" --budget-s 480 \
      --variants eager-2,compiled-2,flat-4,compiled-4,varlen-2,flat-6-ckpt8,flat-6
    ;;
  levers2)
    python3 bench/stage1_levers.py --out "$out" --budget-s 480 \
      --variants flat-4,conv-fla,gdn-noqla,gdn-triton,compiled-2-warm,0.8b-flat-4,eager-2-again,flat-2
    ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done

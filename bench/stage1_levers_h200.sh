#!/usr/bin/env bash
# Issue 21's levers table on one lent nvidia-h200: no network, wheels carried in two folders that
# .git/info/exclude ignores (each under the 64 MiB a call carries), the same as multigpu_h200.sh:
#   .gpu/a  z3-solver, causal-conv1d (sm_90 build), fla-core, flash-linear-attention, apache-tvm-ffi,
#           torch-c-dlpack-ext, cut-cross-entropy (deepspeed is not needed on one GPU)
#   .gpu/b  tilelang, transformers 5.23.0, liger-kernel, and flash_qla 0.1.3 (pure Python, 131 KB,
#           `pip download --no-deps flash-qla==0.1.3`; fla's FlashQLA GDN backend, on Hopper)
# Steps, in order (the machine stays warm between calls, /tmp and its kernel caches with it):
#   a        (carry .gpu/a) install it
#   b        (carry .gpu/b) install it, import check
#   quick    eager-2, compiled-2, flat-4, 0.8b-flat-4 (1 warm-up + 3 steps); pays the cold fla and
#            inductor compiles (about 4 + 2 minutes on a fresh machine)
#   levers1  the lever rows of the 2B shape (compile, rows, varlen, flat, tokens by memory)
#   levers2  kernels (conv, GDN backends), the warm-cache first step, drift, and the 0.8B row
# Results: $OUT/levers.jsonl and the printed table (bench/stage1_levers.py).
# Usage: bench/stage1_levers_h200.sh STEP...
set -u
out=${OUT:-/tmp/levers-out}
mkdir -p "$out"
export PYTHONPATH=/tmp/gpuenv:$PWD LD_LIBRARY_PATH=/tmp/gpuenv/z3/lib PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/kcache/triton TORCHINDUCTOR_CACHE_DIR=/tmp/kcache/torchinductor HF_HOME=/tmp/kcache/hf
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for step in "$@"; do
  echo "== $step, $(date -u +%FT%TZ)"
  case $step in
  a)
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
    python3 -m pip install -q --no-index --no-deps --target /tmp/gpuenv .gpu/a/*.whl || exit 1
    ;;
  b)
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/gpuenv .gpu/b/*.whl || exit 1
    python3 -c "import fla, tilelang, transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)" || exit 1
    python3 -c "import flash_qla; print('flash_qla', flash_qla.__file__)" || echo "flash_qla not installed: the GDN rows use fla+tilelang"
    ;;
  quick)
    python3 bench/stage1_levers.py --quick --out "$out" --budget-s 540
    ;;
  levers1)
    python3 bench/stage1_levers.py --out "$out" --budget-s 480 \
      --variants eager-2,compiled-2,flat-4,compiled-4,varlen-2,flat-2,flat-6,flat-6-ckpt8
    ;;
  levers2)
    python3 bench/stage1_levers.py --out "$out" --budget-s 480 \
      --variants flat-4,conv-fla,gdn-noqla,gdn-triton,compiled-2-warm,eager-2-again,0.8b-flat-4
    ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done

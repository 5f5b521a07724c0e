#!/usr/bin/env bash
# Issue 10's multi-GPU runs on a 2x H200 (or larger) machine: no network, no Slurm.
# Wheels come from two local wheel directories (kept out of git), installed with
# `pip install --no-index`:
#   .wheels/a  z3-solver, fla-core, flash-linear-attention, apache-tvm-ffi, torch-c-dlpack-ext,
#              cut-cross-entropy, liger-kernel, submitit, cloudpickle, deepspeed 0.19.8 (sdist)
#              and its pydantic 2.14.4, pydantic-core, annotated-types, typing-inspection,
#              typing-extensions, hjson
#   .wheels/b  tilelang, transformers 5.23.0
#   .wheels/c  causal-conv1d (a wheel built once for the GPU node's torch and CUDA; optional)
# Each directory stays under the 64 MiB one upload to an offline GPU node may carry here.
# The runs are bench/allreduce_bw.py and bench/multigpu.py. Results land in $OUT.
# Steps, run in the order given on one machine (later steps use what earlier ones put in /tmp):
#   a       (needs .wheels/a) fla, z3, deepspeed, submitit; GPU topology; all-reduce bandwidth
#   b       (needs .wheels/b) tilelang, transformers 5.23
#   c       (needs .wheels/c) causal-conv1d
#   zero2   stage-1 qwen35-2b, DeepSpeed ZeRO-2, 1 and 2 GPUs
#   ddp     stage-1 qwen35-2b without DeepSpeed (1 GPU; DDP on 2), AdamW with fp32 masters
#   dflash  DFlash 1-1 online, qwen35-0.8b target, the 5-layer target-shaped drafter, 4 vs 512 anchors
# The first stage-1 run of a fresh machine compiles the fla/tilelang kernels (about 4 minutes).
# Usage: bench/multigpu_h200.sh STEP...
set -u
out=${OUT:-/tmp/multigpu-out}
mkdir -p "$out"
export PYTHONPATH=/tmp/gpuenv:$PWD LD_LIBRARY_PATH=/tmp/gpuenv/z3/lib PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/kcache/triton TORCHINDUCTOR_CACHE_DIR=/tmp/kcache/inductor HF_HOME=/tmp/kcache/hf
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for step in "$@"; do
  echo "== $step, $(date -u +%FT%TZ)"
  case $step in
  a)
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
    nvidia-smi topo -m
    python3 -m pip install -q --no-index --no-deps --target /tmp/gpuenv .wheels/a/*.whl || exit 1
    DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/gpuenv \
      .wheels/a/deepspeed-*.tar.gz || exit 1
    python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'GPUs', torch.cuda.device_count(), 'deepspeed', deepspeed.__version__)"
    python3 bench/allreduce_bw.py | tee "$out/allreduce.md"
    ;;
  b)
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/gpuenv .wheels/b/*.whl || exit 1
    python3 -c "import fla, tilelang, transformers, deepspeed; print('transformers', transformers.__version__)" || exit 1
    ;;
  c)
    python3 -m pip install -q --no-index --no-deps --target /tmp/gpuenv .wheels/c/*.whl || exit 1
    python3 -c "import causal_conv1d; print('causal-conv1d', causal_conv1d.__version__)" || exit 1
    ;;
  zero2)
    python3 bench/multigpu.py stage1 --gpus 1,2 --deepspeed on --steps 16 --skip 4 --timeout 420 \
      --work /tmp/multigpu-bench/zero2 --jsonl "$out/multigpu.jsonl"
    ;;
  ddp)
    python3 bench/multigpu.py stage1 --gpus 1,2 --deepspeed off --steps 16 --skip 4 --timeout 420 \
      --work /tmp/multigpu-bench/ddp --jsonl "$out/multigpu.jsonl"
    ;;
  dflash)
    for drafter in ${DRAFTERS:-target}; do
      python3 bench/multigpu.py dflash --topologies 1-1 --target qwen35-0.8b --drafter "$drafter" --anchors 4,512 \
        --steps 40 --skip 10 --timeout 420 --work "/tmp/multigpu-bench/$drafter" --jsonl "$out/multigpu.jsonl"
    done
    ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done

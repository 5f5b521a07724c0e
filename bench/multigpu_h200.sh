#!/usr/bin/env bash
# Issue 10's multi-GPU runs on a lent nvidia-h200-x2 (or larger) machine: no network, no Slurm.
# Wheels come from .gpu/a and .gpu/b (shared/gpu-wheels, plus deepspeed's pydantic and hjson);
# the runs are bench/allreduce_bw.py and bench/multigpu.py. Results land in $OUT.
#   stage 1 (carry .gpu/a): fla, causal-conv1d, z3, deepspeed; GPU topology; all-reduce bandwidth
#   stage 2 (carry .gpu/b, within the machine's 30 s warm window): tilelang, transformers 5.23,
#            submitit; stage-1 ZeRO-2 scaling on 1 and 2 GPUs
#   stage 3: DFlash 1-1 online (small target, two drafter sizes); stage 1 without DeepSpeed
# Usage: bench/multigpu_h200.sh STAGE
set -u
stage=$1
out=${OUT:-/tmp/multigpu-out}
mkdir -p "$out"
export PYTHONPATH=/tmp/gpuenv:$PWD LD_LIBRARY_PATH=/tmp/gpuenv/z3/lib PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/kcache/triton TORCHINDUCTOR_CACHE_DIR=/tmp/kcache/inductor HF_HOME=/tmp/kcache/hf
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
echo "== stage $stage, tree $(git log --oneline -1 2>/dev/null), $(date -u +%FT%TZ)"
case $stage in
1)
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m
  python3 -m pip install -q --no-index --no-deps --target /tmp/gpuenv .gpu/a/*.whl || exit 1
  DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/gpuenv \
    .gpu/a/deepspeed-*.tar.gz || exit 1
  python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'GPUs', torch.cuda.device_count(), 'deepspeed', deepspeed.__version__)"
  python3 bench/allreduce_bw.py | tee "$out/allreduce.md"
  ;;
2)
  python3 -m pip install -q --no-index --no-deps --target /tmp/gpuenv .gpu/b/*.whl || exit 1
  python3 -c "import fla, tilelang, transformers, deepspeed; print('transformers', transformers.__version__)" || exit 1
  python3 bench/multigpu.py stage1 --gpus 1,2 --steps 16 --skip 4 --timeout 300 --jsonl "$out/multigpu.jsonl"
  ;;
3)
  for drafter in tiny small; do
    python3 bench/multigpu.py dflash --topologies 1-1 --target qwen35-0.8b --drafter "$drafter" --steps 40 --skip 10 \
      --timeout 150 --work "/tmp/multigpu-bench/$drafter" --jsonl "$out/multigpu.jsonl"
  done
  python3 bench/multigpu.py stage1 --gpus 1,2 --deepspeed off --steps 12 --skip 4 --timeout 150 \
    --work /tmp/multigpu-bench/ddp --jsonl "$out/multigpu.jsonl"
  ;;
esac

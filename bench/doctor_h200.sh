#!/usr/bin/env bash
# `launch doctor --job stage1` on an H200 in the states issue 8 asks about, from a local wheel
# directory (`pip install --no-index --find-links DIR ...`; the machine has no network). Output: one file per state in OUTDIR.
#   stage 1 (wheels: z3-solver, fla-core, flash-linear-attention, causal-conv1d, submitit):
#     no-fla           fla not importable at all
#     fla-no-tilelang  fla on Triton 3.6 + Hopper, tilelang absent
#   stage 2 (wheels: tilelang, apache-tvm-ffi, torch-c-dlpack-ext; stage 1's /tmp dirs still there):
#     tilelang-no-libz3  tilelang installed, libz3.so.4.15 not on LD_LIBRARY_PATH
#     fast-path          everything in place (cold, then warm kernel caches)
# Usage: bench/doctor_h200.sh STAGE WHEELDIR OUTDIR
set -u
stage=$1 wheels=$2 out=$3
cd "$(dirname "$0")/.."
repo=$PWD
echo "== tree: $repo $(git log --oneline -1 2>/dev/null)"
nvidia-smi --query-gpu=index,name,compute_cap,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
python3 -m pip install -q --no-index --no-deps --target /tmp/base "$wheels"/submitit-*.whl 2>/dev/null || true
python3 -m pip install -q --no-index --no-deps --target /tmp/gpuenv $(ls "$wheels"/*.whl | grep -v submitit)
export TRITON_CACHE_DIR=/tmp/doctor-cache/triton HF_HOME=/tmp/doctor-cache/hf TORCHINDUCTOR_CACHE_DIR=/tmp/doctor-cache/inductor
state() {
  local name=$1; shift
  echo "== $name: $*"
  local t0=$(date +%s.%N)
  env "$@" python3 -m launch doctor --job stage1 > "$out/$name.txt" 2>&1
  local rc=$?
  echo "exit $rc, $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s" >> "$out/$name.txt"
  cat "$out/$name.txt"
}
if [ "$stage" = 1 ]; then
  state no-fla PYTHONPATH=$repo:/tmp/base
  state fla-no-tilelang PYTHONPATH=$repo:/tmp/base:/tmp/gpuenv LD_LIBRARY_PATH=/tmp/gpuenv/z3/lib
else
  state tilelang-no-libz3 PYTHONPATH=$repo:/tmp/base:/tmp/gpuenv
  state fast-path-cold PYTHONPATH=$repo:/tmp/base:/tmp/gpuenv LD_LIBRARY_PATH=/tmp/gpuenv/z3/lib
  state fast-path-warm PYTHONPATH=$repo:/tmp/base:/tmp/gpuenv LD_LIBRARY_PATH=/tmp/gpuenv/z3/lib
fi

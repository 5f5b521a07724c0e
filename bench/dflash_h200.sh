#!/usr/bin/env bash
# DFlash on one H200 (no network, no Slurm): the drafter step at 512 anchors for the qwen3.6-27b
# layout, the target's extraction forward, and their kernels baked into one archive, with the GPU
# fast path's kernel packages at the cp312 lock's pins (bench/install_kernels.py; the machine's own
# torch and triton). Each step is bounded by `timeout`; the benches themselves print a LATE line
# (and, with LATE=fail, exit 3) when no step has ended within FIRST_STEP_LIMIT s of the process
# start, with the main thread's stack: where the time went.
#   install DIR  install the wheels of DIR that the lock pins (once per wheel folder)
#   check     every kernel package at the lock's pin (else exit 1), versions into $OUT/versions.json,
#             then the drafter bench's CPU smoke run (tiny shapes): the script itself works here
#   drafter   bench/dflash_drafter.py drafter --target 27b --anchors 512, the default implementation,
#             cold kernel caches under /tmp/kcache (DRAFTER_LIMIT, default 420 s)
#   extract   bench/dflash_drafter.py extract (the qwen35-2b target, random weights; EXTRACT_LIMIT 300 s)
#   bake      pack the kernel caches the runs above compiled into one archive under $KSTORE
#             (default /tmp/kstore-dflash), with its time: bring that directory back
#   fresh     empty kernel caches, the archive of $KSTORE unpacked into them at start (what launch's
#             job start does), the drafter again for 2 timed passes; its first step must end within
#             FIRST_STEP_LIMIT s of the process start (LATE=fail here)
# Usage: bench/dflash_h200.sh install WHEELS check drafter extract bake fresh
#        (OUT=DIR for the logs, default /tmp/dflash-out; each step's table lines also go to stdout;
#        EXTRA="ARGS" appends ARGS to every bench command: a CPU dry run of this script is
#        EXTRA="--smoke --device cpu --impls dense:logits --compile off --token-budget 2048 --batches 1 --steps 1"
#        bench/dflash_h200.sh drafter extract bake fresh)
set -u
out=${OUT:-/tmp/dflash-out}
kstore=${KSTORE:-/tmp/kstore-dflash}
first=${FIRST_STEP_LIMIT:-120}
mkdir -p "$out"
export PYTHONPATH=/tmp/gpuenv:$PWD LD_LIBRARY_PATH=/tmp/gpuenv/z3/lib PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/kcache/triton TORCHINDUCTOR_CACHE_DIR=/tmp/kcache/inductor
export TILELANG_CACHE_DIR=/tmp/kcache/tilelang HF_HOME=/tmp/kcache/hf
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-expandable_segments:True}
LOCK=${LOCK:-images/trainer/requirements-gpu-cp312.lock}
PY=${PYTHON:-python3}
run() {  # NAME LIMIT ARGS...: the bench under timeout, its log in $OUT/NAME.txt, its table and notes here
  local name=$1 limit=$2
  shift 2
  local t0 rc
  t0=$(date +%s)
  # shellcheck disable=SC2086  # EXTRA: words on purpose
  timeout -k 10 "$limit" "$PY" bench/dflash_drafter.py "$@" --first-step-limit "$first" ${EXTRA:-} >"$out/$name.txt" 2>&1
  rc=$?
  grep -E "^(\||# )" "$out/$name.txt" | grep -vE "^# batch [0-9]+:"
  grep -q "^# LATE" "$out/$name.txt" && grep -A 30 -m 1 "^# LATE" "$out/$name.txt" | grep -E "^(Thread|Current thread|  File)" | head -30
  [ $rc -eq 124 ] && echo "FAILED $name: killed by timeout after $limit s (last lines:)" && tail -n 5 "$out/$name.txt"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && echo "FAILED $name: exit $rc (last lines:)" && tail -n 15 "$out/$name.txt"
  echo "$name: exit $rc in $(( $(date +%s) - t0 )) s"
  return $rc
}
while [ $# -gt 0 ]; do
  step=$1
  shift
  echo "== $step, $(date -u +%FT%TZ)"
  case $step in
  install)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" bench/install_kernels.py --lock "$LOCK" --wheels "$1" --target /tmp/gpuenv || exit 1
    shift
    ;;
  check)
    "$PY" bench/install_kernels.py --lock "$LOCK" --target /tmp/gpuenv --check --json "$out/versions.json" || exit 1
    "$PY" -c "import torch, triton, fla, cut_cross_entropy, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, 'gpu', torch.cuda.get_device_name(0))" || exit 1
    run check-smoke 180 drafter --smoke --device cpu --target 27b --anchors 8 --impls dense:logits --token-budget 2048 \
      --batches 2 --compile off --steps 1 || exit 1
    ;;
  drafter) run drafter "${DRAFTER_LIMIT:-420}" drafter --target 27b --anchors 512 --late "${LATE:-warn}" ;;
  extract) run extract "${EXTRACT_LIMIT:-300}" extract --late "${LATE:-warn}" ;;
  bake)
    t0=$(date +%s%N)
    "$PY" -c "import json, sys; from pathlib import Path; from toolkit import kernel_cache as k
m = k.pack(Path(sys.argv[1]), k.key_fields(), k.cache_dirs(), note='dflash drafter 27b + extract qwen35-2b on one H200')
print(json.dumps({x: m[x] for x in ('key', 'archive', 'bytes', 'files')}))" "$kstore" || exit 1
    echo "bake: packed into $kstore in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
    ;;
  fresh)
    rm -rf /tmp/kfresh /tmp/knode
    export TRITON_CACHE_DIR=/tmp/kfresh/triton TORCHINDUCTOR_CACHE_DIR=/tmp/kfresh/inductor
    export TILELANG_CACHE_DIR=/tmp/kfresh/tilelang LAUNCH_KERNEL_ARCHIVES=$kstore LAUNCH_NODE_SCRATCH=/tmp/knode
    t0=$(date +%s%N)
    LAUNCH_KERNEL_ARCHIVE=$("$PY" -c "from launch.kernel_archive import install_for_job
print(install_for_job(log=lambda line: None))") || exit 1
    export LAUNCH_KERNEL_ARCHIVE
    echo "fresh: $LAUNCH_KERNEL_ARCHIVE (unpack $(( ($(date +%s%N) - t0) / 1000000 )) ms)"
    run fresh "${FRESH_LIMIT:-240}" drafter --target 27b --anchors 512 --steps 2 --precision off --late fail
    ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done

#!/usr/bin/env bash
# Stage-1 on one H200 (no network, no Slurm) as the user runs it, through the trainer, with the
# GPU fast path's kernel packages at exactly the cp312 lock's pins (bench/install_kernels.py:
# every wheel's version and sha256 checked against the lock; the machine's own torch and triton).
#   install DIR  install the wheels of DIR that the lock pins (run once per wheel folder: one
#             upload to the machine is limited in size); `check` then verifies the whole set
#   check     every kernel package at the lock's pin (else exit 1), versions into $OUT/versions.json
#   vlm       the qwen35-2b job preset's defaults (vision on), >= 30 timed steps, cold kernel caches:
#             on a fresh H200 FlashQLA's TileLang set alone compiles for > 8 minutes (bench/RESULTS.md),
#             so give this step a whole call (VLM_LIMIT=590)
#   text      the same preset text-only: --vision off with the text tasks' reference weights
#   warm      vision on again in a new process, warm caches: the first step's time
#   bigimg    steps made only of the largest images the preset accepts (1024 x 1024, replay_img
#             only): the vision budget bounds the step, the peak must stay <= 125 GiB
#   bake      pack the kernel caches the runs above compiled into one archive in /tmp/kstore (what
#             the end of `launch kernels bake --preset qwen35-2b` does on a cluster), with its time
#   fresh     a node that has only the archive: empty kernel caches, the archive unpacked into them
#             at start (launch's job start), vision on, 3 steps; `kernel compiles by the end of
#             step 1` must be 0 each, and `ended N s after the process started` is the time to step 1
# DATA: a pre-generated `generate_synthetic(DIR, 500, shape="qwen35-2b")` (448-1024 px images);
# without it the trainer generates the same set in its run directory.
# Usage: DATA=DIR bench/stage1_vlm_h200.sh install .whl1 install .whl2 check vlm text warm
set -u
out=${OUT:-/tmp/vlm-out}
mkdir -p "$out"
export PYTHONPATH=/tmp/gpuenv:$PWD LD_LIBRARY_PATH=/tmp/gpuenv/z3/lib PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/kcache/triton TORCHINDUCTOR_CACHE_DIR=/tmp/kcache/inductor
export TILELANG_CACHE_DIR=/tmp/kcache/tilelang HF_HOME=/tmp/kcache/hf
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-expandable_segments:True}  # as the stage1 job spec sets it
data=()
[ -n "${DATA:-}" ] && data=(--data-dir "$DATA")
TEXT_WEIGHTS='{"gen_txt": 293000, "und": 293000, "replay_text": 150000}'
bench() {  # NAME STEPS TIMEOUT TRAINER-ARGS...
  local name=$1 steps=$2 limit=$3
  shift 3
  timeout "$limit" python3 bench/multigpu.py stage1 --gpus 1 --deepspeed off --preset qwen35-2b --steps "$steps" \
    --skip 1 --timeout "$((limit - 10))" --work "/tmp/vlm-bench/$name" --jsonl "$out/$name.jsonl" -- "${data[@]}" "$@"
  cp "/tmp/vlm-bench/$name/stage1-qwen35-2b-1gpu/metrics.jsonl" "$out/$name-metrics.jsonl" 2>/dev/null
  grep -E "^# (kernels|warm-up|mixture|packing|compile|vision|kernel compiles|WARNING)|world=" "/tmp/vlm-bench/$name/stage1-qwen35-2b-1gpu/logs/rank0.log" \
    > "$out/$name-header.txt" 2>/dev/null
}
LOCK=${LOCK:-images/trainer/requirements-gpu-cp312.lock}
while [ $# -gt 0 ]; do
  step=$1
  shift
  echo "== $step, $(date -u +%FT%TZ)"
  case $step in
  install)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 bench/install_kernels.py --lock "$LOCK" --wheels "$1" --target /tmp/gpuenv || exit 1
    shift
    ;;
  check)
    python3 bench/install_kernels.py --lock "$LOCK" --target /tmp/gpuenv --check --json "$out/versions.json" || exit 1
    python3 -c "import torch, fla, tilelang, flash_qla, cut_cross_entropy, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__)" || exit 1
    ;;
  vlm) bench vlm 31 "${VLM_LIMIT:-590}" ;;
  text) bench text 31 "${TEXT_LIMIT:-150}" --vision off --weights "$TEXT_WEIGHTS" ;;
  warm) bench warm 3 "${WARM_LIMIT:-150}" ;;
  bigimg)
    python3 -c "import json, numpy as np; from pathlib import Path; from PIL import Image
root = Path('/tmp/bigimg'); (root / 'images').mkdir(parents=True, exist_ok=True)
rng = np.random.default_rng(0)
with open(root / 'replay_img.jsonl', 'w') as f:
    for i in range(48):
        Image.fromarray(rng.integers(0, 256, (1024, 1024, 3), dtype=np.uint8)).save(root / 'images' / f'{i}.png', compress_level=1)
        f.write(json.dumps({'id': str(i), 'image': f'images/{i}.png', 'text': f'a picture number {i}'}) + chr(10))" || exit 1
    bench bigimg 11 "${BIG_LIMIT:-300}" --data-dir /tmp/bigimg --weights '{"replay_img": 1}'
    ;;
  bake)
    t0=$(date +%s%N)
    python3 -c "import json; from pathlib import Path; from toolkit import kernel_cache as k
m = k.pack(Path('/tmp/kstore'), k.key_fields(), k.cache_dirs(), note='qwen35-2b on one H200')
print(json.dumps({x: m[x] for x in ('key', 'archive', 'bytes', 'files')}))" || exit 1
    echo "bake: packed in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
    ;;
  fresh)
    rm -rf /tmp/kfresh /tmp/knode
    export TRITON_CACHE_DIR=/tmp/kfresh/triton TORCHINDUCTOR_CACHE_DIR=/tmp/kfresh/inductor
    export TILELANG_CACHE_DIR=/tmp/kfresh/tilelang LAUNCH_KERNEL_ARCHIVES=/tmp/kstore LAUNCH_NODE_SCRATCH=/tmp/knode
    t0=$(date +%s%N)
    LAUNCH_KERNEL_ARCHIVE=$(python3 -c "from launch.kernel_archive import install_for_job
print(install_for_job(log=lambda line: None))") || exit 1
    export LAUNCH_KERNEL_ARCHIVE
    echo "fresh: $LAUNCH_KERNEL_ARCHIVE (unpack $(( ($(date +%s%N) - t0) / 1000000 )) ms)"
    bench fresh 3 "${FRESH_LIMIT:-240}" ${REQUIRE_WARM:+--require-warm-kernels}
    cat "$out/fresh-header.txt"
    ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done

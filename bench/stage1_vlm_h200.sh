#!/usr/bin/env bash
# Stage-1 on one H200 (no network, no Slurm) as the user runs it, through the trainer, with the
# GPU fast path's kernel packages at exactly the cp312 lock's pins (bench/install_kernels.py:
# every wheel's version and sha256 checked against the lock; the machine's own torch and triton).
# Every step is bounded by `timeout` (its *_LIMIT, seconds); results go to $OUT (default /tmp/vlm-out).
#   install DIR  install the wheels of DIR that the lock pins into /tmp/gpuenv (run once per wheel
#             folder: one upload to the machine is limited in size). A wheel too large for one
#             upload travels as parts (`split -b 40M W.whl DIR/W.whl.part-`): the parts of each
#             folder are collected in /tmp/wheel-parts and the wheel is joined and installed once
#             its sha256 is the lock's. Each call's wheels are merged into the install folder (wheels
#             that share a folder, as the CUTLASS DSL's three share nvidia_cutlass_dsl/, keep every file)
#   install-loss DIR  the same into /tmp/lossenv: liger-kernel and the CUTLASS DSL (liger-sm90),
#             then whether liger-sm90 imports (else the missing package, in one line). Kept off the
#             other steps' PYTHONPATH: the kernel archive's key holds liger-kernel's version, so an
#             archive baked without it (a carried kstore) still matches those steps. The loss step's
#             PYTHONPATH is `install_kernels.py --pythonpath --target /tmp/lossenv`: /tmp/lossenv and
#             the CUTLASS DSL's nvidia_cutlass_dsl/dsl_packages, which only its .pth file puts on
#             sys.path (Python reads no .pth file in a PYTHONPATH entry: `No module named 'cutlass'`)
#   check     every kernel package at the lock's pin (else exit 1), versions into $OUT/versions.json,
#             and whether liger-sm90 imports from /tmp/lossenv (a warning naming what is missing)
#   seed      a carried archive store in /tmp/kstore unpacked into this script's caches (/tmp/kcache),
#             as the job start does: the following steps start warm if the key matches
#   warmup    vision on, 3 steps, fills the caches (cold caches on a fresh H200: > 8 minutes, give
#             it a whole call, WARMUP_LIMIT=590)
#   vlm       the qwen35-2b job preset's defaults (vision on), 31 steps in a new process, WARM caches
#             (after seed or warmup): median of steps 2-31 (tower FLOPs counted in the MFU), the
#             stall detector's verdict for steps 2-30, recompiles after step 1, slowest step / median
#   text      the same preset text-only: --vision off with the text tasks' reference weights
#             (vlm and text with LOSS_IMPL=liger-sm90: that --loss-impl, as vlm-liger-sm90 and
#             text-liger-sm90, /tmp/lossenv on the path)
#   loss      the loss head side by side in one process (bench/loss_head.py, PYTHONPATH with
#             /tmp/lossenv): cce, liger-sm90 and liger-sm90-tce (its Triton CE pass), liger, full logits
#             (LOSS_HEADS), fwd+bwd time, error
#             against fp32 logits and against cce's own loss and gradients (both within bf16
#             tolerance, else exit 1); then LOSS_STEPS (default 11) trainer steps text-only with
#             each of LOSS_IMPLS (default "cce liger-sm90 liger-sm90-tce"), one table; step
#             LOSS_PROFILE_STEP (10) of each under torch.profiler: GPU time by kernel family and the
#             top kernels, in $OUT/loss-IMPL-profile.md
#   warm      vision on again in a new process, warm caches: the first step's time
#   bigimg    steps made only of the largest images the preset accepts (1024 x 1024, replay_img
#             only): the vision budget bounds the step, the peak must stay <= 125 GiB
#   bake      pack the kernel caches the runs above compiled into one archive in /tmp/kstore (what
#             the end of `launch kernels bake --preset qwen35-2b` does on a cluster), with its time
#   fresh     a node that has only the archive: empty kernel caches, the archive unpacked into them
#             at start (launch's job start), vision on, 3 steps; `kernel compiles by the end of
#             step 1` must be 0 each, `ended N s after the process started` is the time to step 1,
#             and the torch cache artifacts the archive carried are loaded (FX-graph and AOTAutograd
#             cache hits/misses on the same line)
# DATA: a pre-generated `generate_synthetic(DIR, 500, shape="qwen35-2b")` (448-1024 px images);
# without it the trainer generates the same set in its run directory.
# Usage: DATA=DIR bench/stage1_vlm_h200.sh install .whl1 install .whl2 install-loss .whl3 check
#        DATA=DIR bench/stage1_vlm_h200.sh seed vlm text loss bake fresh
set -u
out=${OUT:-/tmp/vlm-out}
mkdir -p "$out"
export PYTHONPATH=/tmp/gpuenv:$PWD LD_LIBRARY_PATH=/tmp/gpuenv/z3/lib PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/kcache/triton TORCHINDUCTOR_CACHE_DIR=/tmp/kcache/inductor
export TILELANG_CACHE_DIR=/tmp/kcache/tilelang HF_HOME=/tmp/kcache/hf
# liger-sm90's CuTe DSL kernels: compiled on first use, cached here (not in the kernel archive yet)
export CUTE_DSL_CACHE_DIR=/tmp/kcache/cute_dsl
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-expandable_segments:True}  # as the stage1 job spec sets it
# as in a `launch kernels bake` job: each run's trainer saves torch's cache artifacts (Inductor,
# AOTAutograd) under the inductor cache at its end, so `bake` packs them with the kernels
export LAUNCH_KERNEL_BAKE=${LAUNCH_KERNEL_BAKE-bench:qwen35-2b}
data=()
[ -n "${DATA:-}" ] && data=(--data-dir "$DATA")
TEXT_WEIGHTS='{"gen_txt": 293000, "und": 293000, "replay_text": 150000}'
bench() {  # NAME STEPS TIMEOUT TRAINER-ARGS...
  local name=$1 steps=$2 limit=$3
  shift 3
  timeout "$limit" python3 bench/multigpu.py stage1 --gpus 1 --deepspeed off --preset qwen35-2b --steps "$steps" \
    --skip 1 --timeout "$((limit - 10))" --work "/tmp/vlm-bench/$name" --jsonl "$out/$name.jsonl" -- "${data[@]}" "$@"
  cp "/tmp/vlm-bench/$name/stage1-qwen35-2b-1gpu/metrics.jsonl" "$out/$name-metrics.jsonl" 2>/dev/null
  grep -E "^# (kernels|warm-up|mixture|packing|compile|vision|kernel compiles|torch cache|WARNING)|world=" "/tmp/vlm-bench/$name/stage1-qwen35-2b-1gpu/logs/rank0.log" \
    > "$out/$name-header.txt" 2>/dev/null
}
summary() {  # NAME: the verdicts of a run's metrics over steps 2.. (the stall detector's, recompiles)
  python3 - "$out/$1-metrics.jsonl" "$1" <<'PY'
import json, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r and "tok_s" in r]
if len(rows) < 3:
    sys.exit(f"{sys.argv[2]}: {len(rows)} steps logged")
timed = [r for r in rows if r["step"] >= 2]
ms = [r["data_ms"] + r["compute_ms"] for r in timed]
med = statistics.median(ms)
stalls = [(r["step"], r["stall"]) for r in timed if r.get("stall") and r["step"] <= 30]
recompiles = timed[-1].get("recompiles", 0) - rows[0].get("recompiles", 0)
graphs = timed[-1].get("compiles", 0) - rows[0].get("compiles", 0)
useful = [r["mfu_useful"] for r in timed if r.get("mfu_useful") is not None]
vision = [r.get("vision_flops", 0) for r in timed]
print(f"{sys.argv[2]}: steps {timed[0]['step']}-{timed[-1]['step']}: median {statistics.median(r['tok_s'] for r in timed):,.0f} tok/s, "
      f"useful-token MFU median {statistics.median(useful):.1%} (mean {statistics.mean(useful):.1%})" if useful else "", end="")
print(f", tower FLOPs counted: {'yes' if any(vision) else 'no vision steps'}; slowest step / median "
      f"{max(ms) / med:.2f} (step {timed[ms.index(max(ms))]['step']}); graphs compiled / recompiles after step 1: {graphs} / {recompiles}; "
      f"stall detector, steps 2-30: {'silent' if not stalls else 'FLAGGED ' + str(stalls)}")
PY
}
LOCK=${LOCK:-images/trainer/requirements-gpu-cp312.lock}
LOSS_PACKAGES="liger-kernel nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-core nvidia-cutlass-dsl-libs-cu12 protobuf"
losspath() {  # the PYTHONPATH entries of /tmp/lossenv: it and what its .pth files add (the CUTLASS DSL's)
  [ -d /tmp/lossenv ] || return 0
  python3 bench/install_kernels.py --pythonpath --target /tmp/lossenv
}
# LOSS_IMPL=liger-sm90 (or any --loss-impl): the vlm and text steps run with it, as vlm-IMPL and
# text-IMPL (their own files in $OUT), with /tmp/lossenv on the path for the Liger ones
loss_args=() loss_tag=""
[ -n "${LOSS_IMPL:-}" ] && loss_args=(--loss-impl "$LOSS_IMPL") loss_tag="-$LOSS_IMPL"
# VARIANT=NAME TRAINER_ARGS="..." (vlm, text): a lever's run beside the default, as text-NAME, with
# those trainer flags added; PROFILE_STEP=N: that step under torch.profiler, its table in
# $OUT/NAME-profile.md (GPU time by kernel family and the top kernels)
read -ra variant_args <<< "${TRAINER_ARGS:-}"
[ -n "${VARIANT:-}" ] && loss_tag="$loss_tag-$VARIANT"
[ -n "${PROFILE_STEP:-}" ] && variant_args+=(--profile-step "$PROFILE_STEP")
profile_table() {  # NAME: the profiled step's table from the run's rank-0 log
  [ -n "${PROFILE_STEP:-}" ] || return 0
  awk '/# profile of /{on=1; print; next} on { if ($0 ~ /^(\||top )/) print; else exit }' \
    "/tmp/vlm-bench/$1/stage1-qwen35-2b-1gpu/logs/rank0.log" | tee "$out/$1-profile.md"
}
loss_pythonpath() {
  case ${LOSS_IMPL:-} in liger*) echo "$(losspath):$PYTHONPATH" ;; *) echo "$PYTHONPATH" ;; esac
}
sm90_probe() {  # whether liger-sm90 imports with /tmp/lossenv on the path, else the missing package in one line
  PYTHONPATH=$(losspath):$PYTHONPATH timeout 120 python3 -c "import sys
from train.common.losses import _probe
problem = _probe('liger-sm90')
print('liger-sm90 imports' if problem is None else 'WARNING: liger-sm90 does not import from /tmp/lossenv: ' + problem)
sys.exit(problem is not None)"
}
join_parts() {  # DIR: collect its W.whl.part-* in /tmp/wheel-parts; print a folder of the wheels now whole
  local dir=$1 w
  compgen -G "$dir/*.whl.part-*" > /dev/null || return 0
  mkdir -p /tmp/wheel-parts /tmp/wheel-joined && cp "$dir"/*.whl.part-* /tmp/wheel-parts/ || return 1
  for w in $(ls /tmp/wheel-parts | sed 's/\.part-.*//' | sort -u); do
    cat /tmp/wheel-parts/"$w".part-* > /tmp/wheel-joined/"$w.tmp"
    if python3 -c "import sys, zipfile; sys.exit(zipfile.ZipFile(sys.argv[1]).testzip() is not None)" /tmp/wheel-joined/"$w.tmp" 2>/dev/null; then
      mv /tmp/wheel-joined/"$w.tmp" /tmp/wheel-joined/"$w"
    else
      rm -f /tmp/wheel-joined/"$w.tmp"; echo "$w: parts so far do not make the whole wheel; waiting for the rest" >&2
    fi
  done
  compgen -G "/tmp/wheel-joined/*.whl" > /dev/null && echo /tmp/wheel-joined
  return 0
}
while [ $# -gt 0 ]; do
  step=$1
  shift
  echo "== $step, $(date -u +%FT%TZ)"
  case $step in
  install | install-loss)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    target=/tmp/gpuenv
    [ "$step" = install-loss ] && target=/tmp/lossenv
    joined=$(join_parts "$1") || exit 1
    if compgen -G "$1/*.whl" > /dev/null; then
      timeout 300 python3 bench/install_kernels.py --lock "$LOCK" --wheels "$1" --target "$target" || exit 1
    fi
    if [ -n "$joined" ]; then
      timeout 300 python3 bench/install_kernels.py --lock "$LOCK" --wheels "$joined" --target "$target" || exit 1
    fi
    [ "$step" = install-loss ] && { sm90_probe || true; }
    shift
    ;;
  check)
    # the loss step's packages (liger-sm90) only warn here: every other step runs without them
    timeout 120 python3 bench/install_kernels.py --lock "$LOCK" --target /tmp/gpuenv --also /tmp/lossenv --check \
      --json "$out/versions.json" $(printf -- "--optional %s " $LOSS_PACKAGES) || exit 1
    python3 -c "import torch, fla, tilelang, flash_qla, cut_cross_entropy, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__)" || exit 1
    sm90_probe || echo "(the loss step will say so in liger-sm90's row)"
    ;;
  warmup) bench warmup 3 "${WARMUP_LIMIT:-590}"; summary warmup ;;
  seed)
    [ -d /tmp/kstore ] || { echo "seed: no /tmp/kstore"; exit 1; }
    t0=$(date +%s%N)
    LAUNCH_KERNEL_ARCHIVES=/tmp/kstore LAUNCH_NODE_SCRATCH=/tmp/knode timeout "${SEED_LIMIT:-120}" python3 -c "from launch.kernel_archive import install_for_job
print(install_for_job(log=lambda line: None))" || exit 1
    echo "seed: $(( ($(date +%s%N) - t0) / 1000000 )) ms"
    ;;
  vlm)
    PYTHONPATH=$(loss_pythonpath) bench "vlm$loss_tag" 31 "${VLM_LIMIT:-400}" "${loss_args[@]}" "${variant_args[@]}"
    summary "vlm$loss_tag"; profile_table "vlm$loss_tag"
    ;;
  text)
    PYTHONPATH=$(loss_pythonpath) bench "text$loss_tag" 31 "${TEXT_LIMIT:-150}" --vision off --weights "$TEXT_WEIGHTS" \
      "${loss_args[@]}" "${variant_args[@]}"
    summary "text$loss_tag"; profile_table "text$loss_tag"
    ;;
  loss)
    losspy=$(losspath):$PYTHONPATH
    PYTHONPATH=$losspy timeout "${LOSS_LIMIT:-360}" python3 bench/loss_head.py \
      --impls "${LOSS_HEADS:-cce,liger-sm90,liger-sm90-tce,liger,logits}" --against cce --jsonl "$out/loss-head.jsonl"
    echo "loss_head exit $?"
    for impl in ${LOSS_IMPLS:-cce liger-sm90 liger-sm90-tce}; do
      PYTHONPATH=$losspy bench "loss-$impl" "${LOSS_STEPS:-11}" "${LOSS_STEP_LIMIT:-150}" \
        --vision off --weights "$TEXT_WEIGHTS" --loss-impl "$impl" --profile-step "${LOSS_PROFILE_STEP:-10}"
      # the profiled step's time by kernel family: where the rest of the step goes, per loss head
      sed -n '/^# profile of step/,/^[^|t]/p' "/tmp/vlm-bench/loss-$impl/stage1-qwen35-2b-1gpu/logs/rank0.log" \
        | tee "$out/loss-$impl-profile.md"
    done
    python3 - "$out" ${LOSS_IMPLS:-cce liger-sm90 liger-sm90-tce} <<'PY'
import json, statistics, sys
from pathlib import Path
print("| --loss-impl (text, 4 x 8,192) | tok/s (median, steps 2+) | useful-token MFU | peak GiB | last loss |")
print("|---|---:|---:|---:|---:|")
for impl in sys.argv[2:]:
    path = Path(sys.argv[1]) / f"loss-{impl}-metrics.jsonl"
    rows = [r for r in map(json.loads, open(path)) if "tok_s" in r and r.get("step", 0) >= 2] if path.exists() else []
    if not rows:
        print(f"| {impl} | failed: see $OUT/loss-{impl}-header.txt and its rank0.log | | | |")
        continue
    mfu = [r["mfu_useful"] for r in rows if r.get("mfu_useful") is not None]
    peak = max(r.get("peak_mem_mb") or 0 for r in rows) / 1024
    print(f"| {impl} | {statistics.median(r['tok_s'] for r in rows):,.0f} | {statistics.median(mfu):.1%} | {peak:.1f} | {rows[-1]['loss']:.4f} |")
PY
    ;;
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
    export TILELANG_CACHE_DIR=/tmp/kfresh/tilelang CUTE_DSL_CACHE_DIR=/tmp/kfresh/cute_dsl
    export LAUNCH_KERNEL_ARCHIVES=/tmp/kstore LAUNCH_NODE_SCRATCH=/tmp/knode
    t0=$(date +%s%N)
    LAUNCH_KERNEL_ARCHIVE=$(python3 -c "from launch.kernel_archive import install_for_job
print(install_for_job(log=lambda line: None))") || exit 1
    export LAUNCH_KERNEL_ARCHIVE
    echo "fresh: $LAUNCH_KERNEL_ARCHIVE (unpack $(( ($(date +%s%N) - t0) / 1000000 )) ms)"
    bench fresh 3 "${FRESH_LIMIT:-240}" ${REQUIRE_WARM:+--require-warm-kernels}
    cat "$out/fresh-header.txt"
    grep -h "kernel compiles by the end of step 1\|torch cache artifacts:" "$out/fresh-header.txt" | sed 's/^/fresh verdict: /'
    ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done

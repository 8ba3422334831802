#!/usr/bin/env bash
# One device call that checks and times everything on the H200 (docs/BENCHMARKS.md's GPU figures
# come from this script's logs). Run from the repository root on the GPU machine, with FLA's
# wheels in .whl/ (../shared/tools/peer-wheels) and $OUT set to a folder for the logs.
# Seconds per step from the environment (0 skips the step):
#   REPRO_S GPU_CHECK_S TUNE_S OPS_S KDA_S GEN_S TRAIN_S      e.g. GPU_CHECK_S=200 TUNE_S=0 bash benchmarks/h200_all.sh
# and flags: CHECK_FLAGS OPS_FLAGS KDA_FLAGS REPRO_FLAGS (e.g. REPRO_FLAGS="--configs [{}]": the narrow-head
# cases' values against the fp64 chunk form under launch-configuration overrides)
# gpu_check runs in SHARDS parallel processes (compilation is per process and CPU-bound).
set -u
OUT=${OUT:-/tmp/gdn-h200}
mkdir -p "$OUT"
SITE=/tmp/site
[ -d "$SITE/fla" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl 2>&1 | tail -1
export PYTHONPATH="$PWD:$SITE" PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  [ "$secs" -gt 0 ] || { echo "=== $name skipped"; return; }
  echo "=== $name ($(date -u +%H:%M:%S))"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$? $name"; tail -n "${TAIL:-40}" "$OUT/$name.log"
}
check() {  # the GPU check in $SHARDS processes, logs concatenated
  local n=${SHARDS:-8} i
  for ((i = 0; i < n; i++)); do
    python3 benchmarks/gpu_check.py ${CHECK_FLAGS:-} --shard "$i/$n" > "$OUT/check_$i.part" 2>&1 &
  done
  wait
  cat "$OUT"/check_*.part; rm -f "$OUT"/check_*.part
}
export -f check
export OUT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
CFG=()
[ -f "$OUT/tuned.json" ] && CFG=(--config "$OUT/tuned.json")
step repro_v16 "${REPRO_S:-0}" python3 benchmarks/gpu_repro_v16.py ${REPRO_FLAGS:-}
step gpu_check "${GPU_CHECK_S:-200}" bash -c check
step tune "${TUNE_S:-0}" python3 benchmarks/tune_gpu.py --out "$OUT/tuned.json"
[ -f "$OUT/tuned.json" ] && CFG=(--config "$OUT/tuned.json")
step ops_gpu "${OPS_S:-150}" python3 benchmarks/ops_gpu.py --decode ${OPS_FLAGS:-} "${CFG[@]}"
step kda "${KDA_S:-0}" python3 benchmarks/kda_gpu.py ${KDA_FLAGS:---max-seconds 150 --check-seconds 80 --no-fla --no-decode --step-seconds 8}
step generation "${GEN_S:-0}" python3 benchmarks/generation.py --size 340m --contexts 2048,8192,32768
step train "${TRAIN_S:-0}" python3 benchmarks/train.py --preset gdn --size 340m --seq-len 4096 --batch 4

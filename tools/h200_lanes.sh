#!/usr/bin/env bash
# One device call, two lanes on an H200 x2 (one after the other on a single GPU). Logs under $OUT.
# Lane A (GPU 0): the GPU check (`pytest tests/gpu` in WORKERS processes; CHECK_ALL=1 adds the slow
# cases, CHECK_FLAGS more pytest arguments), GLUE_CMD, KDA_CMD, the training benchmark (TRAIN_FLAGS;
# TRAIN2_FLAGS for a second run). Lane B (GPU 1): gdn variants (VARIANTS, a JSON list of partial
# launch configurations; VAR_FLAGS e.g. --profile), the ops table with FLA (OPS_FLAGS, default
# --decode --profile), after B_DELAY seconds. Every step has a time slice *_S; a slice of 0 skips the step.
#   OUT=/tmp/x GLUE_CMD="python3 benchmarks/glue_gpu.py" TRAIN_S=280 OPS_S=420 bash tools/h200_lanes.sh
set -u
export SITE=/tmp/site PYTHONUNBUFFERED=1
NO_VARIANT='[{}]'  # (a literal default inside ${...:-} would end at its first brace)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH="$PWD:$SITE"
NG=$(nvidia-smi -L | wc -l)
G1=$(( NG > 1 ? 1 : 0 ))
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# the check's processes keep to two CPU threads each, leaving the host's cores to lane B's timings
# (torch's CPU ops on an oversubscribed host stretched host-bound rows tenfold)
check() {
  local args=(-q -p no:cacheprovider -n "${WORKERS:-6}" -rf tests/gpu)
  [ "${CHECK_ALL:-0}" = 1 ] && args+=(-m "")
  # shellcheck disable=SC2086  # CHECK_FLAGS holds several pytest arguments
  CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=2 timeout "${CHECK_S:-230}" python3 -m pytest "${args[@]}" ${CHECK_FLAGS:-} \
    > "$OUT/gpu_check.log" 2>&1
}
laneA() {
  if [ "${CHECK_S:-230}" -gt 0 ]; then check; fi
  if [ -n "${GLUE_CMD:-}" ]; then CUDA_VISIBLE_DEVICES=0 timeout ${GLUE_S:-150} bash -c "$GLUE_CMD" > "$OUT/glue.log" 2>&1; fi
  if [ -n "${KDA_CMD:-}" ]; then CUDA_VISIBLE_DEVICES=0 timeout ${KDA_S:-150} bash -c "$KDA_CMD" > "$OUT/kda.log" 2>&1; fi
  if [ "${TRAIN_S:-170}" -gt 0 ]; then
    CUDA_VISIBLE_DEVICES=0 timeout ${TRAIN_S:-170} python3 benchmarks/train.py --preset gdn --size 340m --seq-len 4096 --batch 4 ${TRAIN_FLAGS:-} > "$OUT/train.log" 2>&1
  fi
  if [ -n "${TRAIN2_FLAGS:-}" ]; then
    CUDA_VISIBLE_DEVICES=0 timeout ${TRAIN2_S:-170} python3 benchmarks/train.py --preset gdn --size 340m --seq-len 4096 --batch 4 $TRAIN2_FLAGS > "$OUT/train2.log" 2>&1
  fi
}
laneB() {
  sleep "${B_DELAY:-0}"  # e.g. to time the ops table after lane A's check has left the host's cores
  if [ -n "${B_CACHE:-}" ]; then export TRITON_CACHE_DIR="$B_CACHE"; fi  # a fresh cache: cold first calls
  if [ "${VAR_S:-190}" -gt 0 ]; then
    CUDA_VISIBLE_DEVICES=$G1 timeout ${VAR_S:-190} python3 benchmarks/ops_gpu.py --variants "${VARIANTS:-$NO_VARIANT}" ${VAR_FLAGS:-} > "$OUT/variants.log" 2>&1
  fi
  if [ "${OPS_S:-320}" -gt 0 ]; then
    CUDA_VISIBLE_DEVICES=$G1 timeout ${OPS_S:-320} python3 benchmarks/ops_gpu.py --max-seconds $(( ${OPS_S:-320} - 60 )) ${OPS_FLAGS:---decode --profile} > "$OUT/ops_gpu.log" 2>&1
  fi
}
if [ "$NG" -gt 1 ]; then laneA & laneB & wait; else laneA; laneB; fi
echo "=== check"; [ -f "$OUT/gpu_check.log" ] && grep -h "^FAILED\|^ERROR\| passed\| failed" "$OUT/gpu_check.log" | tail -25
echo "=== variants"; [ -f "$OUT/variants.log" ] && grep "^|" "$OUT/variants.log" | head -80
echo "=== train"; [ -f "$OUT/train.log" ] && grep "^|\|x$" "$OUT/train.log"; [ -f "$OUT/train2.log" ] && grep "^|\|x$" "$OUT/train2.log"
echo "=== glue"; [ -f "$OUT/glue.log" ] && grep "^|" "$OUT/glue.log" | tail -40
echo "=== kda"; [ -f "$OUT/kda.log" ] && tail -30 "$OUT/kda.log"
echo "=== ops"; [ -f "$OUT/ops_gpu.log" ] && grep -v "^{" "$OUT/ops_gpu.log" | tail -75

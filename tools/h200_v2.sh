#!/usr/bin/env bash
# Validates and times this branch's kernel and decode changes on one H200, from the repository root,
# in phases that each fit one 10-minute device call (FLA's wheels in .whl/ for the kda and gen phases):
#
#   tools/h200_v2.sh check   # the GPU suite on the defaults (KDA launch settings, lean decode step), then
#                            # the chunk suite with δ from the inverse and with the fused dqk + wy_bwd forced
#   tools/h200_v2.sh time    # benchmarks/ops_gpu.py --variants: stored W/U vs δ from the inverse vs fused dqk + wy_bwd vs both
#   tools/h200_v2.sh kda     # gdn's chunk KDA against FLA's chunk_kda
#   tools/h200_v2.sh gen     # kernels per decode step, then model.generate on the graph at batch 1 and 32
#
# Logs go to $OUT (default /tmp/h200_v2). A variant is adopted only when its check passes and its
# time beats the default in the same call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200_v2}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
INV='{"state_out": {"from_inverse": true}, "state_fwd": {"from_inverse": true}}'
FUSED='{"dqk_wy": {"use": true}}'
fla() { [ -d /tmp/site/fla ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; }

case ${1:-} in
  check)
    timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 -rf tests/gpu 2>&1 | tee "$OUT/check_default.log" | tail -15
    GDN_TUNING="$INV" timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -rf tests/gpu/test_chunk.py 2>&1 \
      | tee "$OUT/check_inverse.log" | tail -8
    GDN_TUNING="$FUSED" timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -rf tests/gpu/test_chunk.py 2>&1 \
      | tee "$OUT/check_dqk_wy.log" | tail -8 ;;
  time)
    timeout 540 python3 benchmarks/ops_gpu.py --profile --shapes "${SHAPES:-0,1,2,3,5}" \
      --variants "[{}, $INV, $FUSED, {\"state_out\": {\"from_inverse\": true}, \"state_fwd\": {\"from_inverse\": true}, \"dqk_wy\": {\"use\": true}}]" \
      2>&1 | tee "$OUT/ab.log" ;;
  kda)
    fla
    timeout 540 python3 benchmarks/kda_gpu.py --shapes 0,1,2 --impls "gdn KDA,FLA chunk" --no-decode --max-seconds 500 \
      --json "$OUT/kda.json" 2>&1 | tee "$OUT/kda.log" ;;
  gen)
    fla
    timeout 120 python3 tools/decode_kernels.py --preset gdn --size 340m --batch 1 --device cuda --dtype bfloat16 --profile \
      2>&1 | tee "$OUT/kernels_b1.log" | tail -20
    timeout 120 python3 tools/decode_kernels.py --preset gdn --size 340m --batch 32 --device cuda --dtype bfloat16 \
      2>&1 | tee "$OUT/kernels_b32.log" | tail -20
    timeout 330 python3 benchmarks/generation.py --quick --max-seconds 300 --json "$OUT/gen.json" 2>&1 \
      | tee "$OUT/gen.log" | tail -30 ;;
  *) echo "usage: tools/h200_v2.sh check|time|kda|gen" >&2; exit 2 ;;
esac

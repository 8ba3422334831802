#!/usr/bin/env bash
# Validates and times the kernel and decode changes on one H200, from the repository root, in
# phases that each fit one 10-minute device call (FLA's wheels in .whl/ for the kda and gen phases):
#
#   tools/h200_v2.sh check   # the GPU suite, then the host time of the chunk op against its kernels
#   tools/h200_v2.sh gen     # kernels per decode step, then model.generate on the graph at batch 1 and 32
#   tools/h200_v2.sh kda     # gdn's chunk KDA against FLA's chunk_kda
#
# Logs go to $OUT (default /tmp/h200_v2).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200_v2}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
fla() { [ -d /tmp/site/fla ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; }

case ${1:-} in
  check)
    timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 -rf tests/gpu 2>&1 | tee "$OUT/check.log" | tail -15
    for s in 8x2048 4x8192; do
      timeout 90 python3 tools/host_profile.py --shape $s 2>&1 | tee "$OUT/host_$s.log" | head -4
    done ;;
  gen)
    fla
    timeout 120 python3 tools/decode_kernels.py --preset gdn --size 340m --batch 1 --device cuda --dtype bfloat16 --profile \
      2>&1 | tee "$OUT/kernels_b1.log" | tail -20
    timeout 120 python3 tools/decode_kernels.py --preset gdn --size 340m --batch 32 --device cuda --dtype bfloat16 \
      2>&1 | tee "$OUT/kernels_b32.log" | tail -20
    timeout 330 python3 benchmarks/generation.py --quick --max-seconds 300 --json "$OUT/gen.json" 2>&1 \
      | tee "$OUT/gen.log" | tail -30 ;;
  kda)
    fla
    timeout 540 python3 benchmarks/kda_gpu.py --shapes 0,1,2 --impls "gdn KDA,FLA chunk" --no-decode --max-seconds 500 \
      --json "$OUT/kda.json" 2>&1 | tee "$OUT/kda.log" ;;
  *) echo "usage: tools/h200_v2.sh check|gen|kda" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# One device call that checks and times everything on the H200 (docs/BENCHMARKS.md's GPU figures
# come from this script's logs). Run from the repository root on the GPU machine, with FLA's
# wheels (fla-core and flash-linear-attention 0.6.0, Python 3.12) in .whl/ and $OUT set to a folder
# for the logs.
# Seconds per step from the environment (0 skips the step):
#   GPU_CHECK_S HOST_S DECODE_S TUNE_S OPS_S GRAPH_S KDA_S KDA_PROF_S GEN_S GLUE_S TRAIN_S   e.g. GPU_CHECK_S=200 TUNE_S=0 bash tools/h200_all.sh
# and flags: CHECK_ALL=1 (the slow cases of the GPU check too), CHECK_FLAGS (more pytest arguments,
# e.g. "-k kda"), CHECK_PATHS (the test files of a partial check, default tests/gpu: e.g. the files
# whose code changed, where the device time left will not hold the whole check), OPS_FLAGS, GRAPH_FLAGS, KDA_FLAGS, GEN_FLAGS, TRAIN_FLAGS. GRAPH_S: the GPU-bound side by side
# (benchmarks/ops_gpu.py --graph: each peer's call replayed from a CUDA graph, so that no host time
# enters; GRAPH_FLAGS default "--peers gdn,qla --shapes 0,1,2,3,4,6"). KDA_PROF_S: per-kernel GPU µs of the KDA chunk
# kernels at (8, 2048) (benchmarks/kda_gpu.py --profile), with the launch settings of
# KDA_PROF_CONFIG (JSON) if set, or once per setting of KDA_PROF_CONFIGS (JSON texts separated by
# ';', '{}' for the defaults; logs kda_profile_1.log, ...), KDA_PROF_S seconds each. HOST_S: the
# chunk op's host time against its kernels (tools/host_profile.py); DECODE_S: the 340m decode
# step's kernels, batch 1, with their times (tools/decode_kernels.py --profile). The GPU check is
# `pytest tests/gpu` in WORKERS pytest-xdist
# processes (compilation is per process and CPU-bound; six on the H200, four on an 80 GB card).
# A tuned launch table from a previous run ($OUT/tuned.json) is used by the timing steps; the
# check runs the defaults unless GDN_TUNING names a table (tests/gpu/conftest.py).
# AUTOTUNE_CACHE=1: the peers' Triton autotuning results (FLA autotunes each kernel on its first
# call at a shape, 30-140 s) are kept on disk (TRITON_CACHE_AUTOTUNING) and brought back as
# $OUT/autotune.tar.gz; unpacked into .autotune/ at the repository root (ignored, carried) for a
# later run, they are loaded instead of tuned again, so FLA compiles one configuration per kernel.
# The peers' first-call column then leaves their tuning out; gdn (no autotuning) is unaffected.
# QLA_CACHE=1: FlashQLA's TileLang kernels (compiled per shape, 15-200 s each) are kept in
# TILELANG_CACHE_DIR and brought back as $OUT/tlcache.tar.gz; copied to .tlcache/ (ignored, carried)
# they load instead of compiling in a later run, whose ops table then says its FlashQLA first-call
# column is not a cold compile.
# WHEELS: folders of wheels (carried) to install into the machine's scratch site first, e.g. the
# peers' that exceed one transfer together (../shared/tools/peer-wheels --flashqla), in two calls
# back to back on the same warm machine, the site kept between them:
#   WHEELS=".whl .whl-qla" INSTALL_ONLY=1 bash tools/h200_all.sh          (carry .whl .whl-qla)
#   WHEELS=.whl-z3 OPS_FLAGS="--peers gdn,fla,qla" bash tools/h200_all.sh  (carry .whl-z3)
# Each install runs to its end before anything times (an unfinished install leaves a package that
# imports without its functions). INSTALL_ONLY=1 stops after the installs.
set -u
OUT=${OUT:-/tmp/gdn-h200}
mkdir -p "$OUT"
SITE=/tmp/site
for w in ${WHEELS:-}; do
  ls "$w"/*.whl >/dev/null 2>&1 || { echo "WHEELS: no wheels in $w (carry it)"; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$w"/*.whl 2>&1 | tail -2
  rc=${PIPESTATUS[0]}
  echo "installed the wheels of $w into $SITE: rc=$rc"
  [ "$rc" = 0 ] || exit 2
done
[ -d "$SITE/fla" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl 2>&1 | tail -1
[ "${INSTALL_ONLY:-0}" = 1 ] && exit 0
export PYTHONPATH="$PWD:$SITE" PYTHONUNBUFFERED=1
TCACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
on_exit() {  # the caches so far, whenever the script ends (a step cut by its timeout included)
  if [ "${AUTOTUNE_CACHE:-0}" = 1 ]; then
    (cd "$TCACHE" && find . -name "*.autotune.json" -print0 | tar -czf "$OUT/autotune.tar.gz" --null -T -) 2>/dev/null
  fi
  if [ "${QLA_CACHE:-0}" = 1 ]; then
    tar -czf "$OUT/tlcache.tar.gz" -C "$(dirname "$TILELANG_CACHE_DIR")" "$(basename "$TILELANG_CACHE_DIR")" 2>/dev/null
  fi
}
trap on_exit EXIT
if [ "${AUTOTUNE_CACHE:-0}" = 1 ]; then
  export TRITON_CACHE_AUTOTUNING=1
  [ -d .autotune ] && mkdir -p "$TCACHE" && cp -r .autotune/. "$TCACHE"/ && echo "autotune results: $(find .autotune -name '*.autotune.json' | wc -l) carried"
fi
if [ "${QLA_CACHE:-0}" = 1 ]; then
  export TILELANG_CACHE_DIR=/tmp/tlcache
  mkdir -p /tmp && [ -f .tlcache/tlcache.tar.gz ] && tar -xzf .tlcache/tlcache.tar.gz -C /tmp \
    && echo "TileLang cache: $(find "$TILELANG_CACHE_DIR" -type f | wc -l) files carried"
fi
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  [ "$secs" -gt 0 ] || { echo "=== $name skipped"; return; }
  echo "=== $name ($(date -u +%H:%M:%S))"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$? $name"; tail -n "${TAIL:-40}" "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
CFG=()
[ -f "$OUT/tuned.json" ] && CFG=(--config "$OUT/tuned.json")
# six workers fit the H200's 141 GB with the largest cases running at once; on an 80 GB card two
# of them (38 and 31 GB) left a third out of memory: four there (the KDA cases at the benchmark
# shapes, 30-40 GB each, now run one at a time across workers: tests/gpu/helpers.py)
MEM_MB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
# -v: each result on its own line as it comes, so that a check cut by its time still names its
# failures (the list below); -rf lists them again at the end of one that finishes
# shellcheck disable=SC2206  # CHECK_PATHS holds several paths
CHECK=(python3 -m pytest -v -p no:cacheprovider -n "${WORKERS:-$([ "${MEM_MB:-0}" -gt 100000 ] && echo 6 || echo 4)}" -rf --durations=20 ${CHECK_PATHS:-tests/gpu})
[ "${CHECK_ALL:-0}" = 1 ] && CHECK+=(-m "")
# shellcheck disable=SC2086  # CHECK_FLAGS holds several pytest arguments
step gpu_check "${GPU_CHECK_S:-420}" "${CHECK[@]}" ${CHECK_FLAGS:-}
if [ -f "$OUT/gpu_check.log" ]; then
  echo "gpu_check: $(grep -c ' PASSED' "$OUT/gpu_check.log") passed, $(grep -c ' FAILED' "$OUT/gpu_check.log") failed so far"
  grep -E '^\[gw[0-9]+\].* (FAILED|ERROR) ' "$OUT/gpu_check.log" | head -20
fi
step host "${HOST_S:-0}" python3 tools/host_profile.py --shape 8x2048
step decode "${DECODE_S:-0}" python3 tools/decode_kernels.py --preset gdn --size 340m --batch 1 --device cuda \
  --dtype bfloat16 --profile
step tune "${TUNE_S:-0}" python3 tools/tune_gpu.py --out "$OUT/tuned.json"
[ -f "$OUT/tuned.json" ] && CFG=(--config "$OUT/tuned.json")
step ops_gpu "${OPS_S:-150}" python3 benchmarks/ops_gpu.py --decode ${OPS_FLAGS:-} "${CFG[@]}"
# shellcheck disable=SC2086  # GRAPH_FLAGS holds several arguments
step ops_graph "${GRAPH_S:-0}" python3 benchmarks/ops_gpu.py --graph ${GRAPH_FLAGS:---peers gdn,qla --shapes 0,1,2,3,4,6} "${CFG[@]}"
step kda "${KDA_S:-0}" python3 benchmarks/kda_gpu.py ${KDA_FLAGS:---max-seconds 150 --no-fla --no-decode --step-seconds 8}
if [ -n "${KDA_PROF_CONFIGS:-}" ]; then
  IFS=';' read -ra PROF_CFGS <<< "$KDA_PROF_CONFIGS"
  for i in "${!PROF_CFGS[@]}"; do
    step "kda_profile_$((i + 1))" "${KDA_PROF_S:-0}" python3 benchmarks/kda_gpu.py --profile --impls "gdn KDA" \
      --shapes 0 --config "${PROF_CFGS[$i]}"
  done
else
  step kda_profile "${KDA_PROF_S:-0}" python3 benchmarks/kda_gpu.py --profile --impls "gdn KDA" --shapes 0 \
    ${KDA_PROF_CONFIG:+--config "$KDA_PROF_CONFIG"}
fi
# shellcheck disable=SC2086  # GEN_FLAGS holds several arguments
step generation "${GEN_S:-0}" python3 benchmarks/generation.py --size 340m ${GEN_FLAGS:---new-tokens 128}
# the training step's glue kernels alone over their launch settings
step glue "${GLUE_S:-0}" python3 tools/glue_sweep.py
# shellcheck disable=SC2086  # TRAIN_FLAGS holds several arguments (e.g. --cuda-graph)
step train "${TRAIN_S:-0}" python3 benchmarks/train.py --preset gdn --size 340m --seq-len 4096 --batch 4 ${TRAIN_FLAGS:-}

#!/usr/bin/env bash
# dev/'s kernels on the GPU machine: each one's tests, then its timing against the stage kernel it
# would replace, for every variant its module reads from the environment, in groups that fit one
# call (DEVICE.md in ../shared: ten minutes a call). A dev/ kernel enters the package only after such
# a run shows it correct and faster (the developers' guide: no kernel enters the package blind);
# `glue` runs two that have entered it, and times one against the kernel it displaces below a
# provisional threshold.
#
#   tools/gpu_dev.sh LOG_DIR GROUP
#
# Installs the carried wheels and flashv41 (tools/device_setup.sh), then runs the group's steps, each
# a process of its own under its own limit, into LOG_DIR/dev-<group>.log; the exit status is the
# first failing step's.
#   glue    stages.mixes_tiles (the prefill mixes' product, in the package since 2026-12-07) and
#           the stage's embedding: their tests at flash size (tests/test_mixes_tiles.py,
#           tests/test_embed.py), test_hyper's and its mutants on the GPU's compiler, then
#           tools/time_mixes.py: mixes_tiles against stream_partials at T = 16 .. 512, the figures
#           that set stages.hyper.MIXES_TILES_MIN_TOKENS (about 5 minutes)
#   wgmma   stages.gemm_wgmma (moved from dev/, picked for BF16 on compute capability 9.0): its tests,
#           the flash shapes included, and its mutants at flash size; its timing beside gemm_pipe and
#           cuBLAS is tools/gpu_bench.sh's prefill group (about 6 minutes: the flash checks' CPU side)
#   sparse  dev/sparse_fused2 against stages.sparse_fused: its tests and timing (about 3 minutes)
#   q8      dev/gemm_wgmma_q8 (Q8_0 prefill products on wgmma, the weights as the register operand):
#           its tests, the flash shapes included, then its timing beside stages.gemm_pipe's Q8_0
#           and cuBLAS fp16 at 4096 tokens (about 4 minutes)
#   tma     dev/gemm_tma (BF16 on wgmma fed by TMA, producer warp and mbarriers): its tests, the
#           flash shapes included, then its timing beside stages.gemm_wgmma and cuBLAS, four and
#           three stages (about 5 minutes)
set -uo pipefail

log_dir=${1:?usage: tools/gpu_dev.sh LOG_DIR GROUP}
group=${2:?usage: tools/gpu_dev.sh LOG_DIR GROUP}
case "$group" in
    glue|wgmma|sparse|q8|tma) ;;
    *) echo "tools/gpu_dev.sh: unknown group '$group' (glue, wgmma, sparse, q8, tma)" >&2; exit 2 ;;
esac
mkdir -p "$log_dir"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here" || exit 2
# shellcheck source=tools/device_setup.sh
. tools/device_setup.sh || exit 2
export PYTHONPATH="$here:$PYTHONPATH"  # dev/ is no package of the install
log="$log_dir/dev-$group.log"
echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader): $group" | tee "$log"
status=0

step() {  # step SECONDS "ENV=VALUE ..." COMMAND...: one process, its last lines into the log
    local limit=$1 env=$2
    shift 2
    echo "-- ${env:-(defaults)} $*" >> "$log"
    # shellcheck disable=SC2086
    env $env timeout --signal=INT "$limit" "$@" 2>&1 | grep -v "NumbaPerformanceWarning\|warn(errors" \
        | tail -n 25 >> "$log"
    local rc=${PIPESTATUS[0]}
    echo "-- exit $rc" >> "$log"
    [ "$status" -eq 0 ] && status=$rc
}

case "$group" in
    glue)
        step 150 "" python3 -m pytest -p no:cacheprovider -q -s -W ignore tests/test_mixes_tiles.py tests/test_embed.py
        step 150 "" python3 -m pytest -p no:cacheprovider -q -W ignore -n 8 tests/test_hyper.py \
            tests/test_mutants_hyper.py
        step 120 "" python3 tools/time_mixes.py ;;
    wgmma)
        step 330 "" python3 -m pytest -p no:cacheprovider -q -x -W ignore tests/test_gemm_wgmma.py
        step 120 "" python3 -m pytest -p no:cacheprovider -q -x -W ignore tests/test_mutants_products.py -k wgmma ;;
    sparse)
        step 100 "" python3 -m pytest -p no:cacheprovider -q -W ignore dev/test_sparse_fused2.py
        step 70 "" python3 -m dev.test_sparse_fused2 ;;
    q8)
        step 200 "" python3 -m pytest -p no:cacheprovider -q -W ignore dev/test_gemm_wgmma_q8.py
        step 90 "" python3 -m dev.test_gemm_wgmma_q8 ;;
    tma)
        step 200 "" python3 -m pytest -p no:cacheprovider -q -x -W ignore dev/test_gemm_tma.py
        step 60 "" python3 -m dev.test_gemm_tma
        step 60 "TMA_STAGES=3" python3 -m dev.test_gemm_tma ;;
esac
echo "== $group: exit $status" | tee -a "$log"
cat "$log"
exit "$status"

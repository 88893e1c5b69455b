#!/usr/bin/env bash
# dev/'s kernels on the GPU machine: each one's tests, then its timing against the stage kernel it
# would replace, for every variant its module reads from the environment, in groups that fit one
# call (DEVICE.md in ../shared: ten minutes a call). A dev/ kernel enters the package only after such
# a run shows it correct and faster (the developers' guide: no kernel enters the package blind).
#
#   tools/gpu_dev.sh LOG_DIR GROUP
#
# Installs the carried wheels and flashv41 (tools/device_setup.sh), then runs the group's steps, each
# a process of its own under its own limit, into LOG_DIR/dev-<group>.log; the exit status is the
# first failing step's.
#   glue    dev/mixes_tiles (the prefill mixes' product) against stream_partials, without and with
#           MIXES_PREFETCH, and dev/embed_rows against the stage's embedding: tests at flash size
#           and timing (about 4 minutes)
#   wgmma   dev/gemm_wgmma against gemm_pipe and cuBLAS: the small tests and the timing of the seven
#           flash shapes for the 128-byte swizzle, with WGMMA_INFLIGHT=1, WGMMA_BN=256 and both
#           (about 8 minutes)
#   sparse  dev/sparse_fused2 against stages.sparse_fused: its tests and timing (about 3 minutes)
set -uo pipefail

log_dir=${1:?usage: tools/gpu_dev.sh LOG_DIR GROUP}
group=${2:?usage: tools/gpu_dev.sh LOG_DIR GROUP}
case "$group" in
    glue|wgmma|sparse) ;;
    *) echo "tools/gpu_dev.sh: unknown group '$group' (glue, wgmma, sparse)" >&2; exit 2 ;;
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
        for v in 0 1; do
            step 90 "MIXES_PREFETCH=$v" python3 -m pytest -p no:cacheprovider -q -s -W ignore dev/test_mixes_tiles.py
            step 60 "MIXES_PREFETCH=$v" python3 -m dev.test_mixes_tiles 512
        done
        step 90 "" python3 -m pytest -p no:cacheprovider -q -W ignore dev/test_embed_rows.py
        step 90 "" python3 -m dev.test_embed_rows 512 ;;
    wgmma)
        for v in "" "WGMMA_INFLIGHT=1" "WGMMA_BN=256" "WGMMA_BN=256 WGMMA_INFLIGHT=1"; do
            step 50 "$v" python3 -m pytest -p no:cacheprovider -q -x -W ignore dev/test_gemm_wgmma.py -k "not flash"
            step 70 "$v" python3 -m dev.test_gemm_wgmma 4096
        done ;;
    sparse)
        step 100 "" python3 -m pytest -p no:cacheprovider -q -W ignore dev/test_sparse_fused2.py
        step 70 "" python3 -m dev.test_sparse_fused2 ;;
esac
echo "== $group: exit $status" | tee -a "$log"
cat "$log"
exit "$status"

#!/usr/bin/env bash
# The benchmark in groups that each fit one call of the GPU machine (DEVICE.md in ../shared; a call
# runs at most 10 minutes), so a session's few calls time what each decision needs in one process.
#
#   tools/gpu_bench.sh LOG_DIR GROUP [SECONDS]
#
# Installs the carried wheels and flashv41 (tools/device_setup.sh), prints the GPU, then runs the
# group's rows with `flashv41 bench`, writing LOG_DIR/<group>.log and LOG_DIR/<group>.json. SECONDS
# (default 540) limits the run; a row the limit interrupts is lost, the rows before it are in the log
# and the JSON (whose "complete" is then false and "interrupted_at" names the row).
# The groups, each one process (the rows of one decision share its copy bandwidth and L2 figures):
#   decode     every decode product, picked kernel and the displaced one beside it (gemv.*), for the
#              types imma is picked for (Q2_K, Q4_K, Q5_K, MXFP4): about 112 rows, 6 minutes
#   decode-rest the same for Q8_0, Q6_K and Q3_K (imma beside stream) and BF16
#   prefill    the prefill GEMMs (prefill.gemm.*) for BF16 (wgmma, and pipe beside it), Q8_0 (pipe)
#              and Q4_K (tc), each against cuBLAS
#   stacks     the head (head.decode.*), the 40-layer step (stack.decode.40), the batched steps
#              (stack.decode.batch) and the six-layer prefill at 32k (prefill.stack.32k)
#   attention  every attention block type's step at 1k, 16k, 64k and 1M (attention.decode.*)
#   sparse     the sparse attention alone at the flash shape (sparse.*): prefill chunks of 64 and 512
#              tokens and batched steps of 16-128 sequences on the fused kernel; steps of 1-8
#              sequences, the split path's CUDA cores beside it
set -uo pipefail

log_dir=${1:?usage: tools/gpu_bench.sh LOG_DIR GROUP [SECONDS]}
group=${2:?usage: tools/gpu_bench.sh LOG_DIR GROUP [SECONDS]}
seconds=${3:-540}
case "$group" in
    decode) rows=('gemv.*'); types=(Q2_K Q4_K Q5_K MXFP4) ;;
    decode-rest) rows=('gemv.*'); types=(Q8_0 Q6_K Q3_K BF16) ;;
    prefill) rows=('prefill.gemm.*'); types=(BF16 Q8_0 Q4_K) ;;
    stacks) rows=('head.decode.*' 'stack.decode.40' 'stack.decode.batch' 'prefill.stack.32k'); types=(Q8_0 Q4_K) ;;
    attention) rows=('attention.decode.*'); types=(Q8_0 BF16 Q4_K) ;;
    sparse) rows=('sparse.*'); types=(Q8_0) ;;
    *) echo "tools/gpu_bench.sh: unknown group '$group' (decode, decode-rest, prefill, stacks, attention, sparse)" >&2
       exit 2 ;;
esac
mkdir -p "$log_dir"

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here" || exit 2
# shellcheck source=tools/device_setup.sh
. tools/device_setup.sh || exit 2

log="$log_dir/$group.log"
echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader): $group" | tee "$log"
timeout --signal=INT "$seconds" flashv41 bench --rows "${rows[@]}" --weight-type "${types[@]}" \
    --json "$log_dir/$group.json" 2>&1 | grep -v "NumbaPerformanceWarning\|warn(errors" >> "$log"
status=${PIPESTATUS[0]}
echo "== $group: exit $status" | tee -a "$log"
tail -n 80 "$log"
exit "$status"

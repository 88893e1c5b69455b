#!/usr/bin/env bash
# A GPU session's first job in one go, on one start of the machine (DEVICE.md in ../shared: ten
# minutes a call, 30 minutes of device time a session, a start a minute or more of it):
#
#   tools/gpu_detached.sh start session bash tools/gpu_session.sh /tmp/flashv41-runs/session/log
#   tools/gpu_detached.sh wait session 560 "$OUT"      (then again, each call as the last returns)
#
# In order: the whole GPU suite (tools/gpu_suite.sh: every `gpu` test, about 9-11 minutes with its
# device-memory part); the dev/ kernels waiting for their first GPU run (tools/gpu_dev.sh's groups
# named in DEV_GROUPS, default "q8 tma": dev/gemm_wgmma_q8's and dev/gemm_tma's tests and timings,
# about 9 minutes); the mixes' product at each token count (tools/time_mixes.py: what sets
# stages.hyper's MIXES_TILES_MIN_TOKENS); the bench groups `prefill` (the prefill GEMMs: wgmma,
# pipe and tc against cuBLAS) and `stacks` (the head, the 40-layer and batched decode steps, the
# 32k prefill), each limited to 360 s. All of it is more than a session's 30 device minutes: what
# comes last is what a short session loses. Everything goes under LOG_DIR (suite/, dev/,
# time_mixes.txt, bench/); the exit status is the suite's. Other groups: BENCH_GROUPS="sparse
# stacks", DEV_GROUPS="" (none) in the environment.
set -uo pipefail

log_dir=${1:?usage: tools/gpu_session.sh LOG_DIR}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here" || exit 2
mkdir -p "$log_dir"

bash tools/gpu_suite.sh "$log_dir/suite"
suite=$?
echo "== session: the suite ended with exit $suite"
for group in ${DEV_GROUPS-q8 tma}; do
    bash tools/gpu_dev.sh "$log_dir/dev" "$group" | tail -n 30
done
(
    # shellcheck source=tools/device_setup.sh
    . tools/device_setup.sh > /dev/null || exit 2
    timeout 180 python3 tools/time_mixes.py
) > "$log_dir/time_mixes.txt" 2>&1
grep -v "Warning\|warn(" "$log_dir/time_mixes.txt" | tail -n 20
for group in ${BENCH_GROUPS:-prefill stacks}; do
    bash tools/gpu_bench.sh "$log_dir/bench" "$group" 360 | tail -n 40
done
exit "$suite"

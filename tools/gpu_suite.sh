#!/usr/bin/env bash
# The whole GPU suite in one call on the GPU machine (DEVICE.md in ../shared says how to reach it).
#
#   tools/gpu_suite.sh LOG_DIR [WORKERS] [-- extra pytest arguments]
#
# Installs the carried wheels and flashv41 (tools/device_setup.sh), then runs the `gpu` tests in
# three parts: the tests that run an Engine (engine_tests below: the default paths) over WORKERS
# pytest-xdist processes; the tests that read the GPU's free memory (marker device_memory) in one
# process, alone; every other `gpu` test over the workers. So a limit that cuts the run short cuts
# kernel-level tests, which the engine's tests use too. WORKERS is 14 by default: Numba's compiles,
# one CPU core each, are most of the suite's time; every worker holds its own CUDA context on the one
# GPU, and runs NumPy with one BLAS thread. The log goes to LOG_DIR/gpu_suite.log, the slowest tests
# and the skips with their reasons included; the exit status is the first failing part's pytest's.
# SUITE_TIMEOUT (seconds, default 3000) limits the three parts together and interrupts pytest,
# which then still prints what ran, so a device call's limit never loses the log.
# Idle workers take tests queued on busy ones (--dist worksteal): a few tests take a minute or two
# each (on an H100, 2026-12-07: 114 s, 88 s, 66 s), and one left at the end of a worker's queue held
# the run. Each test's result is its own line (-v), so a run the limit interrupts still says which
# tests ran; the failures and skips are listed at the end (-rfEs), without Numba's occupancy
# warnings. What the tests print (the speculative example's accepted-token rate, the timing script's
# rows) is kept per test in LOG_DIR/gpu_suite_engine.xml and LOG_DIR/gpu_suite.xml (JUnit XML, each
# test's system-out).
#
# Prepare once, on a machine with a package index, in the project root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl numpy==2.4.6
#   python3 -m pip download --no-deps -d .whl gguf==0.19.0 tqdm pytest-xdist execnet setuptools
# then carry .whl in the device call.
set -uo pipefail

log_dir=${1:?usage: tools/gpu_suite.sh LOG_DIR [WORKERS] [-- pytest args]}
shift
workers=14
if [ $# -gt 0 ] && [ "$1" != "--" ]; then
    workers=$1
    shift
fi
[ "${1:-}" = "--" ] && shift
mkdir -p "$log_dir"
log="$log_dir/gpu_suite.log"

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here" || exit 2
# shellcheck source=tools/device_setup.sh
. tools/device_setup.sh || exit 2

{
    echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
    python3 -c "import numpy, numba, numba.cuda; print('numpy', numpy.__version__, 'numba', numba.__version__)"
} 2>&1 | tee "$log"

start=$(date +%s)
deadline=$(( start + ${SUITE_TIMEOUT:-3000} ))
left() { local n=$(( deadline - $(date +%s) )); [ "$n" -lt 1 ] && n=1; echo "$n"; }
# the tests that run an Engine (the default paths: the picks, graphs, batches, fork / truncate / save):
# first, over the workers, so that a limit which cuts the run short cuts kernel-level tests, not these
engine_tests=(tests/test_engine_gpu.py tests/test_forward_gpu.py tests/test_sequence_state_gpu.py
    tests/test_attention_layer.py tests/test_engram_gpu.py tests/test_reliability_engine.py)
ignore_engine=()
for f in "${engine_tests[@]}"; do ignore_engine+=("--ignore=$f"); done
# one BLAS thread a worker: NumPy's OpenBLAS starts a thread per core in every process, and 14 workers'
# oracle products (the flash-sized references, the long runs' 3000 oracle steps) would otherwise run
# 14 x 16 threads on 16 cores
workers_run() {  # workers_run XML_NAME PYTEST_ARGS...: the gpu tests but the device_memory ones, over the workers
    local xml=$1
    shift
    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 \
    timeout --signal=INT "$(left)" python3 -m pytest -m "gpu and not device_memory" -n "$workers" --dist worksteal \
        -p no:cacheprovider -v -rfEs --durations=25 -W "ignore:Grid size" \
        --junitxml "$log_dir/$xml" -o junit_logging=system-out "$@" 2>&1 | tee -a "$log"
    return "${PIPESTATUS[0]}"
}
workers_run gpu_suite_engine.xml "${engine_tests[@]}" "$@"
engine=$?
echo "== gpu suite, the engine tests: exit $engine, $(( $(date +%s) - start )) s wall" | tee -a "$log"
# then, alone on the GPU, the tests that read its free memory (marker device_memory: another
# worker's allocations would show in their figures)
timeout --signal=INT "$(left)" python3 -m pytest -m "gpu and device_memory" -p no:cacheprovider -v -rfEs \
    --durations=0 -W "ignore:Grid size" "$@" 2>&1 | tee -a "$log"
alone=${PIPESTATUS[0]}
echo "== gpu suite, the device_memory tests alone: exit $alone, $(( $(date +%s) - start )) s wall" | tee -a "$log"
# then every other gpu test over the workers
workers_run gpu_suite.xml "${ignore_engine[@]}" "$@"
status=$?
# a part that selects no test (pytest's 5: extra arguments may select none of its tests) did not fail
for part in engine alone status; do [ "${!part}" -eq 5 ] && printf -v "$part" 0; done
[ "$status" -eq 0 ] && status=$engine
[ "$status" -eq 0 ] && status=$alone
echo "== gpu suite: exit $status, $(( $(date +%s) - start )) s wall" | tee -a "$log"
exit "$status"

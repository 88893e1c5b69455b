#!/usr/bin/env bash
# The whole GPU suite in one call on the GPU machine (DEVICE.md in ../shared says how to reach it).
#
#   tools/gpu_suite.sh LOG_DIR [WORKERS] [-- extra pytest arguments]
#
# Installs the carried wheels and flashv41 (tools/device_setup.sh), then runs the `gpu` tests in
# two parts: every test but those that read the GPU's free memory over WORKERS pytest-xdist
# processes, longest first; then those (marker device_memory) in one process, alone on the GPU.
# WORKERS is 15 by default: Numba's compiles, one CPU core each, are most of the suite's time; every
# worker holds its own CUDA context on the one GPU, and runs NumPy with one BLAS thread.
# Longest first: tests/conftest.py orders the tests by tools/gpu_durations.json (the seconds each
# took in an earlier run, tools/test_durations.py; an xdist_group's tests as one scope of their
# sum), and `--dist loadgroup --no-loadscope-reorder` hands them out in that order (pytest-xdist's
# default reorder put the groups first), so the few that take minutes start at once instead of
# holding a worker at the end (on an H100, 2026-12-07, the engine tests alone took 568 s over 15
# workers for 2,991 s of work); the tests of an xdist_group (module fixtures of minutes) go to one
# worker together. A test the file
# does not name counts 30 s. Each run writes LOG_DIR/gpu_durations.json, the file updated by its
# figures, to copy back into tools/.
# SUITE_TIMEOUT (seconds, default 3000) limits the two parts together and interrupts pytest, which
# then still prints what ran, so a device call's limit never loses the log; whatever an interrupted
# part leaves running (an xdist worker finishes its test after its controller has gone) is killed
# before the next part starts: such workers once held the CPUs through two later bench calls.
# The log goes to LOG_DIR/gpu_suite.log, the slowest tests and the skips with their reasons
# included; the exit status is the first failing part's pytest's. Each test's result is its own line
# (-v), so a run the limit interrupts still says which tests ran; the failures and skips are listed
# at the end (-rfEs), without Numba's occupancy warnings. What the tests print (the speculative
# example's accepted-token rate, the timing script's rows) is kept per test in
# LOG_DIR/gpu_suite.xml (JUnit XML, each test's system-out).
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
workers=15
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
    # pytest-xdist 3.8 groups tests (--dist loadgroup) by renaming them, which pytest 9.2 undoes:
    # there the suite still runs, but the grouped tests are spread (and their shared setups repeated)
    python3 -c "import pytest, xdist; print('pytest', pytest.__version__, 'xdist', xdist.__version__)
v = tuple(int(p) for p in pytest.__version__.split('.')[:2])
if v >= (9, 2): print('warning: on pytest >= 9.2, xdist_group does not group tests (slower suite)')"
    echo "kernel cache: ${FLASHV41_KERNEL_CACHE:-off}"
} 2>&1 | tee "$log"

start=$(date +%s)
deadline=$(( start + ${SUITE_TIMEOUT:-3000} ))
left() { local n=$(( deadline - $(date +%s) )); [ "$n" -lt 1 ] && n=1; echo "$n"; }
# one BLAS thread a worker: NumPy's OpenBLAS starts a thread per core in every process, and 15 workers'
# oracle products (the flash-sized references, the long runs' 3000 oracle steps) would otherwise run
# 15 x 16 threads on 16 cores
part() {  # part LIMIT PYTEST_ARGS...: pytest in a process group of its own (timeout's), killed whole after
    timeout --signal=INT "$1" python3 -m pytest "${@:2}" > >(tee -a "$log") 2>&1 &
    local pid=$! status
    wait "$pid"
    status=$?
    kill -KILL -- "-$pid" 2>/dev/null  # the workers an interrupt left running
    return "$status"
}
# each worker frees its dead device arrays once they pass 1% of the GPU's memory: numba keeps them
# until 20% by default, and 15 workers each holding up to 16 GB of garbage ran the H100's 80 GB out
# (2026-12-07: six flash-dimension tests failed with CUDA_ERROR_OUT_OF_MEMORY; numba's retry after
# an OOM frees only the failing process's own). What the workers hold is sampled every 10 s into
# LOG_DIR/gpu_memory.csv.
# every test's start and end, by worker, into LOG_DIR/timeline.tsv (tests/conftest.py; the
# device-memory part's into timeline_alone.tsv): what ran when, and which tests a limit cut short
# (tools/suite_timeline.py's summary goes into the log)
export FLASHV41_TEST_TIMELINE="$log_dir/timeline.tsv"
rm -f "$log_dir/timeline.tsv" "$log_dir/timeline_alone.tsv"
nvidia-smi --query-compute-apps=timestamp,pid,used_memory --format=csv,noheader -l 10 \
    > "$log_dir/gpu_memory.csv" 2>/dev/null &
sampler=$!
NUMBA_CUDA_MAX_PENDING_DEALLOCS_RATIO=0.01 \
OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 FLASHV41_TEST_DURATIONS=tools/gpu_durations.json \
    part "$(left)" -m "gpu and not device_memory" -n "$workers" --dist loadgroup --no-loadscope-reorder -p no:cacheprovider -v -rfEs \
    --durations=25 -W "ignore:Grid size" --junitxml "$log_dir/gpu_suite.xml" -o junit_logging=system-out "$@"
spread=$?
kill "$sampler" 2>/dev/null
echo "== gpu suite, over the workers: exit $spread, $(( $(date +%s) - start )) s wall" | tee -a "$log"
python3 tools/suite_timeline.py "$log_dir/timeline.tsv" 2>&1 | tee -a "$log"
export FLASHV41_TEST_TIMELINE="$log_dir/timeline_alone.tsv"
# then, alone on the GPU, the tests that read its free memory (another process's allocations would
# show in their figures)
part "$(left)" -m "gpu and device_memory" -p no:cacheprovider -v -rfEs --durations=0 -W "ignore:Grid size" \
    --junitxml "$log_dir/gpu_suite_alone.xml" "$@"
alone=$?
echo "== gpu suite, the device_memory tests alone: exit $alone, $(( $(date +%s) - start )) s wall" | tee -a "$log"
python3 tools/test_durations.py "$log_dir/gpu_durations.json" tools/gpu_durations.json "$log_dir/gpu_suite.xml" \
    "$log_dir/gpu_suite_alone.xml" "$log_dir/timeline.tsv" "$log_dir/timeline_alone.tsv" | tee -a "$log"
# a part that selects no test (pytest's 5: extra arguments may select none of its tests) did not fail
for p in spread alone; do [ "${!p}" -eq 5 ] && printf -v "$p" 0; done
status=$spread
[ "$status" -eq 0 ] && status=$alone
echo "== gpu suite: exit $status, $(( $(date +%s) - start )) s wall" | tee -a "$log"
exit "$status"

# Source this on the GPU machine, in the project root, before the GPU suite or the benchmark:
#   . tools/device_setup.sh
# It installs the wheels carried in .whl/ (NumPy 2.4, which numba-cuda 0.30 needs, and the
# pure-Python packages the machine lacks) into /tmp/site, puts them first on PYTHONPATH, and
# installs flashv41 editable into the machine's Python, so that flashv41.host and flashv41.stages map
# to host/ and stages/ as they do in CI and the `flashv41` command exists. How to fill .whl/: the
# header of tools/gpu_suite.sh.
# Compiled kernels are kept in .kernel-cache/ (FLASHV41_KERNEL_CACHE, stages.device.kernel_cache_dir:
# a folder a hash of the sources names, ignored by git, so a warm machine keeps it between calls):
# the suite's workers and a later bench load what another process compiled. Set
# FLASHV41_KERNEL_CACHE= (empty) before sourcing to compile every kernel in every process instead;
# tools/kernel_cache_probe.py (a few seconds) turns it off where a kernel loaded from it fails or
# differs from the one compiled.
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || return 2
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 2
export FLASHV41_KERNEL_CACHE="${FLASHV41_KERNEL_CACHE-$PWD/.kernel-cache}"
if [ -n "$FLASHV41_KERNEL_CACHE" ] && ! python3 tools/kernel_cache_probe.py; then
    echo "tools/device_setup.sh: the kernel cache is off for this run (the probe above)" >&2
    export FLASHV41_KERNEL_CACHE=
fi

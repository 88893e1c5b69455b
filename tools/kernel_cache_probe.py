"""Whether the kernels' disk cache (stages.device.kernel_cache_dir) works on this GPU.

    python tools/kernel_cache_probe.py [DIR]

Runs the same few products twice, each in a fresh process with FLASHV41_KERNEL_CACHE=DIR (default:
the variable's value): a Q8_0 weight's decode GEMV and prefill GEMM (kernels made by factories,
their closures holding device functions) and a fill (a module's kernel). The first process
compiles and saves what DIR lacks; the second must load every kernel (cache hits, no miss) and
give the first one's bytes. Exit 0 when it does, 1 with the reason otherwise: tools/gpu_suite.sh
then runs without the cache. A few seconds where DIR already holds the kernels.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import subprocess
import sys

CHILD = "--child"


def child() -> None:
    from flashv41.stages.backend import select_backend

    select_backend()  # (before numba.cuda is imported: the GPU where there is one)
    import numpy as np
    from numba import cuda
    from numba.cuda.dispatcher import CUDADispatcher

    from flashv41.host.numerics import to_bits
    from flashv41.host.quants import GGMLType
    from flashv41.stages.device import KERNEL_CACHE, fill
    from flashv41.stages.linear import DeviceWeight, linear

    rng = np.random.default_rng(7)
    n, k = 256, 512
    w = DeviceWeight.from_values("probe", (rng.standard_normal((n, k)) * k**-0.5).astype(np.float32), GGMLType.Q8_0)
    digest = hashlib.sha256()
    for tokens in (1, 100):  # stream, then the prefill GEMM
        x = cuda.to_device(to_bits(rng.standard_normal((tokens, k)).astype(np.float32)))
        y = cuda.device_array((tokens, n), np.float32)
        fill(y, 0.0)
        linear(x, w, y, tokens)
        digest.update(y.copy_to_host().tobytes())
    dispatchers = [d for d in gc.get_objects() if isinstance(d, CUDADispatcher)]
    print(json.dumps({"cached": KERNEL_CACHE, "digest": digest.hexdigest(),
                      "hits": sum(sum(d.stats.cache_hits.values()) for d in dispatchers),
                      "misses": sum(sum(d.stats.cache_misses.values()) for d in dispatchers)}))


def run_child(env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, __file__, CHILD], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the probe's process failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    folder = argv[0] if argv else os.environ.get("FLASHV41_KERNEL_CACHE", "")
    if not folder:
        print("kernel cache probe: no folder (give one, or set FLASHV41_KERNEL_CACHE)", file=sys.stderr)
        return 1
    env = dict(os.environ, FLASHV41_KERNEL_CACHE=folder)
    try:
        first, second = run_child(env), run_child(env)
    except RuntimeError as e:
        print(f"kernel cache probe: {e}", file=sys.stderr)
        return 1
    print(f"kernel cache probe ({folder}): first process {first['hits']} loaded, {first['misses']} compiled; "
          f"second {second['hits']} loaded, {second['misses']} compiled")
    if not (first["cached"] and second["cached"]):
        reason = "the kernels are not cached (the simulator?)"
    elif second["misses"] or not second["hits"]:
        reason = "the second process compiled kernels the first had saved"
    elif second["digest"] != first["digest"]:
        reason = "the loaded kernels gave other bytes than the compiled ones"
    else:
        print("kernel cache probe: the cache works here")
        return 0
    print(f"kernel cache probe: {reason}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    if sys.argv[1:2] == [CHILD]:
        child()
    else:
        sys.exit(main(sys.argv[1:]))

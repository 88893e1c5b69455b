"""Time dev/gemm_pipe_dyn.py against the package's pipe on the flash prefill shapes, one GPU run:

    python -m dev.time_pipe_dyn [TOKENS]   (from the repository root)

For BF16 and Q8_0 and every shape of flashv41.bench.gemv.SHAPES, TOKENS (4096) tokens through the
package's gemm_pipe (three static stages) and through gemm_pipe_dyn with 3, 4 and 5 stages in dynamic
shared memory: the median of 20 launches after 3 warm-ups (CUDA events, the same input and weight:
the weight is read from L2 where it fits, as in every run here, so the shapes compare with each
other, not with the bench's L2-evicted rows), in us and TFLOP/s, and each result checked equal to
the package kernel's, bit for bit (the same sums in the same order: the stage count changes when
data lands, not what is added)."""

from __future__ import annotations

import sys

import numpy as np


def device_name() -> str:
    from numba import cuda
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else name


def main(tokens: int = 4096) -> None:
    from flashv41.stages.backend import select_backend

    if select_backend():
        raise SystemExit("dev.time_pipe_dyn: needs a GPU (the simulator would take hours)")
    from numba import cuda

    from dev.gemm_pipe_dyn import gemm_pipe_dyn, shared_bytes
    from flashv41.bench.engram import random_stored
    from flashv41.bench.gemv import SHAPES
    from flashv41.host.quants import GGMLType
    from flashv41.stages.gemm_pipe import gemm_pipe
    from flashv41.stages.linear import DeviceWeight

    def median_us(fn, *args, **kwargs) -> float:
        for _ in range(3):
            fn(*args, **kwargs)
        times = []
        for _ in range(20):
            start, end = cuda.event(), cuda.event()
            start.record()
            fn(*args, **kwargs)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return float(np.median(times))

    print(f"{device_name()}: {tokens} tokens; dynamic shared bytes BF16 "
          + ", ".join(f"{s}: {shared_bytes(False, s)}" for s in (3, 4, 5)) + "; Q8_0 "
          + ", ".join(f"{s}: {shared_bytes(True, s)}" for s in (3, 4, 5)))
    print(f"{'shape':<22} {'type':<5} {'pipe':>16} " + " ".join(f"{f'dyn {s}':>16}" for s in (3, 4, 5)))
    rng = np.random.default_rng(0)
    for gtype in (GGMLType.BF16, GGMLType.Q8_0):
        for name, n, k, groups in SHAPES:
            w = DeviceWeight.from_stored(name, gtype, random_stored(n, k, gtype, rng), k)
            rows = n // groups
            bits = rng.standard_normal((tokens, k * groups)).astype(np.float32).view(np.uint32) >> 16
            x = cuda.to_device(bits.astype(np.uint16))  # bf16 inputs (truncated: any bf16 values serve)
            want = cuda.device_array((tokens, n), np.uint16)
            got = cuda.device_array((tokens, n), np.uint16)
            group_rows = rows if groups > 1 else 0
            flops = 2.0 * tokens * n * k
            cells = [median_us(gemm_pipe, x, w, want, tokens, group_rows)]
            expected = want.copy_to_host()
            for stages in (3, 4, 5):
                cells.append(median_us(gemm_pipe_dyn, x, w, got, tokens, group_rows, stages=stages))
                if not np.array_equal(got.copy_to_host(), expected):
                    raise SystemExit(f"{name} {gtype.name}: {stages} stages differ from the package's pipe")
            print(f"{name:<22} {gtype.name:<5} " + " ".join(f"{us:8.1f} us {flops / us / 1e6:4.0f}T" for us in cells))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)

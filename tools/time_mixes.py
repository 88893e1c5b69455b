"""Time the hyper-connection mixes' own product on a GPU: stages.mixes_tiles against
stages.linear.stream_partials at flash size (the highway hc 4 x 5120 flattened, K = 20480; 24 mixes
and the square sum), for F32 / F16 / BF16 mix weights, at each token count. HyperStage._mix_args
launches mixes_tiles from MIXES_TILES_MIN_TOKENS tokens on and stream_partials below: these lines
are what sets that constant.

    python tools/time_mixes.py                  # T = 16, 32, 64, 128, 256, 512
    python tools/time_mixes.py 8 512 --reps 50

One line per T and type: the median device time of each kernel over --reps launches (CUDA events,
back to back: the highway stays in L2 where it fits, as after the post that wrote it), the ratio,
the time the highway takes to read once at 3.0 TB/s, and which kernel the stage picks at that T.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

HC, DIM, N_MIX = 4, 5120, 24
TOKENS = (16, 32, 64, 128, 256, 512)
HBM_BYTES_S = 3.0e12


def median_us(run, reps: int) -> float:
    from numba import cuda

    run()  # compiled and warm
    times = []
    for _ in range(reps):
        start, end = cuda.event(), cuda.event()
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end) * 1e3)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)

    from flashv41.stages.backend import select_backend

    select_backend()
    from numba import cuda

    from flashv41.host.numerics import to_bits
    from flashv41.host.quants import GGMLType
    from flashv41.stages.device import CHUNK, SIM
    from flashv41.stages.hyper import MIX_SLICE_CHUNKS, MIXES_TILES_MIN_TOKENS
    from flashv41.stages.linear import DeviceWeight, stream_partials
    from flashv41.stages.mixes_tiles import FN_TYPES, mixes_slices, mixes_tiles

    if SIM:
        print("tools/time_mixes.py times kernels on a GPU", file=sys.stderr)
        return 2
    k = HC * DIM
    most = max(args.tokens)
    rng = np.random.default_rng(1)
    x = cuda.to_device((rng.standard_normal((most, k)) * 0.3).astype(np.float32))  # [T, K]
    stream_out = cuda.device_array((most, N_MIX + 1, -(-k // (MIX_SLICE_CHUNKS * CHUNK))), np.float32)
    tiles_out = cuda.device_array((most, N_MIX + 1, mixes_slices(k)), np.float32)
    w32 = (rng.standard_normal((N_MIX, k)) * k**-0.5).astype(np.float32)
    stored = {GGMLType.F32: w32.view(np.uint8), GGMLType.F16: w32.astype(np.float16).view(np.uint8),
              GGMLType.BF16: to_bits(w32).view(np.uint8)}
    weights = {gtype: DeviceWeight.from_stored("blk.0.hc_attn_fn", gtype, stored[gtype], k) for gtype in FN_TYPES}
    print(f"flash mixes' product, K = {k}, {N_MIX} mixes + the square sum; stream_partials {stream_out.shape[2]} "
          f"slices, mixes_tiles {tiles_out.shape[2]}; MIXES_TILES_MIN_TOKENS = {MIXES_TILES_MIN_TOKENS}", flush=True)
    for t in args.tokens:
        bound_us = t * k * 4 / HBM_BYTES_S * 1e6
        for gtype, w in weights.items():
            stream_us = median_us(lambda w=w, t=t: stream_partials(x, w, stream_out, t), args.reps)
            tiles_us = median_us(lambda w=w, t=t: mixes_tiles(x, w, tiles_out, t), args.reps)
            picked = "mixes_tiles" if t >= MIXES_TILES_MIN_TOKENS else "stream_partials"
            print(f"T={t:4d} {gtype.name:5s} stream_partials {stream_us:7.1f} us | mixes_tiles {tiles_us:7.1f} us | "
                  f"{stream_us / tiles_us:4.2f}x | highway once {bound_us:5.1f} us | the stage picks {picked}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

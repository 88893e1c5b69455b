"""Benchmark rows of the decode GEMVs (PERF.md P1) at V4.1-Flash dimensions.

`gemv.<matrix>.<type>`: one token through one weight matrix of a decode step, for every shape a
step streams: the attention's wq_a, wq_b, wkv, wo_a (8 groups, one launch), wo_b, the indexer's
wq_b, and the engram's wkv. Device time (launch cost excluded, as in a replayed graph) against
bound = stored bytes / copy bandwidth; the note gives the effective bandwidth as a share of the
copy bandwidth (the P1 target: >= 75%, a ratio <= 1.33). Weights are random stored blocks of the
type: a GEMV's time does not depend on the values.
"""

from __future__ import annotations

import numpy as np

from flashv41.bench import BenchCase, BenchContext, BenchOptions, BenchRow, device_time
from flashv41.bench_engram import random_stored
from host.quants import FORMATS, GGMLType

# (name, outputs N, inputs K, groups): the flash preset's decode products
SHAPES = (("attn.wq_a", 1280, 5120, 1), ("attn.wq_b", 64 * 512, 1280, 1), ("attn.wkv", 512, 5120, 1),
          ("attn.wo_a", 8 * 1024, 64 * 512 // 8, 8), ("attn.wo_b", 5120, 8 * 1024, 1),
          ("index.wq_b", 32 * 128, 1280, 1), ("engram.wkv", 5120 * 5, 24 * 256, 1))


def time_product(ctx: BenchContext, matrix: str, n: int, k: int, groups: int, wtype: str, tokens: int,
                 hold_s: float = 0.005) -> tuple[float, str]:
    """Median device seconds of `tokens` bf16 tokens through a random [n, k] weight of `wtype`
    (`groups` groups reading their own input slices), with the kernel stages.linear picks; and
    the kernel's name."""
    from numba import cuda

    from stages.linear import DeviceWeight, linear, pick_kernel

    gtype = GGMLType[wtype]
    stream = cuda.stream()
    w = DeviceWeight.from_stored(matrix, gtype, random_stored(n, k, gtype, np.random.default_rng(n + k)), k, stream)
    rng = np.random.default_rng(1)
    x = cuda.to_device(rng.integers(0x3C00, 0x3F80, size=(tokens, groups * k), dtype=np.uint16), stream=stream)
    y = cuda.device_array((tokens, n), np.uint16, stream=stream)
    rows = n // groups if groups > 1 else 0
    o = ctx.options
    median = device_time(lambda: linear(x, w, y, tokens, group_rows=rows, stream=stream), o.reps, o.warmup, stream,
                         n=4 if tokens > 1 else 8, hold_s=hold_s)
    return median, pick_kernel(w, True, tokens)


def gemv_case(matrix: str, n: int, k: int, groups: int, wtype: str) -> BenchCase:
    name = f"gemv.{matrix}.{wtype}"

    def run(ctx: BenchContext) -> list[BenchRow]:
        median, kernel = time_product(ctx, matrix, n, k, groups, wtype, 1)
        nbytes = FORMATS[GGMLType[wtype]].row_bytes(k) * n
        share = nbytes / median / ctx.copy_bandwidth
        return [BenchRow(name, median, ctx.memory_bound(nbytes), bytes=nbytes,
                         note=f"[{n}, {k}]{f' in {groups} groups' if groups > 1 else ''}, {kernel} kernel: "
                              f"{share:.0%} of copy bandwidth")]

    return BenchCase(name, run)


def cases(options: BenchOptions) -> list[BenchCase]:
    return [gemv_case(m, n, k, g, wtype) for wtype in options.weight_types for m, n, k, g in SHAPES]

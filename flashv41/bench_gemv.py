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
from host.quants import GGMLType

# (name, outputs N, inputs K, groups): the flash preset's decode products
SHAPES = (("attn.wq_a", 1280, 5120, 1), ("attn.wq_b", 64 * 512, 1280, 1), ("attn.wkv", 512, 5120, 1),
          ("attn.wo_a", 8 * 1024, 64 * 512 // 8, 8), ("attn.wo_b", 5120, 8 * 1024, 1),
          ("index.wq_b", 32 * 128, 1280, 1), ("engram.wkv", 5120 * 5, 24 * 256, 1))


def gemv_case(matrix: str, n: int, k: int, groups: int, wtype: str) -> BenchCase:
    name = f"gemv.{matrix}.{wtype}"

    def run(ctx: BenchContext) -> list[BenchRow]:
        from numba import cuda

        from stages.linear import DeviceWeight, linear, pick_kernel

        gtype = GGMLType[wtype]
        stream = cuda.stream()
        stored = random_stored(n, k, gtype, np.random.default_rng(n + k))
        w = DeviceWeight.from_stored(matrix, gtype, stored, k, stream)
        rng = np.random.default_rng(1)
        x = cuda.to_device(rng.integers(0x3C00, 0x3F80, size=(1, groups * k), dtype=np.uint16), stream=stream)
        y = cuda.device_array((1, n), np.uint16, stream=stream)
        rows = n // groups if groups > 1 else 0
        o = ctx.options
        median = device_time(lambda: linear(x, w, y, 1, group_rows=rows, stream=stream), o.reps, o.warmup, stream)
        share = w.nbytes / median / ctx.copy_bandwidth
        return [BenchRow(name, median, ctx.memory_bound(w.nbytes), bytes=w.nbytes,
                         note=f"[{n}, {k}]{f' in {groups} groups' if groups > 1 else ''}, "
                              f"{pick_kernel(w, True, 1)} kernel: {share:.0%} of copy bandwidth")]

    return BenchCase(name, run)


def cases(options: BenchOptions) -> list[BenchCase]:
    return [gemv_case(m, n, k, g, wtype) for wtype in options.weight_types for m, n, k, g in SHAPES]

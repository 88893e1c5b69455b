"""Benchmark rows of the head (docs/performance.md H1) at V4.1-Flash dimensions.

`head.decode.<type>`: one position's logits, what `Sequence.logits()` and the step before it add to
a decode step: the head's input (stages.hyper.pre_norm_kernel: the last layer's copies collapsed
by its pre-mix, output_norm; inside the step) and the output product [129280, 5120] at one token
with fp32 logits (the kernel stages.linear picks, as HeadStage.logits runs it), device time (launch
cost excluded, as in a replayed graph; the copy of the 517 KB of logits to the host not counted).
Bound: the output matrix's stored bytes plus the highway row read once, over the copy bandwidth
(H1: <= 1.2x). The matrix is 0.7-1.3 GB, far past 4x L2: read from HBM, timed back to back on the
one weight. Weights are random stored blocks of the type (the time does not depend on the values).
"""

from __future__ import annotations

import numpy as np

from flashv41.bench.core import BenchCase, BenchContext, BenchOptions, BenchRow
from flashv41.bench.engram import random_stored
from flashv41.host.quants import FORMATS, GGMLType

VOCAB, DIM, HC = 129280, 5120, 4


def head_case(wtype: str) -> BenchCase:
    name = f"head.decode.{wtype}"

    def run(ctx: BenchContext) -> list[BenchRow]:
        from numba import cuda

        from flashv41.stages.hyper import PRE_NORM_THREADS, pre_norm_kernel
        from flashv41.stages.linear import DeviceWeight, linear, pick_kernel

        gtype = GGMLType[wtype]
        stream = cuda.stream()
        rng = np.random.default_rng(7)
        w = DeviceWeight.from_stored("output", gtype, random_stored(VOCAB, DIM, gtype, rng), DIM, stream)
        h = cuda.to_device(rng.standard_normal((1, HC, DIM)).astype(np.float32), stream=stream)
        pre = cuda.to_device(rng.uniform(0.1, 1, (1, HC)).astype(np.float32), stream=stream)
        norm = cuda.to_device(np.ones(DIM, np.float32), stream=stream)
        x = cuda.device_array((1, DIM), np.uint16, stream=stream)
        y = cuda.device_array((1, VOCAB), np.float32, stream=stream)
        norm_kernel = pre_norm_kernel(HC, -(-DIM // PRE_NORM_THREADS))

        def head() -> None:
            norm_kernel[1, PRE_NORM_THREADS, stream](h, pre, norm, x, DIM, np.float32(1e-20))
            linear(x, w, y, 1, stream=stream)

        nbytes = FORMATS[gtype].row_bytes(DIM) * VOCAB + HC * DIM * 4
        median, plan = ctx.stage_time(head, nbytes, stream)
        share = nbytes / median / ctx.copy_bandwidth
        return [BenchRow(name, median, ctx.memory_bound(nbytes), bytes=nbytes,
                         note=f"input norm + output [{VOCAB}, {DIM}] fp32 logits, {pick_kernel(w, True, 1)} kernel: "
                              f"{share:.0%} of copy bandwidth", l2=plan)]

    return BenchCase(name, run)


def cases(options: BenchOptions) -> list[BenchCase]:
    return [head_case(wtype) for wtype in options.weight_types]

"""Benchmark rows of the decode GEMVs (docs/performance.md P1) at V4.1-Flash dimensions.

`gemv.<matrix>.<type>`: one token through one weight matrix of a decode step, for every shape a
step streams: the attention's wq_a, wq_b, wkv, wo_a (8 groups, one launch), wo_b, the indexer's
wq_b, and the engram's wkv. Device time (launch cost excluded, as in a replayed graph) against
bound = stored bytes / copy bandwidth; the note gives the effective bandwidth as a share of the
copy bandwidth (the P1 target: >= 75%, a ratio <= 1.33). Weights are random stored blocks of the
type: a GEMV's time does not depend on the values.

L2: most of these weights fit in the 50 MB L2 and all but the BF16 engram wkv are under 4x L2,
so a product timed back to back on one weight would be served partly or wholly from the L2. A
row whose weight is under 4x L2 therefore makes device copies of it until they total 4x L2
(about 30 copies of the 7 MB Q8_0 wq_a, 240 of the 0.9 MB Q2_K wkv, 2 of the 167 MB Q8_0 engram
wkv) and each call reads the next copy, so a copy comes back only after three L2s' worth of
other copies went through. The input and output vectors stay the same (a few KB, in the L2 as
in a real step). The copies are freed when the row ends. The JSON's `l2` says "rotated over N
copies", or for a weight >= 4x L2 "read from HBM" (timed back to back on the one weight).
`time_product` also serves the prefill rows (flashv41.bench.prefill), which evict instead.

`gemv.t8.<matrix>.<type>`: the same product for eight tokens (a batched decode step of eight
sequences, the most tokens a decode GEMV takes), its weight rotated as a single token's.

`gemv.<other>.<matrix>.<type>` and `gemv.<other>.t8.<matrix>.<type>` (Q8_0, Q2_K, Q4_K, Q5_K,
Q6_K, MXFP4: the types stages.linear_imma takes, among those --weight-type selects): the same
product forced onto the decode kernel stages.linear does not pick for it, `imma` or `stream`
(stages.linear_imma.decode_pick), timed and bounded as the picked row beside it, so that one run
compares the two.

`gemv.floor.read_<MB>MB`: the read-only copy-bandwidth kernel alone over a buffer of that size
(rotated copies, as a weight's), the fastest a kernel that reads so many bytes has been seen to
run. A kernel's launch, ramp and drain cost a few microseconds whatever it reads, so at the sizes
of the mid-sized matrices (16-40 MB) even a pure read stays well under the copy bandwidth of the
512 MiB probe: these rows put each GEMV's share beside what a read of its size reaches.
"""

from __future__ import annotations

import numpy as np

from flashv41.bench.core import BenchCase, BenchContext, BenchOptions, BenchRow, L2Plan, device_copy
from flashv41.bench.engram import copy_weight, random_stored
from flashv41.host.quants import FORMATS, GGMLType

# (name, outputs N, inputs K, groups): the flash preset's decode products
SHAPES = (("attn.wq_a", 1280, 5120, 1), ("attn.wq_b", 64 * 512, 1280, 1), ("attn.wkv", 512, 5120, 1),
          ("attn.wo_a", 8 * 1024, 64 * 512 // 8, 8), ("attn.wo_b", 5120, 8 * 1024, 1),
          ("index.wq_b", 32 * 128, 1280, 1), ("engram.wkv", 5120 * 5, 24 * 256, 1))


def time_product(ctx: BenchContext, matrix: str, n: int, k: int, groups: int, wtype: str, tokens: int,
                 hold_s: float = 0.005, kernel: str = "") -> tuple[float, str, L2Plan]:
    """Median device seconds of `tokens` bf16 tokens through a random [n, k] weight of `wtype`
    (`groups` groups reading their own input slices), with `kernel` (stages.linear's names) or the
    kernel stages.linear picks; the kernel's name; and what was done about the L2. One token (a
    decode GEMV reads its weight once): copies of the weight rotated (each run once before the
    timing: imma's first launch on a weight allocates its workspace), as for up to DECODE_TOKENS
    tokens (a batched decode step's product, which reads its weight once too). More (a prefill
    GEMM, which reuses its tiles from the L2 by design): the L2 evicted between repetitions if
    weight, input and output fit."""
    from numba import cuda

    from flashv41.stages.linear import DeviceWeight, linear, pick_kernel

    gtype = GGMLType[wtype]
    stream = cuda.stream()
    w = DeviceWeight.from_stored(matrix, gtype, random_stored(n, k, gtype, np.random.default_rng(n + k)), k, stream)
    rng = np.random.default_rng(1)
    x = cuda.to_device(rng.integers(0x3C00, 0x3F80, size=(tokens, groups * k), dtype=np.uint16), stream=stream)
    y = cuda.device_array((tokens, n), np.uint16, stream=stream)
    rows = n // groups if groups > 1 else 0

    def product(weight: DeviceWeight) -> None:
        linear(x, weight, y, tokens, group_rows=rows, stream=stream, kernel=kernel)

    queued = 4 if tokens > 1 else 8
    if tokens <= DECODE_TOKENS:
        median, plan = ctx.rotated_time(w, lambda v: copy_weight(v, stream), product, w.nbytes, stream, n=queued,
                                        hold_s=hold_s, prepare=product)
    else:
        median, plan = ctx.stage_time(lambda: product(w), w.nbytes + x.nbytes + y.nbytes, stream, n=queued,
                                      hold_s=hold_s)
    return median, kernel or pick_kernel(w, True, tokens), plan


def gemv_case(matrix: str, n: int, k: int, groups: int, wtype: str, forced: str = "", tokens: int = 1) -> BenchCase:
    """The row of `tokens` tokens through the matrix: `gemv.<matrix>.<type>` (one token) or
    `gemv.t<tokens>.<matrix>.<type>` with the kernel stages.linear picks, or the same names with
    `<forced>.` after `gemv.` with that kernel forced."""
    name = f"gemv.{forced + '.' if forced else ''}{f't{tokens}.' if tokens > 1 else ''}{matrix}.{wtype}"

    def run(ctx: BenchContext) -> list[BenchRow]:
        median, kernel, plan = time_product(ctx, matrix, n, k, groups, wtype, tokens, kernel=forced)
        nbytes = FORMATS[GGMLType[wtype]].row_bytes(k) * n
        share = nbytes / median / ctx.copy_bandwidth
        return [BenchRow(name, median, ctx.memory_bound(nbytes), bytes=nbytes,
                         note=f"[{n}, {k}]{f' in {groups} groups' if groups > 1 else ''}, {kernel} kernel: "
                              f"{share:.0%} of copy bandwidth", l2=plan)]

    return BenchCase(name, run)


FLOOR_MB = (4, 16, 24, 32, 64, 128)  # read sizes of the floor rows, MiB
DECODE_TOKENS = 8  # the largest batch whose products are decode GEMVs (stages.linear.GEMV_MAX_TOKENS)


def floor_case(mb: int) -> BenchCase:
    name = f"gemv.floor.read_{mb}MB"

    def run(ctx: BenchContext) -> list[BenchRow]:
        from numba import cuda

        from flashv41.stages.bandwidth import read_words, words_buffer

        stream = cuda.stream()
        nbytes = mb << 20
        buffer = words_buffer(nbytes, stream)
        sink = cuda.device_array(1, np.uint32, stream=stream)
        median, plan = ctx.rotated_time(buffer, lambda b: device_copy(b, stream),
                                        lambda b: read_words(b, sink, stream), nbytes, stream)
        share = nbytes / median / ctx.copy_bandwidth
        return [BenchRow(name, median, ctx.memory_bound(nbytes), bytes=nbytes,
                         note=f"read kernel alone: {share:.0%} of copy bandwidth", l2=plan)]

    return BenchCase(name, run)


def cases(options: BenchOptions) -> list[BenchCase]:
    from flashv41.stages.linear_imma import IMMA_TYPES, decode_pick

    picked = [gemv_case(m, n, k, g, wtype, tokens=t) for t in (1, DECODE_TOKENS) for wtype in options.weight_types
              for m, n, k, g in SHAPES]
    others = [gemv_case(m, n, k, g, wtype, "stream" if decode_pick(GGMLType[wtype], n, k) else "imma", t)
              for t in (1, DECODE_TOKENS) for wtype in options.weight_types if GGMLType[wtype] in IMMA_TYPES
              for m, n, k, g in SHAPES]
    return [floor_case(mb) for mb in FLOOR_MB] + picked + others

"""Hyper-connection glue on the device: the token embedding, the mixes each sublayer derives from
the highway (with Sinkhorn), the collapse into a normed sublayer input, and the expansion back.

Shapes: T tokens, hc copies, C dim, M = (2 + hc) * hc mixes. The highway h is float32
[T, hc, C] (kept in fp32 on the device); sublayer inputs and outputs are bf16 bits.

- `embed`: h[t, c] = bf16(dequant(token_embd[id_t])) for every copy c (coalesced stores).
- `mixes`: raw = h_flat @ fn^T and the square sum of h_flat, in fp32 partial sums over slices of
  the flattened highway [T, M + 1, S] (stages.linear.stream_partials: the decode GEMV's walk; from
  MIXES_TILES_MIN_TOKENS tokens stages.mixes_tiles, tiles of tokens that read the highway once, with
  fewer slices; or the post kernel's, below), then per token r = rsqrt(mean(h^2) + eps),
  pre = sigmoid(raw * r * s0 + b) + hc_eps, post = 2 sigmoid(raw * r * s1 + b), comb = Sinkhorn
  (one warp, shuffles, no barrier).
- `mixes_norm`: a sublayer's mixes and its input x = norm(bf16(sum_c pre[c] h[c])) in bf16 in one
  block per token: the attention's (attn_norm; pre the layer before's FFN mix), or, where an FFN
  callback runs (flashv41.ffn), the FFN's (ffn_norm; pre this layer's attention mix, as the
  reference's Block.forward collapses it).
- `post_mix`: h[c] = post[c] * a + sum_k comb[k, c] h[k], in place; a = None is a zero sublayer.
  With the next sublayer's mixes named (F32 / F16 / BF16 fn: `fuses`) and T <= POST_PRODUCT_MAX_TOKENS,
  the same launch also forms their product from the new h, [T, M + 1, S'] by d-ranges of
  POST_SLICE over as many blocks (past that T the mixes launch their own product as without it).
- `mixes_post`: a zero-output (FFN) sublayer between two such posts in one launch: each post
  block sums the slices and runs the Sinkhorn itself, then the post and the next product (not
  where an FFN callback gives the sublayer an output: `plan(zero_ffn=False)`).

What one call hands the next is a value, not state left in the stage: a sublayer's `Mixes` names
where its mixes write pre, post and comb (which its post_mix then reads) and where the post before
forms its product, if one does; a post is given the next sublayer's `Mixes` (`then`) to form that
product. `HyperStage.plan` decides once, from the layer list, which posts form which products, and
returns every layer's values (`HyperLayer`) for the engine's plan.

Oracle: host.oracle.hc (hc_mixes / sinkhorn_split, hc_pre, hc_post), host.numerics.rms_norm,
host.oracle.Oracle.embed. Sums run in fp32 here (float64 there); transcendentals are CUDA's.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from functools import cache

import numpy as np
from numba import cuda, float32, int32

from flashv41.host.errors import UnsupportedError
from flashv41.host.quants import GGMLType
from flashv41.stages.device import (
    CHUNK,
    SIM,
    WARP,
    DeviceArray,
    bf16_round,
    bf16_to_f32,
    device,
    f32_to_bf16,
    jit_kernel,
    warp_sum,
)
from flashv41.stages.linear import GEMV_MAX_TOKENS, DeviceWeight, stream_partials
from flashv41.stages.mixes_tiles import FN_TYPES as TILE_TYPES
from flashv41.stages.mixes_tiles import mixes_tiles
from flashv41.stages.trace import Traced

MAX_HC = 4
MAX_MIX = (2 + MAX_HC) * MAX_HC
MIX_ROWS = MAX_MIX + 1  # the mixes and the highway's square sum
PRE_NORM_THREADS = 4 if SIM else 1024  # threads per token of pre_norm (a power of two: the reduction halves it)
LANES = 1 if SIM else WARP
POST_SLICE = 32  # d values of each copy a block of the post-and-product kernel takes
POST_WARPS = 2 if SIM else 8  # that block's warps, each a share of the product's rows
# the most tokens a post forms the next product for: past them each block re-reading its weights
# costs more than stream_partials' one read per GEMV_MAX_TOKENS tokens (and mixes_post's Sinkhorn
# in every block more than one block a token); up to them a token's bits do not depend on T
POST_PRODUCT_MAX_TOKENS = GEMV_MAX_TOKENS
# the fewest tokens whose mixes' own product mixes_tiles forms (F32 / F16 / BF16 fn; stream_partials
# below them). Provisional: the one measurement is T = 512 (H100, 2026-12-07: 169-180 us against
# stream_partials' 300-340); the next GPU run times T = 16 .. 512 (tools/time_mixes.py) to set it
MIXES_TILES_MIN_TOKENS = 64
MIX_SLICE_CHUNKS = 8  # chunks of the flattened highway per partial sum (a slice of the product)
MIXES_THREADS = 1 if SIM else 256  # the FFN mixes' block: the simulator pays dearly for barriers
EMBED_THREADS = 4 if SIM else 128  # chunks an embedding block dequantises (4,096 values on the GPU;
# the simulator: two blocks of the small preset's rows)
EMBED_PITCH = CHUNK + 1  # a chunk's values in shared memory, one word of padding: no bank conflicts
EMBED_SHARED = EMBED_THREADS * EMBED_PITCH  # (a constant for cuda.shared.array: a product is not one)


@device
def _block_sum(v, scratch):
    """Sum of v over the block's threads (a power of two), returned to every thread."""
    tid = cuda.threadIdx.x
    scratch[tid] = v
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            scratch[tid] += scratch[tid + stride]
        cuda.syncthreads()
        stride //= 2
    total = scratch[0]
    cuda.syncthreads()
    return total


if SIM:
    @device
    def _sync():
        """The mixes kernels' barrier: the simulator runs some in one-thread blocks, where a barrier
        is a no-op that still costs, so it is skipped there."""
        if cuda.blockDim.x * cuda.blockDim.y > 1:
            cuda.syncthreads()

    @device
    def _cell(m, cell):
        """Cell `cell` of the Sinkhorn matrix: the simulator's one-lane warp holds them all."""
        return m[cell]
else:
    @device
    def _sync():
        cuda.syncthreads()

    @device
    def _cell(m, cell):
        """Cell `cell` of the Sinkhorn matrix, from lane `cell`, which holds it in m[0]."""
        return cuda.shfl_sync(0xFFFFFFFF, m[0], cell)


@device
def _sigmoid(x):
    return float32(1) / (float32(1) + math.exp(-x))


@cache
def split_sinkhorn(hc: int):
    """A device function for one warp: pre, post and comb of token t from its summed mixes `raw`
    and r = rsqrt(mean(h^2) + eps). Lane l holds cell l % hc^2 of the matrix (the simulator's one
    lane all of them, `slots` a lane) and reads a line's other cells from their lanes by shuffles:
    no barrier in the Sinkhorn loop. Each phase reads its cells before any is written (a shuffle
    is synchronous; the simulator's slots loop reads them all first), and every sum runs in the
    cells' index order, as the block-wide walk did: the same bits as hc_mixes' loop in fp32."""
    cells = hc * hc
    slots = cells if LANES == 1 else 1

    @device
    def line_sums(m, sums, rows, eps):
        """sums[i] = eps + the sum over j of slot i's row (rows) or column, in j order."""
        lane = cuda.threadIdx.x % LANES
        for i in range(slots):
            cell = (lane + i * LANES) % cells
            line = cell // hc if rows else cell % hc
            s = float32(0)
            for j in range(hc):
                s += _cell(m, line * hc + j) if rows else _cell(m, j * hc + line)
            sums[i] = s + eps

    @device
    def split(raw, r, scale, base, pre, post, comb, t, iters, hc_eps):
        lane = cuda.threadIdx.x % LANES
        for c in range(lane, hc, LANES):
            pre[t, c] = _sigmoid(raw[c] * r * scale[0] + base[c]) + hc_eps
            post[t, c] = float32(2) * _sigmoid(raw[hc + c] * r * scale[1] + base[hc + c])
        m = cuda.local.array(slots, float32)
        sums = cuda.local.array(slots, float32)
        for i in range(slots):
            cell = (lane + i * LANES) % cells
            m[i] = raw[2 * hc + cell] * r * scale[2] + base[2 * hc + cell]
        for i in range(slots):  # row softmax: the row's max, exp, the row's sum
            k = (lane + i * LANES) % cells // hc
            row_max = float32(-math.inf)
            for c in range(hc):
                row_max = max(row_max, _cell(m, k * hc + c))
            sums[i] = row_max
        for i in range(slots):
            m[i] = math.exp(m[i] - sums[i])
        line_sums(m, sums, True, float32(0))
        for i in range(slots):
            m[i] = m[i] / sums[i] + hc_eps
        for it in range(iters):
            if it > 0:
                line_sums(m, sums, True, hc_eps)
                for i in range(slots):
                    m[i] = m[i] / sums[i]
            line_sums(m, sums, False, hc_eps)
            for i in range(slots):
                m[i] = m[i] / sums[i]
        for i in range(slots):
            cell = lane + i * LANES
            if cell < cells:
                comb[t, cell // hc, cell % hc] = m[i]

    return split


@cache
def mix_sums(n_mix: int, threads: int):
    """A device function for the block of token t (`threads` threads, x fastest): raw[row] = the sum
    of partial[t, row, :n_slices] for the n_mix + 1 rows (one warp a row, its lanes strided over
    the slices), then a barrier."""
    warps = threads // LANES

    @device
    def sums(partial, raw, t, n_slices, scratch):
        tid = cuda.threadIdx.x + cuda.threadIdx.y * cuda.blockDim.x
        lane = tid % LANES
        warp = tid // LANES
        for first in range(0, n_mix + 1, warps):  # a uniform walk: every thread meets warp_sum's barriers
            row = first + warp
            v = float32(0)
            if row <= n_mix:
                for s in range(lane, n_slices, LANES):
                    v += partial[t, row, s]
            total = warp_sum(v, scratch) if LANES > 1 else v
            if row <= n_mix and lane == 0:
                raw[row] = total
        _sync()

    return sums


@cache
def collapse_norm(hc: int, per_thread: int):
    """A device function for the block of PRE_NORM_THREADS threads of token t, per_thread values of
    the row each (their loads issued together, the mixed values kept for the second pass):
    y = bf16(sum_c pre[c] h[c]); out = bf16(w * (y * rsqrt(mean(y^2) + eps))). A walk that loads,
    adds and loads again waits on each load in turn: that cost a one-token step about 20 us here."""
    threads = PRE_NORM_THREADS

    @device
    def norm(h, pre, weight, out, t, dim, eps, scratch):
        tid = cuda.threadIdx.x
        mix = cuda.local.array(hc, float32)
        ys = cuda.local.array(per_thread, float32)
        for c in range(hc):
            mix[c] = pre[t, c]
        ss = float32(0)
        for i in range(per_thread):
            d = tid + i * threads
            y = float32(0)
            if d < dim:
                for c in range(hc):
                    y += mix[c] * h[t, c, d]
                y = bf16_round(y)
            ys[i] = y
            ss += y * y
        total = _block_sum(ss, scratch)
        r = float32(1) / math.sqrt(total / float32(dim) + eps)
        for i in range(per_thread):
            d = tid + i * threads
            if d < dim:
                out[t, d] = f32_to_bf16(weight[d] * (ys[i] * r))

    return norm


@cache
def mixes_kernel(hc: int):
    """One block of MIXES_THREADS threads per token: the slices' partial products summed (one warp
    a row), then warp 0 runs the split and Sinkhorn (split_sinkhorn). hc and the block size are
    compiled in: a loop over a run-time stride, or an index divided by a run-time hc, costs a
    64-bit division each (about a hundred instructions), and the Sinkhorn loop is made of little
    else."""
    n_mix = (2 + hc) * hc
    sums = mix_sums(n_mix, MIXES_THREADS)
    split = split_sinkhorn(hc)

    @jit_kernel()
    def kernel(partial, scale, base, pre, post, comb, n_slices, width, iters, norm_eps, hc_eps):
        raw = cuda.shared.array(MIX_ROWS, float32)
        scratch = cuda.shared.array(MIXES_THREADS, float32)
        t = cuda.blockIdx.x
        sums(partial, raw, t, n_slices, scratch)
        r = float32(1) / math.sqrt(raw[n_mix] / float32(width) + norm_eps)
        if cuda.threadIdx.x < LANES:
            split(raw, r, scale, base, pre, post, comb, t, iters, hc_eps)

    return kernel


@cache
def mixes_norm_kernel(hc: int, per_thread: int):
    """The attention sublayer's mixes and its input in one block of PRE_NORM_THREADS threads per
    token: the slices summed (as mixes_kernel), x = attn_norm(hc_pre(h, pre_in)) (collapse_norm;
    pre_in is the mix the layer before wrote), then warp 0 runs the split and Sinkhorn. Each part's
    arithmetic is the one its kernel ran alone: the same bits as mixes_kernel then the collapse."""
    n_mix = (2 + hc) * hc
    sums = mix_sums(n_mix, PRE_NORM_THREADS)
    norm = collapse_norm(hc, per_thread)
    split = split_sinkhorn(hc)

    @jit_kernel()
    def kernel(partial, scale, base, pre, post, comb, n_slices, width, iters, norm_eps, hc_eps,
               h, pre_in, weight, x, dim):
        raw = cuda.shared.array(MIX_ROWS, float32)
        scratch = cuda.shared.array(PRE_NORM_THREADS, float32)
        t = cuda.blockIdx.x
        sums(partial, raw, t, n_slices, scratch)
        norm(h, pre_in, weight, x, t, dim, norm_eps, scratch)
        r = float32(1) / math.sqrt(raw[n_mix] / float32(width) + norm_eps)
        if cuda.threadIdx.x < LANES:
            split(raw, r, scale, base, pre, post, comb, t, iters, hc_eps)

    return kernel


@cache
def pre_norm_kernel(hc: int, per_thread: int):
    """x[t] = norm(bf16(sum_c pre[t, c] h[t, c])) alone (collapse_norm), one block of PRE_NORM_THREADS
    per token: the head's input (stages.head), which has no mixes of its own. (Here, beside the
    device function it runs, because the simulator gives a kernel's own module its CUDA names.)"""
    norm = collapse_norm(hc, per_thread)

    @jit_kernel()
    def kernel(h, pre, weight, x, dim, eps):
        scratch = cuda.shared.array(PRE_NORM_THREADS, float32)
        norm(h, pre, weight, x, cuda.blockIdx.x, dim, eps, scratch)

    return kernel


@device
def _post_values(h, a, post, comb, t, m, d, hc, has_output, out, o):
    """out[o + c] = post[m, c] * a[t, d] + sum_k comb[m, k, c] h[t, k, d] for every copy c (h's
    values before any is written; m: token t's row of post and comb)."""
    old = cuda.local.array(MAX_HC, float32)
    for k in range(hc):
        old[k] = h[t, k, d]
    av = bf16_to_f32(a[t, d]) if has_output else float32(0)
    for c in range(hc):
        s = float32(0)
        for k in range(hc):
            s += comb[m, k, c] * old[k]
        out[o + c] = post[m, c] * av + s if has_output else s


@jit_kernel()
def _post_kernel(h, a, post, comb, hc, dim, has_output):
    """h[t, c, d] = post[c] * a[t, d] + sum_k comb[k, c] h[t, k, d], in place (one thread per d)."""
    t = cuda.blockIdx.y
    d = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if d >= dim:
        return
    new = cuda.local.array(MAX_HC, float32)
    _post_values(h, a, post, comb, t, t, d, hc, has_output, new, 0)
    for c in range(hc):
        h[t, c, d] = new[c]


@device
def _as_f32(v):
    return float32(v)


# the mix weight types the post kernel reads value by value: the view of a row's bytes, its decode
FN_READERS = {GGMLType.F32: (np.float32, _as_f32), GGMLType.F16: (np.float16, _as_f32),
              GGMLType.BF16: (np.uint16, bf16_to_f32)}


@cache
def post_product_kernel(hc: int, gtype: GGMLType, split: bool):
    """hc_post fused with the next sublayer's mixes product: block (s, t) of (LANES, POST_WARPS)
    threads takes d = POST_SLICE s .. POST_SLICE (s + 1) - 1 of token t (one d a lane on the GPU;
    the simulator's one lane all of them); every warp forms the new h[t, :, d] (_post_values, the
    arithmetic of _post_kernel: the same bits), warp 0 writes them after a barrier (the update is in
    place), and warp w adds up rows w, w + POST_WARPS, ... of the product of the values against fn
    [M, hc C] (row M: their squares) into partial[t, row, s], its weights loaded before the highway.
    The mixes' slices are then the d-ranges of every copy together: another fp32 order than
    stream_partials' runs of the flattened highway, within the same bounds.
    split: the post's own mixes too (a zero-output sublayer's, whose post and comb nothing else
    reads): each block sums partial_in's n_slices slices of token t (mix_sums) and warp 0 runs the
    split and Sinkhorn (split_sinkhorn) into shared memory, the same bits in every block and as
    mixes_kernel gives them; block 0 writes pre. Without split, partial_in .. pre are not read."""
    n_mix = (2 + hc) * hc
    per_lane = POST_SLICE // LANES
    rows = -(-(n_mix + 1) // POST_WARPS)  # rows a warp adds up, at most
    view, value = FN_READERS[gtype]
    values = per_lane * MAX_HC  # a lane's new highway values
    weights = rows * values  # and the weights they meet
    threads = LANES * POST_WARPS
    sums = mix_sums(n_mix, threads)
    split_mixes = split_sinkhorn(hc)

    @jit_kernel()
    def kernel(h, a, post, comb, fn, partial, dim, has_output, partial_in, n_slices, scale, base, pre, iters,
               norm_eps, hc_eps):
        t = cuda.blockIdx.y
        s = cuda.blockIdx.x
        lane = cuda.threadIdx.x
        warp = cuda.threadIdx.y
        wv = fn.view(view)
        w = cuda.local.array(weights, float32)
        new = cuda.local.array(values, float32)
        for i in range(rows):
            row = warp + i * POST_WARPS
            for j in range(per_lane):
                d = s * POST_SLICE + j * LANES + lane
                for c in range(hc):
                    w[(i * per_lane + j) * MAX_HC + c] = value(wv[row, c * dim + d]) if row < n_mix and d < dim \
                        else float32(0)
        own_pre = cuda.shared.array((1, MAX_HC), float32)
        own_post = cuda.shared.array((1, MAX_HC), float32)
        own_comb = cuda.shared.array((1, MAX_HC, MAX_HC), float32)
        if split:
            raw = cuda.shared.array(MIX_ROWS, float32)
            scratch = cuda.shared.array(threads, float32)
            sums(partial_in, raw, t, n_slices, scratch)
            if warp == 0:
                r = float32(1) / math.sqrt(raw[n_mix] / float32(hc * dim) + norm_eps)
                split_mixes(raw, r, scale, base, own_pre, own_post, own_comb, 0, iters, hc_eps)
                if s == 0:
                    for c in range(lane, hc, LANES):
                        pre[t, c] = own_pre[0, c]
            cuda.syncthreads()
        for j in range(per_lane):
            d = s * POST_SLICE + j * LANES + lane
            if d < dim and split:
                _post_values(h, a, own_post, own_comb, t, 0, d, hc, has_output, new, j * MAX_HC)
            elif d < dim:
                _post_values(h, a, post, comb, t, t, d, hc, has_output, new, j * MAX_HC)
            else:
                for c in range(hc):
                    new[j * MAX_HC + c] = float32(0)
        cuda.syncthreads()  # every warp has read the old values
        if warp == 0:
            for j in range(per_lane):
                d = s * POST_SLICE + j * LANES + lane
                if d < dim:
                    for c in range(hc):
                        h[t, c, d] = new[j * MAX_HC + c]
        for i in range(rows):
            row = warp + i * POST_WARPS
            acc = float32(0)
            for j in range(per_lane):
                for c in range(hc):
                    v = new[j * MAX_HC + c]
                    acc += v * (v if row == n_mix else w[(i * per_lane + j) * MAX_HC + c])
            total = warp_sum(acc, new) if LANES > 1 else acc  # (shuffles: no scratch)
            if lane == 0 and row <= n_mix:
                partial[t, row, s] = total

    return kernel


@cache
def embed_kernel(dequant):
    """h[t, c, :] = bf16(dequant(table[ids[t]])) for every copy c; grid (ceil(chunks / EMBED_THREADS),
    T), block EMBED_THREADS. Each thread dequantises one 32-value chunk into shared memory,
    bf16-rounded; then the block writes its values with consecutive threads on consecutive values,
    one 128-byte line a warp's store in each copy. (A thread writing its own chunk into each copy
    made a warp's store touch 32 lines 128 bytes apart: H100, 2026-12-07, 512 tokens of the flash
    preset took 460 us that way and 116 us this way, the same bits.)"""

    @jit_kernel((EMBED_THREADS, 1))
    def embed(ids, table, h, n_tokens, hc, chunks):
        t = cuda.blockIdx.y
        first = cuda.blockIdx.x * EMBED_THREADS
        tid = cuda.threadIdx.x
        vals = cuda.shared.array(EMBED_SHARED, float32)
        buf = cuda.local.array(CHUNK, float32)
        if t < n_tokens and first + tid < chunks:
            dequant(table, int32(ids[t]), first + tid, buf)
            for i in range(CHUNK):
                vals[tid * EMBED_PITCH + i] = bf16_round(buf[i])
        cuda.syncthreads()
        if t < n_tokens:
            n = min(EMBED_THREADS, chunks - first) * CHUNK
            base = first * CHUNK
            for j in range(tid, n, EMBED_THREADS):
                v = vals[(j // CHUNK) * EMBED_PITCH + j % CHUNK]
                for c in range(hc):
                    h[t, c, base + j] = v

    return embed


@dataclass(frozen=True, eq=False)
class Mixes:
    """One sublayer's mixes as the calls hand them on: where its `mixes` (or `mixes_norm`) writes
    pre, post and comb, which its `post_mix` reads; and where the post before it forms its product,
    if one does (a post forming it is given this value as `then`). The buffers hold up to
    max_tokens tokens."""

    layer: int
    kind: str  # "attn" or "ffn": the sublayer, whose hc_{kind}_fn, _scale and _base it reads
    pre: DeviceArray  # [T, hc] fp32 (an FFN's: the next layer's attention collapse weights)
    post: DeviceArray  # [T, hc] fp32
    comb: DeviceArray  # [T, hc(k), hc(c)] fp32
    # [T, M + 1, S'] fp32: the product's partial sums as the post before forms them, for up to
    # POST_PRODUCT_MAX_TOKENS tokens (past them the mixes launch their own); None: no post
    # forms them (the first attention mixes, an engram layer's, an fn type FN_READERS lacks)
    product: DeviceArray | None


@dataclass(frozen=True, eq=False)
class HyperLayer:
    """One layer's hyper-connection calls, decided once (HyperStage.plan): the attention sublayer's
    mixes with its collapse of h by `pre_in`, its post, then the FFN sublayer's mixes and post."""

    pre_in: DeviceArray  # [T, hc] fp32: the mix the layer before's FFN wrote (layer 0: the caller's one-hot)
    attn: Mixes
    attn_then: Mixes | None  # `ffn` when the attention's post forms its product, else None
    ffn: Mixes
    ffn_then: Mixes | None  # the next layer's attention mixes when the FFN's post forms their product
    ffn_in_one: bool  # the FFN's mixes, its post and ffn_then's product in one launch (mixes_post)


class HyperStage(Traced):
    """The hc weights of every layer and the embedding table on the device, plus the mix buffers
    (pre, post, comb, the products' partial sums) and the token ids for up to `max_tokens` tokens.
    The highway and the sublayer buffers belong to the caller. Its one part (Traced): "hc mixes
    product", the mixes' product where it is a launch of its own."""

    def __init__(self, model, max_tokens: int, stream=0):
        cfg = model.config
        if not 1 <= cfg.hc <= MAX_HC:
            raise UnsupportedError(f"hyper-connections: hc = {cfg.hc}, supported 1..{MAX_HC}")
        self.cfg = cfg
        self.max_tokens = max_tokens
        self.stream = stream
        self.embedding = DeviceWeight.from_ref(model.tensor(None, "token_embd"), stream)
        self.layers = []
        for i in range(cfg.n_layers):
            per = {}
            for kind in ("attn", "ffn"):
                per[kind] = (
                    DeviceWeight.from_ref(model.tensor(i, f"hc_{kind}_fn"), stream),
                    cuda.to_device(model.tensor(i, f"hc_{kind}_scale").dequantize(), stream=stream),
                    cuda.to_device(model.tensor(i, f"hc_{kind}_base").dequantize(), stream=stream),
                )
            per["attn_norm"] = cuda.to_device(model.tensor(i, "attn_norm").dequantize(), stream=stream)
            if cfg.ffn_norm:  # an FFN callback's input is normed with it
                per["ffn_norm"] = cuda.to_device(model.tensor(i, "ffn_norm").dequantize(), stream=stream)
            self.layers.append(per)
        hc = cfg.hc
        self.n_slices = -(-cfg.hc * cfg.dim // (MIX_SLICE_CHUNKS * CHUNK))
        # [T, M+1, S], S stream_partials' slices of MIX_SLICE_CHUNKS chunks (mixes_tiles fills fewer)
        self.partial = cuda.device_array((max_tokens, cfg.mix_hc + 1, self.n_slices), np.float32)
        # by the sublayer kind whose mixes read it: [T, M+1, S'], S' the post kernel's d-ranges of POST_SLICE
        self.post_partial = {kind: cuda.device_array((max_tokens, cfg.mix_hc + 1, -(-cfg.dim // POST_SLICE)),
                                                     np.float32) for kind in ("attn", "ffn")}
        self.post = cuda.device_array((max_tokens, hc), np.float32)  # [T, hc]
        self.comb = cuda.device_array((max_tokens, hc, hc), np.float32)  # [T, hc(k), hc(c)]
        # [T, hc] each: the attention sublayer reads the mix the FFN before wrote (layer 0: the
        # one-hot, upload_first_mix), so two buffers alternate; its own mixes' pre goes to the third
        self.pre = [cuda.device_array((max_tokens, hc), np.float32) for _ in range(3)]
        self._one_hot = np.zeros((max_tokens, hc), np.float32)
        self._one_hot[:, 0] = 1
        self.ids = cuda.device_array(max_tokens, np.int64)  # [T] the token ids as host.tokens.Tokens holds them
        self.no_output = cuda.device_array((1, 1), np.uint16)  # stands in for `a` of a zero sublayer

    def embed(self, token_ids: np.ndarray, h, n_tokens: int) -> None:
        """Write the embedded tokens into every copy of h [>= T, hc, C]."""
        self.upload_ids(np.asarray(token_ids, np.int64), n_tokens)
        self.embed_uploaded(h, n_tokens)

    def upload_ids(self, token_ids: np.ndarray, n_tokens: int) -> None:
        """The host's part of `embed`: the checked token ids int64 [T] (host.tokens.Tokens.ids)
        into the stage's id buffer, as they are."""
        self.ids[:n_tokens].copy_to_device(token_ids, stream=self.stream)

    def embed_uploaded(self, h, n_tokens: int) -> None:
        """The device part of `embed`, from the uploaded ids."""
        chunks = self.cfg.dim // CHUNK
        grid = ((chunks + EMBED_THREADS - 1) // EMBED_THREADS, n_tokens)
        embed_kernel(self.embedding.dequant)[grid, EMBED_THREADS, self.stream](
            self.ids, self.embedding.data, h, n_tokens, self.cfg.hc, chunks)

    def upload_first_mix(self, n_tokens: int) -> None:
        """The first layer's attention collapse weights: one-hot on copy 0 (SPEC 2), into the
        buffer plan()'s first layer reads as pre_in (every call: later layers overwrite it)."""
        self.pre[0][:n_tokens].copy_to_device(self._one_hot[:n_tokens], stream=self.stream)

    def fuses(self, layer: int, kind: str) -> bool:
        """Whether post_mix can form the product of sublayer `kind`'s mixes (its fn type is one the
        post kernel reads: FN_READERS); else `mixes` launches stream_partials for it."""
        return self.layers[layer][kind][0].gtype in FN_READERS

    def sublayer(self, layer: int, kind: str, pre, after_post: bool = False) -> Mixes:
        """The Mixes of sublayer `kind` of `layer` with its pre in the caller's buffer [T, hc] and
        the stage's post and comb; after_post: the post before forms its product (only where
        `fuses` says the post kernel can)."""
        if after_post and not self.fuses(layer, kind):
            raise UnsupportedError(f"layer {layer} {kind}: the post kernel cannot form the product of "
                                   f"{self.layers[layer][kind][0].gtype.name} mixes")
        return Mixes(layer, kind, pre, self.post, self.comb, self.post_partial[kind] if after_post else None)

    def plan(self, engram_layers: Collection[int], zero_ffn: bool = True) -> tuple[HyperLayer, ...]:
        """Every layer's hyper-connection calls, in order, decided once. A post forms the next
        mixes' product where the post kernel reads their fn type (`fuses`) and nothing runs between
        the two: not for the first layer's attention mixes (the embedding comes before them), nor
        an engram layer's (its gate does). An FFN sublayer whose mixes were formed by the post
        before and whose post forms the next is one launch (ffn_in_one), where its output is zero
        (zero_ffn; an FFN callback's sublayer runs mixes_norm, the callback and post_mix)."""
        n = self.cfg.n_layers
        pre_in, pre_out, unused = self.pre
        attn = [self.sublayer(i, "attn", unused, i > 0 and i not in engram_layers and self.fuses(i, "attn"))
                for i in range(n)]
        layers = []
        for i in range(n):
            ffn = self.sublayer(i, "ffn", pre_out, self.fuses(i, "ffn"))
            ffn_then = attn[i + 1] if i + 1 < n and attn[i + 1].product is not None else None
            layers.append(HyperLayer(pre_in, attn[i], ffn if ffn.product is not None else None, ffn, ffn_then,
                                     zero_ffn and ffn.product is not None and ffn_then is not None))
            pre_in, pre_out = pre_out, pre_in
        return tuple(layers)

    def _mix_args(self, m: Mixes, h, n_tokens: int) -> tuple:
        """The product's partial sums for the mixes of `m` and the mixes kernels' first arguments,
        n_slices the slices that product has: the post before's where it formed them, else a launch
        into self.partial, mixes_tiles' from MIXES_TILES_MIN_TOKENS tokens (the fn types it reads:
        fewer slices than the buffer holds), else stream_partials' (all self.n_slices)."""
        fn, scale, base = self.layers[m.layer][m.kind]
        if m.product is not None and n_tokens <= POST_PRODUCT_MAX_TOKENS:
            return m.product, m.product.shape[2], scale, base
        x = h.reshape(h.shape[0], self.cfg.hc * self.cfg.dim)  # [T, hc C]
        if n_tokens >= MIXES_TILES_MIN_TOKENS and fn.gtype in TILE_TYPES:
            n_slices = mixes_tiles(x, fn, self.partial, n_tokens, self.stream)
        else:
            stream_partials(x, fn, self.partial, n_tokens, self.stream)
            n_slices = self.n_slices
        self._mark("hc mixes product")
        return self.partial, n_slices, scale, base

    def mixes(self, h, m: Mixes, n_tokens: int) -> Mixes:
        """m.pre, m.post and m.comb from h for m's sublayer, returned as `m` for its post: the
        product and the highway's square sum by slices (_mix_args: stream_partials', mixes_tiles' or
        the post before's), then one block per token adds the slices up and runs the split and Sinkhorn."""
        cfg = self.cfg
        partial, n_slices, scale, base = self._mix_args(m, h, n_tokens)
        mixes_kernel(cfg.hc)[n_tokens, MIXES_THREADS, self.stream](
            partial, scale, base, m.pre, m.post, m.comb, n_slices,
            cfg.hc * cfg.dim, cfg.sinkhorn_iters, np.float32(cfg.norm_eps), np.float32(cfg.hc_eps))
        return m

    def mixes_norm(self, h, m: Mixes, pre_in, x, n_tokens: int) -> Mixes:
        """Sublayer m's `mixes` (m, returned for its post) and its input x [T, C] bf16 =
        norm(hc_pre(h, pre_in)), the sublayer's norm (attn_norm or ffn_norm) and pre_in [T, hc] the
        mix the sublayer before wrote: the sums, the collapse and the Sinkhorn in one block per token."""
        norm = self.layers[m.layer].get(f"{m.kind}_norm")
        assert norm is not None, f"the {m.kind} sublayer's collapse needs {m.kind}_norm (ModelConfig.ffn_norm)"
        cfg = self.cfg
        partial, n_slices, scale, base = self._mix_args(m, h, n_tokens)
        per_thread = -(-cfg.dim // PRE_NORM_THREADS)
        mixes_norm_kernel(cfg.hc, per_thread)[n_tokens, PRE_NORM_THREADS, self.stream](
            partial, scale, base, m.pre, m.post, m.comb, n_slices,
            cfg.hc * cfg.dim, cfg.sinkhorn_iters, np.float32(cfg.norm_eps), np.float32(cfg.hc_eps),
            h, pre_in, norm, x, cfg.dim)
        return m

    def post_mix(self, h, a, m: Mixes, n_tokens: int, then: Mixes | None = None) -> None:
        """h = hc_post(a, h, m.post, m.comb) in place; a None is a zero sublayer output. then: the
        next sublayer's Mixes, whose product the same launch forms from the new h into
        then.product (post_product_kernel; `plan` says for which), for its `mixes`; past
        POST_PRODUCT_MAX_TOKENS tokens those launch their own product instead."""
        cfg = self.cfg
        out = self.no_output if a is None else a
        if then is not None and n_tokens <= POST_PRODUCT_MAX_TOKENS:
            self._post_product(h, out, m, n_tokens, then, own=False)
            return
        threads = 32 if SIM else 128
        grid = ((cfg.dim + threads - 1) // threads, n_tokens)
        _post_kernel[grid, threads, self.stream](h, out, m.post, m.comb, cfg.hc, cfg.dim, a is not None)

    def mixes_post(self, h, m: Mixes, n_tokens: int, then: Mixes | None) -> None:
        """A zero-output (FFN) sublayer in one launch: its `mixes` from the product the post before
        formed (pre into m.pre; its post and comb stay in the kernel), its post_mix, and the product
        of `then`'s mixes, as post_mix with `then` (which it needs: HyperLayer.ffn_in_one says
        where both products are formed). Past POST_PRODUCT_MAX_TOKENS tokens, `mixes` and post_mix
        (the same bits)."""
        assert then is not None, "mixes_post forms the next mixes' product"
        if n_tokens > POST_PRODUCT_MAX_TOKENS:
            self.post_mix(h, None, self.mixes(h, m, n_tokens), n_tokens, then)
            return
        self._post_product(h, self.no_output, m, n_tokens, then, own=True)

    def _post_product(self, h, a, m: Mixes, n_tokens: int, then: Mixes, own: bool) -> None:
        """post_product_kernel's launch: the post of h by m (a: the sublayer output, or no_output)
        and the product of `then`'s mixes; own: m's mixes run in it too, from m.product (the
        kernel's partial_in .. pre are read only then)."""
        cfg = self.cfg
        fn = self.layers[then.layer][then.kind][0]
        assert then.product is not None, "a post forms a product only where plan() gave it somewhere to go"
        assert not own or m.product is not None, "its own mixes read the product the post before formed"
        _, scale, base = self.layers[m.layer][m.kind]
        partial_in = then.product if m.product is None else m.product
        post_product_kernel(cfg.hc, fn.gtype, own)[(then.product.shape[2], n_tokens), (LANES, POST_WARPS),
                                                   self.stream](
            h, a, m.post, m.comb, fn.data, then.product, cfg.dim, a is not self.no_output, partial_in,
            partial_in.shape[2], scale, base, m.pre if own else m.post, cfg.sinkhorn_iters,
            np.float32(cfg.norm_eps), np.float32(cfg.hc_eps))

    def free(self) -> None:
        self.layers = []
        self.post_partial = {}
        self.pre = []
        self.embedding = None  # type: ignore[assignment]
        self.partial = self.post = self.comb = self.ids = self.no_output = None

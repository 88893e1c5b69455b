"""Hyper-connection glue on the device: the token embedding, the mixes each sublayer derives from
the highway (with Sinkhorn), the collapse into a normed sublayer input, and the expansion back.

Shapes: T tokens, hc copies, C dim, M = (2 + hc) * hc mixes. The highway h is float32
[T, hc, C] (kept in fp32 on the device); sublayer inputs and outputs are bf16 bits.

- `embed`: h[t, c] = bf16(dequant(token_embd[id_t])) for every copy c.
- `mixes`: raw = h_flat @ fn^T and the square sum of h_flat, in fp32 partial sums over slices of
  the flattened highway [T, M + 1, S] (stages.linear.stream_partials: the decode GEMV's walk, any
  T), then per token r = rsqrt(mean(h^2) + eps),
  pre = sigmoid(raw * r * s0 + b) + hc_eps, post = 2 sigmoid(raw * r * s1 + b), comb = Sinkhorn.
- `pre_norm`: x = attn_norm(bf16(sum_c pre[c] h[c])) in bf16.
- `post`: h[c] = post[c] * a + sum_k comb[k, c] h[k], in place; a = None is a zero sublayer.

Oracle: host.oracle.hc (hc_mixes / sinkhorn_split, hc_pre, hc_post), host.numerics.rms_norm,
host.oracle.Oracle.embed. Sums run in fp32 here (float64 there); transcendentals are CUDA's.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
from numba import cuda, float32, int32

from flashv41.host.errors import UnsupportedError
from flashv41.stages.device import CHUNK, SIM, WARP, bf16_round, bf16_to_f32, f32_to_bf16, warp_sum
from flashv41.stages.linear import DeviceWeight, stream_partials

MAX_HC = 4
MAX_MIX = (2 + MAX_HC) * MAX_HC
MIX_ROWS = MAX_MIX + 1  # the mixes and the highway's square sum
PRE_NORM_THREADS = 4 if SIM else 1024  # threads per token of pre_norm (a power of two: the reduction halves it)
LANES = 1 if SIM else WARP
COMB_CELLS = MAX_HC * MAX_HC
MIX_SLICE_CHUNKS = 8  # chunks of the flattened highway per partial sum (a slice of the product)
SINKHORN_THREADS = 1 if SIM else 256  # the simulator pays dearly for the Sinkhorn loop's barriers


@cuda.jit(device=True)
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
    @cuda.jit(device=True)
    def _sync():
        """The Sinkhorn kernel's barrier: the simulator runs it in one-thread blocks, where a
        barrier is a no-op that still costs, so it is skipped there."""
        if cuda.blockDim.x > 1:
            cuda.syncthreads()
else:
    @cuda.jit(device=True)
    def _sync():
        cuda.syncthreads()


@cuda.jit(device=True)
def _sigmoid(x):
    return float32(1) / (float32(1) + math.exp(-x))


@cache
def mixes_kernel(hc: int):
    """One block of SINKHORN_THREADS threads per token: the slices' partial products summed (one
    warp per row), then the split and Sinkhorn, its row and column sums shared by the block's
    threads. hc and the block size are compiled in: a loop over a run-time stride, or an index
    divided by a run-time hc, costs a 64-bit division each (about a hundred instructions), and the
    Sinkhorn loop is made of little else."""
    n_mix = (2 + hc) * hc
    cells = hc * hc
    threads = SINKHORN_THREADS
    warps = threads // LANES

    @cuda.jit(device=True)
    def normalise(m, sums, rows, eps):
        """m[line, j] /= (sum_j m[line, j] + eps) for each of the hc rows (rows) or columns; the
        sums in j order, one thread a line."""
        tid = cuda.threadIdx.x
        for line in range(tid, hc, threads):
            s = float32(0)
            for j in range(hc):
                s += m[line * hc + j] if rows else m[j * hc + line]
            sums[line] = s + eps
        _sync()
        for cell in range(tid, cells, threads):
            m[cell] = m[cell] / sums[cell // hc if rows else cell % hc]
        _sync()

    @cuda.jit
    def kernel(partial, scale, base, pre, post, comb, n_slices, width, iters, norm_eps, hc_eps):
        raw = cuda.shared.array(MIX_ROWS, float32)
        m = cuda.shared.array(COMB_CELLS, float32)
        sums = cuda.shared.array(MAX_HC, float32)
        scratch = cuda.shared.array(SINKHORN_THREADS, float32)
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
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
        r = float32(1) / math.sqrt(raw[n_mix] / float32(width) + norm_eps)
        for c in range(tid, hc, threads):
            pre[t, c] = _sigmoid(raw[c] * r * scale[0] + base[c]) + hc_eps
            post[t, c] = float32(2) * _sigmoid(raw[hc + c] * r * scale[1] + base[hc + c])
        for cell in range(tid, cells, threads):
            m[cell] = raw[2 * hc + cell] * r * scale[2] + base[2 * hc + cell]
        _sync()
        for k in range(tid, hc, threads):  # row softmax
            row_max = float32(-math.inf)
            for c in range(hc):
                row_max = max(row_max, m[k * hc + c])
            row_sum = float32(0)
            for c in range(hc):
                e = math.exp(m[k * hc + c] - row_max)
                m[k * hc + c] = e
                row_sum += e
            for c in range(hc):
                m[k * hc + c] = m[k * hc + c] / row_sum + hc_eps
        _sync()
        for it in range(iters):
            if it > 0:
                normalise(m, sums, True, hc_eps)
            normalise(m, sums, False, hc_eps)
        for cell in range(tid, cells, threads):
            comb[t, cell // hc, cell % hc] = m[cell]

    return kernel


@cache
def pre_norm_kernel(hc: int, per_thread: int):
    """One block of PRE_NORM_THREADS threads per token, per_thread values of the row each (their
    loads issued together, the mixed values kept for the second pass): y = bf16(sum_c pre[c] h[c]);
    out = bf16(w * (y * rsqrt(mean(y^2) + eps))). A walk that loads, adds and loads again waits on
    each load in turn: that cost a one-token step about 20 us here."""
    threads = PRE_NORM_THREADS

    @cuda.jit
    def kernel(h, pre, weight, out, dim, eps):
        scratch = cuda.shared.array(PRE_NORM_THREADS, float32)
        t = cuda.blockIdx.x
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

    return kernel


@cuda.jit
def _post_kernel(h, a, post, comb, hc, dim, has_output):
    """h[t, c, d] = post[c] * a[t, d] + sum_k comb[k, c] h[t, k, d], in place (one thread per d)."""
    t = cuda.blockIdx.y
    d = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if d >= dim:
        return
    old = cuda.local.array(MAX_HC, float32)
    for k in range(hc):
        old[k] = h[t, k, d]
    av = bf16_to_f32(a[t, d]) if has_output else float32(0)
    for c in range(hc):
        s = float32(0)
        for k in range(hc):
            s += comb[t, k, c] * old[k]
        h[t, c, d] = post[t, c] * av + s if has_output else s


@cache
def embed_kernel(dequant):
    """h[t, c, :] = bf16(dequant(table[ids[t]])) for every copy; one thread per 32-value chunk."""

    @cuda.jit
    def embed(ids, table, h, n_tokens, hc, chunks):
        t = cuda.blockIdx.y
        chunk = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if t >= n_tokens or chunk >= chunks:
            return
        buf = cuda.local.array(CHUNK, float32)
        dequant(table, int32(ids[t]), chunk, buf)
        for i in range(CHUNK):
            v = bf16_round(buf[i])
            for c in range(hc):
                h[t, c, chunk * CHUNK + i] = v

    return embed


class HyperStage:
    """The hc weights of every layer and the embedding table on the device, plus the mix buffers
    for up to `max_tokens` tokens. The highway and the sublayer buffers belong to the caller."""

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
            self.layers.append(per)
        hc = cfg.hc
        self.n_slices = -(-cfg.hc * cfg.dim // (MIX_SLICE_CHUNKS * CHUNK))
        self.partial = cuda.device_array((max_tokens, cfg.mix_hc + 1, self.n_slices), np.float32)  # [T, M+1, S]
        self.post = cuda.device_array((max_tokens, hc), np.float32)  # [T, hc]
        self.comb = cuda.device_array((max_tokens, hc, hc), np.float32)  # [T, hc(k), hc(c)]
        self.ids = cuda.device_array(max_tokens, np.int32)  # [T]
        self.no_output = cuda.device_array((1, 1), np.uint16)  # stands in for `a` of a zero sublayer

    def embed(self, token_ids: np.ndarray, h, n_tokens: int) -> None:
        """Write the embedded tokens into every copy of h [>= T, hc, C]."""
        self.upload_ids(token_ids, n_tokens)
        self.embed_uploaded(h, n_tokens)

    def upload_ids(self, token_ids: np.ndarray, n_tokens: int) -> None:
        """The host's part of `embed`: the token ids into the stage's id buffer."""
        self.ids[:n_tokens].copy_to_device(np.ascontiguousarray(token_ids, np.int32), stream=self.stream)

    def embed_uploaded(self, h, n_tokens: int) -> None:
        """The device part of `embed`, from the uploaded ids."""
        chunks = self.cfg.dim // CHUNK
        threads = min(64, chunks)
        grid = ((chunks + threads - 1) // threads, n_tokens)
        embed_kernel(self.embedding.dequant)[grid, threads, self.stream](
            self.ids, self.embedding.data, h, n_tokens, self.cfg.hc, chunks)

    def mixes(self, layer: int, kind: str, h, pre, n_tokens: int) -> None:
        """pre [T, hc] (caller's buffer), self.post and self.comb from h for sublayer `kind`: the
        product and the highway's square sum by slices of MIX_SLICE_CHUNKS chunks (many warps for
        one token), then one block per token adds the slices up and runs the split and Sinkhorn."""
        fn, scale, base = self.layers[layer][kind]
        cfg = self.cfg
        width = cfg.hc * cfg.dim
        stream_partials(h.reshape(h.shape[0], width), fn, self.partial, n_tokens, self.stream)
        mixes_kernel(cfg.hc)[n_tokens, SINKHORN_THREADS, self.stream](
            self.partial, scale, base, pre, self.post, self.comb, self.n_slices, width, cfg.sinkhorn_iters,
            np.float32(cfg.norm_eps), np.float32(cfg.hc_eps))

    def pre_norm(self, layer: int, h, pre, x, n_tokens: int) -> None:
        """x [T, C] bf16 = attn_norm(hc_pre(h, pre))."""
        cfg = self.cfg
        per_thread = -(-cfg.dim // PRE_NORM_THREADS)
        pre_norm_kernel(cfg.hc, per_thread)[n_tokens, PRE_NORM_THREADS, self.stream](
            h, pre, self.layers[layer]["attn_norm"], x, cfg.dim, np.float32(cfg.norm_eps))

    def post_mix(self, h, a, n_tokens: int) -> None:
        """h = hc_post(a, h, self.post, self.comb) in place; a None is a zero sublayer output."""
        cfg = self.cfg
        threads = 32 if SIM else 128
        grid = ((cfg.dim + threads - 1) // threads, n_tokens)
        _post_kernel[grid, threads, self.stream](h, self.no_output if a is None else a, self.post, self.comb,
                                                 cfg.hc, cfg.dim, a is not None)

    def free(self) -> None:
        self.layers = []
        self.embedding = None  # type: ignore[assignment]
        self.partial = self.post = self.comb = self.ids = self.no_output = None

"""The engram gate on the device, in place on the fp32 highway.

Shapes: T tokens, hc copies, C = dim. h float32 [>= T, hc, C]; kv bf16 bits uint16 [>= T, C * (hc + 1)]
(hc keys, copy-major, then the one shared value); qk = q_weight * k_weight float32 [hc, C]; the
token mask uint8 or bool [>= T] (0 -> g = 0); the gates float32 [>= T, hc] are written out too.

Per (token t, copy c):
    dot = sum(h * qk[c] * key_c) * rsqrt(mean(h^2) + eps) * rsqrt(mean(key_c^2) + eps) * C^-0.5
    g = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot))
    h[t, c] += g * value

One block per (token, copy): its threads stride over C accumulating the three sums in fp32, reduce
them (warp shuffles, then one shared slot per warp), and thread 0 evaluates the scalar tail in
float64, rounding each of rsqrt and sigmoid once to float32 as the oracle does, so the only
difference from the oracle is the fp32 summation order; then every thread adds g * value.

Oracle: host.oracle.engram.engram_gate. hc must be 1..MAX_HC (the engine's supported range; others
raise UnsupportedError where a stage is built).
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
from numba import cuda, float32, float64

from flashv41.host.errors import InputError, UnsupportedError
from flashv41.stages.device import SIM, WARP, bf16_to_f32, jit_kernel, warp_sum

MAX_HC = 4
SQRT_FLOOR = 1e-6  # |dot| is floored here before the square root (the reference's clamp)
# threads per block: the simulator runs one (no reduction, see stages/linear.py); a GPU 8 warps
GATE_THREADS = 1 if SIM else 256


@cache
def gate_kernel(threads: int):
    """The gate for blocks of `threads` threads: 1, or a multiple of the warp size. h fp32 [T, hc, C]
    in place; kv bf16 [T, C * (hc + 1)]; qk fp32 [hc, C]; mask uint8 or bool [T]; g_out fp32 [T, hc]."""
    if threads != 1 and threads % WARP:
        raise ValueError(f"gate blocks take 1 thread or a multiple of {WARP}, got {threads}")
    warps = max(1, threads // WARP)
    slots = max(1, threads)

    @jit_kernel()
    def gate(h, kv, qk, mask, g_out, hc, dim, eps, scale):
        scratch = cuda.shared.array(slots, float32)  # warp_sum's (simulator) scratch
        partial = cuda.shared.array((3, warps), float32)  # [3, warps]: each warp's three sums
        shared_g = cuda.shared.array(1, float32)  # [1]: the gate, from thread 0 to the block
        t = cuda.blockIdx.x
        c = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        key = c * dim
        value = hc * dim
        s_dot = float32(0)
        s_hh = float32(0)
        s_kk = float32(0)
        for i in range(tid, dim, threads):
            x = h[t, c, i]
            k = bf16_to_f32(kv[t, key + i])
            s_dot += (x * qk[c, i]) * k
            s_hh += x * x
            s_kk += k * k
        if threads > 1:
            s_dot = warp_sum(s_dot, scratch)
            s_hh = warp_sum(s_hh, scratch)
            s_kk = warp_sum(s_kk, scratch)
            if tid % WARP == 0:
                partial[0, tid // WARP] = s_dot
                partial[1, tid // WARP] = s_hh
                partial[2, tid // WARP] = s_kk
            cuda.syncthreads()
            if tid == 0:
                for w in range(1, warps):
                    s_dot += partial[0, w]
                    s_hh += partial[1, w]
                    s_kk += partial[2, w]
        if tid == 0:
            n = float32(dim)
            r_h = float32(float64(1) / math.sqrt(float64(s_hh / n + eps)))
            r_k = float32(float64(1) / math.sqrt(float64(s_kk / n + eps)))
            dot = s_dot * (r_h * r_k) * scale
            mag = math.sqrt(max(abs(float64(dot)), float64(SQRT_FLOOR)))
            g = float32(float64(1) / (float64(1) + math.exp(-math.copysign(mag, float64(dot)))))
            if mask[t] == 0:
                g = float32(0)
            g_out[t, c] = g
            shared_g[0] = g
        cuda.syncthreads()
        g = shared_g[0]
        for i in range(tid, dim, threads):
            h[t, c, i] = h[t, c, i] + g * bf16_to_f32(kv[t, value + i])

    return gate


def check_hc(hc: int) -> None:
    """UnsupportedError unless 1 <= hc <= MAX_HC (called where a stage is built, and per launch)."""
    if not 1 <= hc <= MAX_HC:
        raise UnsupportedError(f"the engram gate supports hc (hyper-connection copies) 1..{MAX_HC}, got {hc}")


def engram_gate(h, kv, qk, eps: float, mask, g_out, n_tokens: int, stream=0, threads: int = GATE_THREADS) -> None:
    """h[:n_tokens] += g * value in place, g into g_out[:n_tokens] (shapes in the module docstring).
    The oracle's engram_gate(h, kv, qk, eps, token_mask) takes the same first five arguments.

    `mask` is required here (the stage passes an all-ones one when the caller has none);
    `threads` overrides the block size (tests run the multi-warp reduction on the simulator).
    """
    if n_tokens < 1:
        return
    if h.ndim != 3 or h.dtype != np.float32:
        raise InputError(f"engram gate: h must be float32 [T, hc, dim], got {h.dtype} {tuple(h.shape)}")
    _, hc, dim = h.shape
    check_hc(hc)
    checks = (
        (h.shape[0] >= n_tokens, f"h {tuple(h.shape)}"),
        (kv.dtype == np.uint16 and kv.ndim == 2 and kv.shape[0] >= n_tokens and kv.shape[1] == dim * (hc + 1),
         f"kv {kv.dtype} {tuple(kv.shape)}"),
        (qk.dtype == np.float32 and tuple(qk.shape) == (hc, dim), f"qk {qk.dtype} {tuple(qk.shape)}"),
        (mask.ndim == 1 and mask.shape[0] >= n_tokens and mask.dtype in (np.uint8, np.bool_),
         f"mask {mask.dtype} {tuple(mask.shape)}"),
        (g_out.dtype == np.float32 and g_out.ndim == 2 and g_out.shape[0] >= n_tokens and g_out.shape[1] == hc,
         f"gates {g_out.dtype} {tuple(g_out.shape)}"),
    )
    for ok, what in checks:
        if not ok:
            raise InputError(f"engram gate ({n_tokens} tokens, hc {hc}, dim {dim}): unexpected {what}")
    gate_kernel(threads)[(n_tokens, hc), threads, stream](h, kv, qk, mask, g_out, hc, dim, np.float32(eps),
                                                          np.float32(dim ** -0.5))

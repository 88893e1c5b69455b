"""The V4.1 MoE on the host, in NumPy, as the official reference computes it (model.py: Gate, Expert,
MoE): `HostMoE(model)(layer, x) -> y`. Exact on any model, slow on the real one; the engine's MoE
for the real model is the caller's (an FFN callback, flashv41.ffn), and this is what tests and
prototypes hold one to, and what the oracle runs.

For a layer, x bf16 values [T, C] (the FFN's input: ffn_norm(hc_pre(h, attention pre))):

1. scores = x @ gate^T in fp32 (`ffn_gate_inp` [E, C]), then the model's scoring function:
   sqrtsoftplus sqrt(softplus(s)) (torch's softplus: s itself past 20), sigmoid, or softmax over E.
2. The experts: the top n_active of scores + `exp_probs_b` (the correction bias chooses, it does
   not weigh; ties to the lower expert index, where torch leaves the order to its kernel); their
   weights are the unbiased scores, divided by their sum + 1e-20 when normalised and n_active > 1,
   times route_scale.
3. Each chosen expert, in increasing expert order, adds to an fp32 accumulator y:
   gate = bf16(x @ w1^T), up = bf16(x @ w3^T); with swiglu_limit > 0, up clamped to [-limit, limit]
   and gate from above; h = silu(gate) * up (fp32), times the token's weight; bf16(h) @ w2^T,
   rounded to bf16 (`ffn_{gate,up,down}_exps` [E, I, C], [E, C, I]).
4. y += the shared expert of x (`ffn_*_shexp`, the same SwiGLU, no weight); the output is bf16(y).

Roundings as host.numerics says (sums in float64, rounded once to the dtype the reference holds;
transcendentals in float64, rounded once); the products' weights are the file's, dequantised by
gguf-py whatever their type (IQ2_XXS, MXFP4, Q2_K ...). Not emulated, as everywhere in flashv41
(SPEC section 3): the reference's fp8 / fp4 activation quantisation before its expert GEMMs, and
its image-token routing bias (`exp_probs_b_vl`). An expert's weights are dequantised when a token
first picks it and kept while `cache_bytes` allows.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from flashv41.host.config import MoEConfig
from flashv41.host.errors import InputError, UnsupportedError
from flashv41.host.gguf_moe import host_dequantize
from flashv41.host.model import Model
from flashv41.host.numerics import F32, bf16, exp, f32, linear, matmul_t, sigmoid, sqrt, sum_last

NORM_EPS = 1e-20  # the routing weights' normaliser, not norm_eps (the reference: "matches training")
SOFTPLUS_THRESHOLD = 20.0  # torch's softplus returns its input past this


def softplus(s: np.ndarray) -> np.ndarray:
    """torch.nn.functional.softplus (beta 1, threshold 20), fp32 out."""
    s64 = np.asarray(s, np.float64)
    return f32(np.where(s64 > SOFTPLUS_THRESHOLD, s64, np.log1p(np.exp(np.minimum(s64, SOFTPLUS_THRESHOLD)))))


def silu(g: np.ndarray) -> np.ndarray:
    """g * sigmoid(g), one fp32 rounding."""
    g64 = np.asarray(g, np.float64)
    return f32(g64 / (1.0 + np.exp(-g64)))


def gate_scores(x: np.ndarray, gate: np.ndarray, score_func: str) -> np.ndarray:
    """The router's scores [T, E] fp32: the model's scoring function of x @ gate^T."""
    s = matmul_t(x, gate)
    if score_func == "softmax":
        e = exp(s - s.max(axis=-1, keepdims=True))
        return (e / sum_last(e)[:, None]).astype(F32)
    if score_func == "sigmoid":
        return sigmoid(s)
    return sqrt(softplus(s))


def route(x: np.ndarray, gate: np.ndarray, bias: np.ndarray, cfg: MoEConfig) -> tuple[np.ndarray, np.ndarray]:
    """(weights fp32 [T, k], experts int64 [T, k]) of each token: the top-k of scores + bias (ties
    to the lower index), weighted by the unbiased scores, normalised and scaled."""
    scores = gate_scores(x, gate, cfg.score_func)
    biased = (scores + np.asarray(bias, F32)).astype(F32)
    experts = np.argsort(-biased, axis=-1, kind="stable")[:, :cfg.n_active]
    weights = np.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk and cfg.n_active > 1:
        weights = (weights / (sum_last(weights)[:, None] + F32(NORM_EPS))).astype(F32)
    return (weights * F32(cfg.route_scale)).astype(F32), experts


def swiglu_expert(x: np.ndarray, w1: np.ndarray, w3: np.ndarray, w2: np.ndarray, limit: float,
                  weight: np.ndarray | None = None) -> np.ndarray:
    """One expert (the reference's Expert): bf16 values [T, C] of x bf16 [T, C]; `weight` [T] fp32
    scales the hidden activations before the down product."""
    g = linear(x, w1)
    up = linear(x, w3)
    if limit > 0:
        lim = F32(limit)
        up = np.clip(up, -lim, lim)
        g = np.minimum(g, lim)
    hidden = (silu(g) * up).astype(F32)
    if weight is not None:
        hidden = (np.asarray(weight, F32)[:, None] * hidden).astype(F32)
    return linear(bf16(hidden), w2)


class HostMoE:
    """The model's MoE on the CPU: `moe(layer, x)` -> y, float32 [T, C] of bf16 values, for x
    float32 [T, C] (bf16 values: others are rounded to bf16 first, as the reference's input is).
    Every layer's router and shared expert are dequantised once; a routed expert when first
    chosen, kept in a cache of at most `cache_bytes` (least recently used out first).
    `last_experts[layer]`: the experts each token of the layer's last call took, int64 [T, k]."""

    def __init__(self, model: Model, cache_bytes: int = 1 << 30):
        cfg = model.config
        if cfg.moe is None:
            raise UnsupportedError(f"{model.path.name}: the file has no MoE tensors (ffn_gate_inp, ffn_*_exps, "
                                   "ffn_*_shexp), so there is no MoE to compute on the host")
        self.model = model
        self.cfg = cfg.moe
        self.dim = cfg.dim
        self.n_layers = cfg.n_layers
        self.cache_bytes = cache_bytes
        self._layers: dict[int, dict[str, np.ndarray]] = {}
        self._experts: OrderedDict[tuple[int, int], tuple[np.ndarray, ...]] = OrderedDict()
        self._held = 0
        self.last_experts: dict[int, np.ndarray] = {}

    def _dense(self, layer: int, role: str) -> np.ndarray:
        ref = self.model.tensor(layer, role)
        return host_dequantize(ref.data, ref.ggml_type).reshape(ref.shape)

    def layer_weights(self, layer: int) -> dict[str, np.ndarray]:
        """The layer's router, bias and shared expert, dequantised (cached)."""
        if layer not in self._layers:
            self._layers[layer] = {role: self._dense(layer, role) for role in (
                "ffn_gate_inp", "exp_probs_b", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")}
        return self._layers[layer]

    def expert(self, layer: int, e: int) -> tuple[np.ndarray, ...]:
        """(w1 [I, C], w3 [I, C], w2 [C, I]) of routed expert e, dequantised from the file's rows."""
        key = (layer, e)
        if key in self._experts:
            self._experts.move_to_end(key)
            return self._experts[key]
        weights = []
        for role in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            ref = self.model.tensor(layer, role)
            weights.append(host_dequantize(ref.data[e], ref.ggml_type).reshape(ref.shape[1:]))
        held = tuple(weights)
        size = sum(w.nbytes for w in held)
        while self._experts and self._held + size > self.cache_bytes:
            _, dropped = self._experts.popitem(last=False)
            self._held -= sum(w.nbytes for w in dropped)
        if size <= self.cache_bytes:
            self._experts[key] = held
            self._held += size
        return held

    def __call__(self, layer: int, x: np.ndarray) -> np.ndarray:
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.n_layers:
            raise InputError(f"HostMoE: layer {layer!r} is not a layer of the model (0 to {self.n_layers - 1})")
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != self.dim or not np.issubdtype(x.dtype, np.floating):
            raise InputError(f"HostMoE: x must be float [T, {self.dim}], got {x.dtype} {x.shape}")
        x = bf16(x.astype(F32))
        cfg, w = self.cfg, self.layer_weights(layer)
        weights, experts = route(x, w["ffn_gate_inp"], w["exp_probs_b"], cfg)
        self.last_experts[layer] = experts
        y = np.zeros_like(x, dtype=F32)
        for e in np.unique(experts):
            rows, slot = np.nonzero(experts == e)
            w1, w3, w2 = self.expert(layer, int(e))
            y[rows] += swiglu_expert(x[rows], w1, w3, w2, cfg.swiglu_limit, weights[rows, slot])
        y += swiglu_expert(x, w["ffn_gate_shexp"], w["ffn_up_shexp"], w["ffn_down_shexp"], cfg.swiglu_limit)
        return bf16(y)

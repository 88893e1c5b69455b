"""flashv41.HostMoE against the reference's MoE (model.py Gate, Expert, MoE) written out token by
token, plainly, from the reference's text; and the properties that text states: the correction bias
chooses but does not weigh, torch's softplus threshold, the clamps, the normalisation and the route
scale, the shared expert, the experts' order of accumulation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import flashv41
from flashv41.host.errors import InputError, UnsupportedError
from flashv41.host.moe import HostMoE, gate_scores, route, softplus, swiglu_expert
from flashv41.host.numerics import bf16

F32 = np.float32


def _f32(x) -> np.float32:
    return F32(np.float64(x))


def reference_token(x: np.ndarray, w: dict, experts, cfg) -> np.ndarray:
    """One token through the reference's MoE, op by op (bf16 tensors rounded where the reference
    holds bf16; each fp32 op rounded once; dot products as float64 sums rounded once)."""
    e_count = w["ffn_gate_inp"].shape[0]
    logits = [_f32(np.dot(x.astype(np.float64), w["ffn_gate_inp"][e].astype(np.float64))) for e in range(e_count)]
    if cfg.score_func == "sqrtsoftplus":
        scores = [_f32(np.sqrt(np.float64(_f32(s if s > 20 else np.log1p(np.exp(np.float64(s))))))) for s in logits]
    elif cfg.score_func == "sigmoid":
        scores = [_f32(1 / (1 + np.exp(-np.float64(s)))) for s in logits]
    else:
        top = max(logits)
        ex = [_f32(np.exp(np.float64(F32(s - top)))) for s in logits]
        total = _f32(sum(np.float64(v) for v in ex))
        scores = [F32(v / total) for v in ex]
    biased = [F32(s + F32(b)) for s, b in zip(scores, w["exp_probs_b"], strict=True)]
    chosen = sorted(range(e_count), key=lambda e: (-float(biased[e]), e))[:cfg.n_active]
    weights = [scores[e] for e in chosen]
    if cfg.norm_topk and cfg.n_active > 1:
        total = F32(_f32(sum(np.float64(v) for v in weights)) + F32(1e-20))
        weights = [F32(v / total) for v in weights]
    weights = [F32(v * F32(cfg.route_scale)) for v in weights]

    def expert(w1, w3, w2, weight):
        g = bf16(np.array([_f32(np.dot(x.astype(np.float64), r.astype(np.float64))) for r in w1]))
        u = bf16(np.array([_f32(np.dot(x.astype(np.float64), r.astype(np.float64))) for r in w3]))
        if cfg.swiglu_limit > 0:
            lim = F32(cfg.swiglu_limit)
            u = np.array([min(max(v, -lim), lim) for v in u], F32)
            g = np.array([min(v, lim) for v in g], F32)
        h = np.array([F32(_f32(np.float64(gv) / (1 + np.exp(-np.float64(gv)))) * uv) for gv, uv in zip(g, u,
                                                                                                     strict=True)])
        if weight is not None:
            h = np.array([F32(weight * v) for v in h], F32)
        h = bf16(h)
        return bf16(np.array([_f32(np.dot(h.astype(np.float64), r.astype(np.float64))) for r in w2]))

    y = np.zeros(x.shape, F32)
    for e in sorted(chosen):
        y = (y + expert(*experts(e), weights[chosen.index(e)])).astype(F32)
    y = (y + expert(w["ffn_gate_shexp"], w["ffn_up_shexp"], w["ffn_down_shexp"], None)).astype(F32)
    return bf16(y)


@pytest.fixture(scope="module")
def moe_model(synth_model):
    with flashv41.load_model(synth_model("tiny", moe=True)) as model:
        yield model


def _inputs(dim: int, t: int, seed: int, scale: float = 1.0) -> np.ndarray:
    return bf16(np.random.default_rng(seed).standard_normal((t, dim), dtype=F32) * F32(scale))


@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_host_moe_is_the_reference_token_by_token(moe_model, score_func: str) -> None:
    moe = HostMoE(moe_model)
    moe.cfg = dataclasses.replace(moe.cfg, score_func=score_func)
    x = _inputs(moe_model.config.dim, 9, 1, scale=3.0)  # large enough that the clamps bite somewhere
    for layer in (0, 4):
        got = moe(layer, x)
        w = moe.layer_weights(layer)
        want = np.stack([reference_token(x[t], w, lambda e, i=layer: moe.expert(i, e), moe.cfg) for t in range(9)])
        assert got.dtype == F32 and got.shape == x.shape
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"layer {layer}: HostMoE is not the reference"


def test_the_bias_chooses_and_does_not_weigh(moe_model) -> None:
    moe = HostMoE(moe_model)
    w = moe.layer_weights(2)
    x = _inputs(moe_model.config.dim, 6, 2)
    bias = np.zeros(4, F32)
    bias[3] = 100.0  # expert 3 always chosen
    weights, experts = route(x, w["ffn_gate_inp"], bias, moe.cfg)
    assert (experts[:, 0] == 3).all()
    scores = gate_scores(x, w["ffn_gate_inp"], moe.cfg.score_func)
    raw = np.take_along_axis(scores, experts, axis=-1)
    want = raw / (raw.sum(-1, keepdims=True, dtype=np.float64).astype(F32) + F32(1e-20)) * F32(moe.cfg.route_scale)
    np.testing.assert_allclose(weights, want, rtol=2e-7)
    assert np.allclose(weights.sum(-1), moe.cfg.route_scale, rtol=1e-6)  # weighed by scores, not score + 100


def test_softplus_is_torchs() -> None:
    assert softplus(np.array([30.0], F32))[0] == F32(30.0)  # past the threshold: the input itself
    assert softplus(np.array([0.0], F32))[0] == F32(np.log(2.0))
    assert softplus(np.array([-30.0], F32))[0] == F32(np.log1p(np.exp(-30.0)))


def test_the_clamps() -> None:
    """The up branch is clamped on both sides, the gate branch from above only."""
    x = bf16(np.ones((1, 32), F32))
    w_up = np.full((2, 32), 0.5, F32)
    w_up[1] *= -1  # up = +-16
    w_gate = np.full((2, 32), 1.0, F32)
    w_gate[1] *= -1  # gate = +32, -32
    w_down = np.eye(32, 2, dtype=F32)
    y = swiglu_expert(x, w_gate, w_up, w_down, limit=10.0)
    # silu(min(32, 10)) * 10 and silu(-32) * -10
    assert y[0, 0] == bf16(np.array([F32(10 / (1 + np.exp(-10.0))) * F32(10)]))[0]
    assert y[0, 1] == bf16(np.array([F32(-32 / (1 + np.exp(32.0))) * F32(-10)]))[0]
    unclamped = swiglu_expert(x, w_gate, w_up, w_down, limit=0.0)
    assert unclamped[0, 0] == bf16(np.array([F32(32 / (1 + np.exp(-32.0))) * F32(16)]))[0]


def test_host_moe_refusals(moe_model, tiny_path) -> None:
    moe = HostMoE(moe_model)
    with pytest.raises(InputError, match="x must be float"):
        moe(0, np.zeros((2, 31), F32))
    with pytest.raises(InputError, match="layer 6 is not a layer"):
        moe(6, np.zeros((2, 32), F32))
    with flashv41.load_model(tiny_path) as plain, pytest.raises(UnsupportedError, match="no MoE tensors"):
        HostMoE(plain)


def test_the_expert_cache_is_bounded(moe_model) -> None:
    """A cache smaller than one expert keeps none and gives the same results."""
    x = _inputs(moe_model.config.dim, 5, 3)
    tiny = HostMoE(moe_model, cache_bytes=1)
    assert np.array_equal(tiny(1, x), HostMoE(moe_model)(1, x))
    assert tiny._held == 0 and not tiny._experts

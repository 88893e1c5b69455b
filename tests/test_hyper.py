"""stages.hyper against the oracle (host.oracle.hc, rms_norm) on the tiny and small models; the
embedding in tests/test_embed.py, the mixes' product in tiles (stages.mixes_tiles) in
tests/test_mixes_tiles.py."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda  # noqa: E402  (after conftest chose the backend)

import flashv41
from flashv41.host.numerics import bf16, from_bits, rms_norm, to_bits
from flashv41.host.oracle import Oracle
from flashv41.host.oracle.hc import hc_mixes, hc_post, hc_pre
from flashv41.stages.hyper import HyperStage  # noqa: E402
from tests.bounds import assert_within, bf16_ulp, f32_sum_error

T = 5


@pytest.fixture(scope="module")
def stages(synth_model):
    """(model, oracle, HyperStage for 16 tokens) of a preset, built on first use."""
    built: dict[str, tuple] = {}

    def get(preset: str):
        if preset not in built:
            model = flashv41.load_model(synth_model(preset))
            built[preset] = (model, Oracle(model, max_seq=64), HyperStage(model, max_tokens=16))
        return built[preset]

    yield get
    for _, _, stage in built.values():
        stage.free()


@pytest.fixture(scope="module")
def setup(stages):
    return stages("tiny")


def highway(cfg, seed, n_tokens=T):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n_tokens, cfg.hc, cfg.dim)) * 0.3).astype(np.float32)


def buffer(cfg, n_tokens, width=None, dtype=np.float32):
    """A caller's buffer of a mix ([T, hc] fp32) or of a sublayer input ([T, width]), with room for
    16 tokens or n_tokens, whichever is more."""
    return cuda.device_array((max(16, n_tokens), cfg.hc if width is None else width), dtype)


@pytest.mark.parametrize("preset,layer,kind,n_tokens", [("tiny", 0, "attn", T), ("tiny", 3, "ffn", T),
                                                        ("small", 1, "attn", 1), ("small", 2, "ffn", 11)])
def test_mixes(stages, preset, layer, kind, n_tokens):
    """The tiny highway is one partial slice (4 of 8 chunks); small's is four, and 11 tokens are two
    token groups, the second one partly empty."""
    check_mixes(*stages(preset), layer, kind, n_tokens)


def check_mixes(model, oracle, stage, layer, kind, n_tokens):
    cfg = model.config
    h = highway(cfg, layer, n_tokens)
    pre = buffer(cfg, n_tokens)
    stage.mixes(cuda.to_device(h), stage.sublayer(layer, kind, pre), n_tokens)
    # fp32 sums and CUDA's exp vs float64 sums and correctly rounded exp: a few ulp on pre / post;
    # 20 Sinkhorn rounds amplify last-ulp differences (two correct fp32 implementations were seen
    # 7e-6 apart on comb entries, which lie in [0, 1]): assert_mixes
    assert_mixes(stage, pre, want_mixes(oracle, cfg, h, layer, kind), n_tokens)


def want_mixes(oracle, cfg, h, layer, kind):
    return hc_mixes(h, oracle.weight(layer, f"hc_{kind}_fn"), oracle.weight(layer, f"hc_{kind}_scale"),
                    oracle.weight(layer, f"hc_{kind}_base"), cfg.hc, cfg.sinkhorn_iters, cfg.norm_eps, cfg.hc_eps)


def assert_mixes(stage, pre, want, n_tokens):
    """pre, post and comb within the bounds of test_mixes' comment."""
    want_pre, want_post, want_comb = want
    assert_within(pre.copy_to_host()[:n_tokens], want_pre, 1e-6, "pre")
    assert_within(stage.post.copy_to_host()[:n_tokens], want_post, 2e-6, "post")
    assert_within(stage.comb.copy_to_host()[:n_tokens], want_comb, 2e-5, "comb")


def assert_pre_norm(x, h, pre, oracle, cfg, layer, n_tokens):
    want = rms_norm(hc_pre(h, pre), oracle.weight(layer, "attn_norm"), cfg.norm_eps)
    got = from_bits(x.copy_to_host()[:n_tokens])
    # the collapsed value may round to a neighbouring bf16 (fp32 vs float64 sum over hc), and the
    # output adds its own rounding: two bf16 ulps
    assert_within(got, want, 2 * bf16_ulp(np.maximum(np.abs(got), np.abs(want))), "pre_norm")


@pytest.mark.parametrize("preset,n_tokens", [("tiny", T), ("small", 3)])
def test_mixes_norm(stages, preset, n_tokens):
    check_mixes_norm(*stages(preset), n_tokens)


def check_mixes_norm(model, oracle, stage, n_tokens):
    """The attention sublayer's mixes with its input: x from the given mix, pre / post / comb as
    `mixes` gives them, bit for bit."""
    cfg = model.config
    h = highway(cfg, 7, n_tokens)
    rng = np.random.default_rng(8)
    pre_in = rng.uniform(0.1, 1.0, (n_tokens, cfg.hc)).astype(np.float32)
    x = buffer(cfg, n_tokens, cfg.dim, np.uint16)
    pre = buffer(cfg, n_tokens)
    hd = cuda.to_device(h)
    stage.mixes_norm(hd, stage.sublayer(2, "attn", pre), cuda.to_device(pre_in), x, n_tokens)
    assert_pre_norm(x, h, pre_in, oracle, cfg, 2, n_tokens)
    assert_mixes(stage, pre, want_mixes(oracle, cfg, h, 2, "attn"), n_tokens)
    got = [pre.copy_to_host()[:n_tokens], stage.post.copy_to_host()[:n_tokens], stage.comb.copy_to_host()[:n_tokens]]
    alone = buffer(cfg, n_tokens)
    stage.mixes(hd, stage.sublayer(2, "attn", alone), n_tokens)
    for a, b in zip(got, [alone.copy_to_host()[:n_tokens], stage.post.copy_to_host()[:n_tokens],
                          stage.comb.copy_to_host()[:n_tokens]], strict=True):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def post_bound(h, a, post, comb, want, cfg):
    terms = np.abs(comb).transpose(0, 2, 1) @ np.abs(h) + (np.abs(post)[:, :, None] * np.abs(a)[:, None, :]
                                                           if a is not None else 0)
    return f32_sum_error(terms, cfg.hc + 1) + np.abs(want) * 2.0**-23


@pytest.mark.parametrize("with_output", [True, False])
def test_post(setup, with_output):
    model, oracle, stage = setup
    cfg = model.config
    h = highway(cfg, 9)
    rng = np.random.default_rng(10)
    a = bf16(rng.standard_normal((T, cfg.dim)).astype(np.float32))
    hd = cuda.to_device(h)
    mixes = stage.mixes(hd, stage.sublayer(1, "attn", cuda.device_array((8, cfg.hc), np.float32)), T)
    post, comb = mixes.post.copy_to_host()[:T], mixes.comb.copy_to_host()[:T]
    stage.post_mix(hd, cuda.to_device(to_bits(a)) if with_output else None, mixes, T)
    want = hc_post(a if with_output else None, h, post, comb)
    assert_within(hd.copy_to_host()[:T], want, post_bound(h, a if with_output else None, post, comb, want, cfg),
                  "post")


@pytest.mark.parametrize("preset,layer,kind,n_tokens,with_output", [("tiny", 1, "ffn", T, True),
                                                                     ("small", 2, "attn", 3, False)])
def test_post_with_next_product(stages, preset, layer, kind, n_tokens, with_output):
    check_post_with_next_product(*stages(preset), layer, kind, n_tokens, with_output)


def check_post_with_next_product(model, oracle, stage, layer, kind, n_tokens, with_output):
    """post_mix forming the next mixes' product: h as post_mix alone gives it, bit for bit, and the
    mixes from its partial sums within test_mixes' bounds of the oracle's from that h."""
    cfg = model.config
    assert stage.fuses(layer, kind)
    h = highway(cfg, 11, n_tokens)
    rng = np.random.default_rng(12)
    a = to_bits(bf16(rng.standard_normal((n_tokens, cfg.dim)).astype(np.float32)))
    mixes = stage.mixes(cuda.to_device(h), stage.sublayer(0, "attn", buffer(cfg, n_tokens)), n_tokens)
    pre = buffer(cfg, n_tokens)
    then = stage.sublayer(layer, kind, pre, after_post=True)
    alone, fused = cuda.to_device(h), cuda.to_device(h)
    stage.post_mix(alone, cuda.to_device(a) if with_output else None, mixes, n_tokens)
    stage.post_mix(fused, cuda.to_device(a) if with_output else None, mixes, n_tokens, then=then)
    new_h = fused.copy_to_host()[:n_tokens]
    assert np.array_equal(new_h.view(np.uint32), alone.copy_to_host()[:n_tokens].view(np.uint32))
    stage.mixes(fused, then, n_tokens)
    assert_mixes(stage, pre, want_mixes(oracle, cfg, new_h, layer, kind), n_tokens)


@pytest.mark.parametrize("preset,n_tokens", [("tiny", T), ("small", 3), ("small", 11)])
def test_mixes_post(stages, preset, n_tokens):
    """11 tokens: past POST_PRODUCT_MAX_TOKENS, where the launches are those of the sublayer alone."""
    check_mixes_post(*stages(preset), 1, n_tokens)


def check_mixes_post(model, oracle, stage, layer, n_tokens):
    """The FFN sublayer in one launch (mixes_post) against its launches one by one (mixes from the
    attention post's product, post_mix forming the next attention mixes' product): the same pre,
    new h and next product, bit for bit; pre within test_mixes' bound of the oracle's."""
    cfg = model.config
    h = highway(cfg, 15, n_tokens)
    a = to_bits(bf16(np.random.default_rng(16).standard_normal((n_tokens, cfg.dim)).astype(np.float32)))
    attn = stage.mixes(cuda.to_device(h), stage.sublayer(layer, "attn", buffer(cfg, n_tokens)), n_tokens)
    pre_alone, pre_fused = buffer(cfg, n_tokens), buffer(cfg, n_tokens)
    ffn_alone = stage.sublayer(layer, "ffn", pre_alone, after_post=True)
    ffn_fused = stage.sublayer(layer, "ffn", pre_fused, after_post=True)  # the same product, another pre
    then = stage.sublayer(layer + 1, "attn", buffer(cfg, n_tokens), after_post=True)
    attn_out = cuda.to_device(h)
    stage.post_mix(attn_out, cuda.to_device(a), attn, n_tokens, then=ffn_alone)
    h_attn = attn_out.copy_to_host()[:n_tokens]
    alone, fused = cuda.to_device(h_attn), cuda.to_device(h_attn)
    stage.post_mix(alone, None, stage.mixes(alone, ffn_alone, n_tokens), n_tokens, then=then)
    product_alone = then.product.copy_to_host()[:n_tokens]
    stage.mixes_post(fused, ffn_fused, n_tokens, then)
    for got, want in ((fused, alone), (pre_fused, pre_alone)):
        assert got.copy_to_host()[:n_tokens].tobytes() == want.copy_to_host()[:n_tokens].tobytes()
    assert then.product.copy_to_host()[:n_tokens].tobytes() == product_alone.tobytes()
    assert_within(pre_fused.copy_to_host()[:n_tokens], want_mixes(oracle, cfg, h_attn, layer, "ffn")[0], 1e-6, "pre")


@pytest.mark.parametrize("fn_type,fuses", [("F16", True), ("BF16", True), ("Q8_0", False), ("Q2_K", False)])
def test_fn_types(synth_model, fn_type, fuses):
    """The post kernel reads F32 (the presets'), F16 and BF16 mix weights; the K-quants and Q8_0
    keep the product launch of `mixes` (HyperStage.plan asks `fuses`)."""
    model = flashv41.load_model(synth_model("small", type_map={"hc_attn_fn": fn_type, "hc_ffn_fn": fn_type}))
    oracle, stage = Oracle(model, max_seq=64), HyperStage(model, max_tokens=16)
    try:
        assert stage.fuses(1, "ffn") is fuses
        if fuses:
            check_post_with_next_product(model, oracle, stage, 1, "ffn", 3, True)
    finally:
        stage.free()


@pytest.mark.parametrize("fn_types,attn_formed,ffn_formed,in_one", [
    (None, [2, 3, 4, 5], [0, 1, 2, 3, 4, 5], [1, 2, 3, 4]),
    (("Q8_0", "F16"), [], [0, 1, 2, 3, 4, 5], []),
    (("BF16", "Q8_0"), [2, 3, 4, 5], [], []),
])
def test_plan(synth_model, fn_types, attn_formed, ffn_formed, in_one):
    """HyperStage.plan on the tiny preset's six layers (engram layers 0 and 1; F32 mixes unless
    the attention's and FFN's fn types are given): a post forms the next mixes' product where the
    post kernel reads their fn, but not the first layer's attention mixes nor an engram layer's;
    an FFN sublayer between two such posts is one launch; each FFN's pre is the next layer's
    pre_in, and layer 0's is the buffer upload_first_mix fills with the one-hot."""
    kwargs = {} if fn_types is None else {"type_map": {"hc_attn_fn": fn_types[0], "hc_ffn_fn": fn_types[1]}}
    model = flashv41.load_model(synth_model("tiny", **kwargs))
    stage = HyperStage(model, max_tokens=4)
    try:
        plan = stage.plan([role.layer for role in model.config.roles if role.engram])
        assert [i for i, hc in enumerate(plan) if hc.attn.product is not None] == attn_formed
        assert [i for i, hc in enumerate(plan) if hc.ffn.product is not None] == ffn_formed
        assert [i for i, hc in enumerate(plan) if hc.ffn_in_one] == in_one
        for i, hc in enumerate(plan):
            assert (hc.attn.layer, hc.attn.kind, hc.ffn.layer, hc.ffn.kind) == (i, "attn", i, "ffn")
            assert hc.attn_then is (hc.ffn if i in ffn_formed else None)
            assert hc.ffn_then is (plan[i + 1].attn if i + 1 in attn_formed else None)
            if i + 1 < len(plan):
                assert hc.ffn.pre is plan[i + 1].pre_in and hc.attn.pre is not hc.pre_in
        stage.upload_first_mix(3)
        one_hot = np.zeros((3, model.config.hc), np.float32)
        one_hot[:, 0] = 1
        assert np.array_equal(plan[0].pre_in.copy_to_host()[:3], one_hot)
    finally:
        stage.free()
        model.close()


@pytest.fixture(scope="module")
def flash(synth_model):
    """The flash preset's hc 4 x 5120 in two window-only layers, F16 attention and BF16 FFN mixes."""
    model = flashv41.load_model(synth_model("flash", type_map={"hc_attn_fn": "F16", "hc_ffn_fn": "BF16"},
                                            compress_ratios=(0, 0), kv_sources=(), index_sources=(),
                                            candidate_source=99, engram_layers=(), vocab=1024))
    stage = HyperStage(model, max_tokens=8)
    yield model, Oracle(model, max_seq=64), stage
    stage.free()
    model.close()


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens", [1, 3, 8])
def test_flash_glue(flash, n_tokens):
    """At V4.1-Flash size (hc 4 x 5120), the real kernel paths: mixes_norm (x, pre, post, comb),
    post_mix forming each sublayer's next product (F16 and BF16 fn), the mixes from it, the FFN
    sublayer in one launch (mixes_post); mixes_norm's results for each token the bits it gets
    alone (T = 1)."""
    model, oracle, stage = flash
    cfg = model.config
    h = highway(cfg, 13, n_tokens)
    pre_in = np.random.default_rng(14).uniform(0.1, 1.0, (n_tokens, cfg.hc)).astype(np.float32)

    def run(rows):
        x = cuda.device_array((8, cfg.dim), np.uint16)
        pre = cuda.device_array((8, cfg.hc), np.float32)
        stage.mixes_norm(cuda.to_device(h[rows]), stage.sublayer(1, "attn", pre), cuda.to_device(pre_in[rows]), x,
                         len(rows))
        got = [x.copy_to_host()[:len(rows)], pre.copy_to_host()[:len(rows)], stage.post.copy_to_host()[:len(rows)],
               stage.comb.copy_to_host()[:len(rows)]]
        return got, x, pre

    rows = list(range(n_tokens))
    got, x, pre = run(rows)
    assert_pre_norm(x, h, pre_in, oracle, cfg, 1, n_tokens)
    assert_mixes(stage, pre, want_mixes(oracle, cfg, h, 1, "attn"), n_tokens)
    for t in rows[1:]:
        alone, _, _ = run([t])
        for a, b in zip(got, alone, strict=True):
            assert a[t:t + 1].tobytes() == b.tobytes()
    for layer, kind in ((1, "ffn"), (0, "attn")):
        check_post_with_next_product(model, oracle, stage, layer, kind, n_tokens, kind == "ffn")
    check_mixes_post(model, oracle, stage, 0, n_tokens)

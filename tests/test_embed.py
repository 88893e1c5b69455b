"""stages.hyper's embedding (HyperStage.embed, embed_kernel) against the oracle's (Oracle.embed):
the same bits in every copy of h, and the rows past the tokens untouched. The kernel's blocks take
EMBED_THREADS chunks of a row: the tiny preset's row is one chunk (a block's first thread alone),
the small preset's eight (two blocks on the simulator), the flash preset's 160 (on a GPU: a block
of 128 and one of 32)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda  # noqa: E402  (after conftest chose the backend)

import flashv41
from flashv41.host.oracle import Oracle
from flashv41.stages.hyper import HyperStage  # noqa: E402

IDS = np.array([0, 5, 127, 64, 3, 5])  # a repeated id; the first and last of the tiny vocabulary


def check_embed(model, ids: np.ndarray, pad: int = 3) -> None:
    """HyperStage.embed's h [T + pad, hc, C] against the oracle's rows in each copy, bit for bit; the
    pad rows (NaN before) untouched."""
    cfg = model.config
    n = len(ids)
    stage = HyperStage(model, max_tokens=n + pad)
    try:
        h = cuda.to_device(np.full((n + pad, cfg.hc, cfg.dim), np.nan, np.float32))
        stage.embed(ids, h, n)
        got = h.copy_to_host()
        want = np.repeat(Oracle(model, max_seq=64).embed(ids)[:, None, :], cfg.hc, axis=1)
        wrong = got[:n].view(np.uint32) != want.view(np.uint32)
        assert not wrong.any(), (f"{int(wrong.sum())} of {wrong.size} values off the oracle's bits, the first at "
                                 f"{np.argwhere(wrong)[0].tolist()} (token, copy, d)")
        assert np.isnan(got[n:]).all(), "rows past the tokens were written"
    finally:
        stage.free()


@pytest.mark.parametrize("preset,weight_type", [("tiny", "Q8_0"), ("small", "Q8_0"), ("small", "BF16"),
                                                ("small", "Q4_K")])
def test_embed_is_exact(synth_model, preset, weight_type):
    with flashv41.load_model(synth_model(preset, weight_type=weight_type)) as model:
        check_embed(model, IDS)


def test_decode_token(small_path):
    """One token (a decode step), at the end of the small vocabulary."""
    with flashv41.load_model(small_path) as model:
        check_embed(model, np.array([model.config.vocab_size - 1]))


@pytest.mark.gpu
def test_flash_chunk(synth_model):
    """A 509-token chunk at the flash dimensions (hc 4 x 5120, Q8_0 rows)."""
    with flashv41.load_model(synth_model("flash", compress_ratios=(0,), kv_sources=(), index_sources=(),
                                         candidate_source=99, engram_layers=(), vocab=4096)) as model:
        check_embed(model, np.random.default_rng(1).integers(0, 4096, 509))

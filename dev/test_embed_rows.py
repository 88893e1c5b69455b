"""dev/embed_rows.py against stages.hyper's embed kernel and the oracle's embedding: the same bits
(`python -m pytest dev/test_embed_rows.py`, outside the suite's testpaths: a dev/ kernel).
`python -m dev.test_embed_rows` times the two on a GPU: a 512-token chunk of the flash preset's
embedding (Q8_0 rows of 5120, hc 4)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

import flashv41
from dev.embed_rows import embed_rows
from flashv41.host.oracle import Oracle
from flashv41.host.synth import write_synthetic
from flashv41.stages.device import SIM
from flashv41.stages.hyper import HyperStage

GPU_ONLY = pytest.mark.skipif(SIM, reason="flash size: on a GPU")


def check(model, ids: np.ndarray, pad: int = 3) -> None:
    """embed_rows' h against the stage's and the oracle's embedding, bit for bit; rows past the
    tokens untouched."""
    cfg = model.config
    stage = HyperStage(model, max_tokens=len(ids) + pad)
    try:
        n = len(ids)
        stage.upload_ids(ids, n)
        want = cuda.device_array((n + pad, cfg.hc, cfg.dim), np.float32)
        stage.embed_uploaded(want, n)
        got = cuda.to_device(np.full((n + pad, cfg.hc, cfg.dim), np.nan, np.float32))
        embed_rows(stage.ids, stage.embedding, got, n, stage.stream)
        got_h = got.copy_to_host()
        assert np.array_equal(got_h[:n].view(np.uint32), want.copy_to_host()[:n].view(np.uint32))
        oracle = np.repeat(Oracle(model, max_seq=64).embed(ids)[:, None, :], cfg.hc, axis=1)
        assert np.array_equal(got_h[:n].view(np.uint32), oracle.view(np.uint32))
        assert np.isnan(got_h[n:]).all(), "rows past the tokens were written"
    finally:
        stage.free()


@pytest.mark.parametrize("preset,weight_type", [("tiny", "Q8_0"), ("small", "Q8_0"), ("small", "BF16"),
                                                ("small", "Q4_K")])
def test_same_bits_as_the_stage(synth_model, preset, weight_type):
    """tiny: one chunk a row (a block's first thread alone); small: eight (two blocks on the
    simulator)."""
    with flashv41.load_model(synth_model(preset, weight_type=weight_type)) as model:
        check(model, np.array([0, 5, 127, 64, 3, 5]))


@GPU_ONLY
def test_flash_chunk(synth_model):
    """A 509-token chunk of the flash dimensions (hc 4 x 5120, Q8_0 rows)."""
    with flashv41.load_model(synth_model("flash", compress_ratios=(0,), kv_sources=(), index_sources=(),
                                         candidate_source=99, engram_layers=(), vocab=4096)) as model:
        check(model, np.random.default_rng(1).integers(0, 4096, 509))


def time_them(tokens: int = 512, reps: int = 20) -> None:
    """Median device time of the stage's embed and embed_rows, from CUDA events."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        model = flashv41.load_model(write_synthetic(Path(folder) / "flash.gguf", "flash", compress_ratios=(0,),
                                                    kv_sources=(), index_sources=(), candidate_source=99,
                                                    engram_layers=(), vocab=16384))
        cfg = model.config
        stage = HyperStage(model, max_tokens=tokens)
        stage.upload_ids(np.random.default_rng(2).integers(0, 16384, tokens), tokens)
        h = cuda.device_array((tokens, cfg.hc, cfg.dim), np.float32)
        bound_us = h.nbytes / 3.0e12 * 1e6
        line = [f"T={tokens}: the highway's {h.nbytes / 1e6:.0f} MB written once at 3.0 TB/s: {bound_us:.1f} us"]
        for label, run in (("stage embed", lambda: stage.embed_uploaded(h, tokens)),
                           ("embed_rows", lambda: embed_rows(stage.ids, stage.embedding, h, tokens, stage.stream))):
            run()
            times = []
            for _ in range(reps):
                start, end = cuda.event(), cuda.event()
                start.record(stage.stream)
                run()
                end.record(stage.stream)
                end.synchronize()
                times.append(cuda.event_elapsed_time(start, end) * 1e3)
            median = float(np.median(times))
            line.append(f"{label} {median:7.1f} us ({median / bound_us:4.1f}x)")
        print(" | ".join(line), flush=True)
        stage.free()
        model.close()


if __name__ == "__main__":
    from flashv41.stages.backend import select_backend

    select_backend()
    if SIM:
        sys.exit("dev.test_embed_rows times kernels on a GPU")
    time_them(int(sys.argv[1]) if len(sys.argv) > 1 else 512)

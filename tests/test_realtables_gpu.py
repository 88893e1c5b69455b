"""Engram tables of V4.1-Flash's real size on the GPU (issue 18): the two official tables of
384,006,168 and 384,016,682 Q2_K rows (32.3 GB each) as sparse files.

- `flash-realtables` (the 40-layer schedule, every matrix and table a hole) loads in seconds; an
  engine with pinned tables holds its engram stage in under 2 GB of device memory (the driver's
  free-memory figure around its set-up) and decodes in CUDA graphs.
- A two-layer cut of it (two window layers, each with its real table; matrices drawn), with the
  rows a prompt hashes to written as random Q2_K blocks: prefill and graph decode give the same
  bits with pinned tables as with device tables, and the rows gathered are those written, not the
  holes' zeros (so the comparison is not of two zero tables).

Each test moves the tables' 64.6 GB once per residency (upload or pinning), out of the file's pages.
The files go to FLASHV41_BIG_TMP when set (a disk, not a RAM-backed /tmp: the holes' pages are
read into the page cache).
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

import flashv41
from flashv41.bench.engram import random_stored
from flashv41.host import gguf_layout as L
from flashv41.host.engram_hash_fast import FastEngramHasher
from flashv41.host.quants import GGMLType
from flashv41.host.synth import REAL_TABLE_ROWS, write_synthetic
from flashv41.memory import device_free_bytes

pytestmark = pytest.mark.gpu

ENGRAM_DEVICE_LIMIT = 2 << 30  # issue 18: the engram part with pinned tables, under 2 GB
# the cut: two window-only layers, engram before each, the real tables
VOCAB = 4096
CUT = dict(compress_ratios=(0, 0), kv_sources=(), index_sources=(), candidate_source=99, engram_layers=(0, 1),
           vocab=VOCAB, holes="tables")


@pytest.fixture(scope="module")
def big_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = os.environ.get("FLASHV41_BIG_TMP")
    if root:
        path = Path(root) / "realtables"
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("realtables")


def table_names(model) -> list[str]:
    assert model.config.engram is not None
    return [model.tensor(layer, L.ENGRAM_TABLE).name for layer in model.config.engram.layer_ids]


@pytest.mark.device_memory
def test_real_preset_pinned(big_dir: Path) -> None:
    path = big_dir / "flash-realtables.gguf"
    if not path.exists():
        write_synthetic(path, "flash-realtables")
    start = time.perf_counter()
    model = flashv41.load_model(path)
    load_s = time.perf_counter() - start
    with model:
        cfg = model.config
        assert cfg.engram is not None and cfg.engram.table_rows == REAL_TABLE_ROWS
        assert len(cfg.roles) == 40
        assert load_s < 10, f"loading the real-size preset took {load_s:.1f} s"
        # the driver's free memory at each set-up step: the engram stage is built between the
        # "uploading engram" line and the next (which also allocates the engine's few-MB buffers)
        free: list[tuple[str, int]] = []
        # what earlier tests in this process left for the collector is freed now, not inside the
        # step counted below (in the first whole GPU suite run, 2026-12-07, this test failed
        # after others and passed alone)
        gc.collect()
        device_free_bytes()
        start = time.perf_counter()
        with flashv41.Engine(model, max_seq=256, max_tokens=64, table_residency="pinned",
                             progress=lambda line: free.append((line, device_free_bytes()))) as engine:
            setup_s = time.perf_counter() - start
            assert engine.engram is not None and engine.graphs
            at = next(i for i, (line, _) in enumerate(free) if line.startswith("uploading engram"))
            taken = free[at][1] - free[at + 1][1]
            counted = engine.engram.device_bytes
            pinned = engine.engram.pinned_bytes
            print(f"load {load_s:.2f} s, engine {setup_s:.1f} s; engram stage {taken / 2**20:.0f} MiB of device memory "
                  f"(it counts {counted / 2**20:.0f} MiB), {pinned / 2**30:.1f} GiB pinned")
            assert taken < ENGRAM_DEVICE_LIMIT, f"the engram stage took {taken} device bytes"
            assert counted <= taken, f"the engram stage counts {counted} device bytes, the driver {taken}"
            assert pinned == sum(rows * 84 for rows in REAL_TABLE_ROWS)  # Q2_K: 84 bytes a 256-value row
            seq = engine.new_sequence()
            seq.prefill(np.arange(20) % cfg.vocab_size)
            for tok in (3, 4, 5, 6):
                out = seq.decode(tok)
                assert np.isfinite(out).all()
            assert len(seq.graphs) >= 1, "decode with pinned tables did not replay a graph"
            seq.release()
    device_free_bytes()


def cut_model(big_dir: Path) -> Path:
    """The two-layer cut, written once, with random Q2_K rows where `prompt_tokens()` hashes."""
    path = big_dir / "flash-realtables-cut.gguf"
    if path.exists():
        return path
    tmp = path.with_suffix(".partial")
    write_synthetic(tmp, "flash-realtables", **CUT)
    with flashv41.load_model(tmp) as model:
        engram = model.config.engram
        assert engram is not None and engram.table_rows == REAL_TABLE_ROWS
        ids = FastEngramHasher(engram, 64).hash(prompt_tokens(), 0)  # [T, layers, cols]
        names = table_names(model)
    offsets = {t.name: int(t.data_offset) for t in GGUFReader(tmp).tensors}
    rng = np.random.default_rng(7)
    for i, name in enumerate(names):
        rows = np.unique(ids[:, i, :])
        table = np.memmap(tmp, np.uint8, "r+", offset=offsets[name], shape=(REAL_TABLE_ROWS[i], 84))
        table[rows] = random_stored(rows.size, 256, GGMLType.Q2_K, rng)
        table.flush()
        del table
    tmp.rename(path)
    return path


def prompt_tokens() -> np.ndarray:
    """16 prompt tokens, then 6 decoded one by one."""
    return np.random.default_rng(8).integers(0, VOCAB, 22)


def test_pinned_equals_device(big_dir: Path) -> None:
    tokens = prompt_tokens()
    outs: dict[str, list[np.ndarray]] = {}
    with flashv41.load_model(cut_model(big_dir)) as model:
        for residency in ("device", "pinned"):
            start = time.perf_counter()
            with flashv41.Engine(model, max_seq=64, max_tokens=16, table_residency=residency) as engine:
                print(f"{residency}: engine set up in {time.perf_counter() - start:.1f} s")
                assert engine.engram is not None and engine.graphs
                seq = engine.new_sequence()
                got = [seq.prefill(tokens[:16])]
                rows = engine.engram.rows.copy_to_host()[:16]
                assert np.count_nonzero(rows) > rows.size // 2, "the gathered rows are the holes' zeros"
                got += [seq.decode(int(tok)) for tok in tokens[16:]]
                assert len(seq.graphs) >= 1, f"decode with {residency} tables did not replay a graph"
                seq.release()
            outs[residency] = got
            device_free_bytes()  # numba's deferred frees of the closed engine's memory, done now
    for i, (a, b) in enumerate(zip(outs["device"], outs["pinned"], strict=True)):
        differ = int((a != b).sum())
        assert differ == 0, f"call {i}: pinned tables differ from device tables in {differ} values"

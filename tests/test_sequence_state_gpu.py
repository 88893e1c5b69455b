"""Fork, truncate and save / load on a real GPU at V4.1-Flash dimensions (the six-layer flash preset:
every block type, window 128), with CUDA graphs: tests/test_sequence_state.py's claims, where the
kernels' sums depend on a call's token count, so every comparison is with a fresh sequence that ran
the same calls (bit for bit in outputs and in every array of the state).

The prompt P is 300 tokens in calls of 64 (the last one 44: past the window's wrap, ending in the
middle of a ratio-2 group); X and Y are continuations of 8 decode steps, replayed from each
sequence's graphs. Then the speculative example on the same model: the same tokens as plain
decoding, the kept state bit for bit, and its accepted-token rate printed. tools/sequence_timing.py
times fork, truncate and save / load at 64k positions; a smaller run of it checks it here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import flashv41
from tests.test_sequence_state import assert_same, bits_equal, snapshot

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
MAX_SEQ, MAX_TOKENS = 1024, 64
IDS = np.random.default_rng(451).integers(0, 2048, 400)
P, X, Y, Z = IDS[:300], IDS[300:308], IDS[308:316], IDS[316:330]


# the tests of `refs` (an engine, two prompts and their graphs: minutes of compiling) on one worker of
# the GPU suite (tools/gpu_suite.sh's --dist loadgroup; other runs ignore the mark)
SHARES_REFS = pytest.mark.xdist_group("sequence_state_refs")


def flash_path(synth_model) -> Path:
    return synth_model("flash", vocab=2048, engram_rows=120_000, context_length=4096)


def prompt(seq: flashv41.Sequence) -> None:
    seq.prefill(P)  # in calls of 64: 0, 64, 128, 192, 256 (44 tokens)


@pytest.fixture(scope="module")
def flash(synth_model):
    model = flashv41.load_model(flash_path(synth_model))
    engine = flashv41.Engine(model, max_seq=MAX_SEQ, max_tokens=MAX_TOKENS)
    assert engine.graphs
    yield model, engine
    engine.close()
    model.close()


@pytest.fixture(scope="module")
def refs(flash, tmp_path_factory):
    _, engine = flash
    rx, ry = engine.new_sequence(), engine.new_sequence()
    prompt(rx)
    s300 = snapshot(rx)
    saved = tmp_path_factory.mktemp("saved") / "p.npz"
    rx.save(saved)
    out_x = [rx.decode(int(t)) for t in X]
    prompt(ry)
    out_y = [ry.decode(int(t)) for t in Y]
    yield {"s300": s300, "x": out_x, "y": out_y, "saved": saved}
    rx.release()
    ry.release()


@SHARES_REFS
def test_fork_on_the_gpu(flash, refs) -> None:
    """(a) A fork and its parent decode other tokens, each from its own graphs: the fresh
    sequences' outputs, bit for bit; both rewind to P (the fork by a copy, the parent from its
    checkpoint at 256, running P's last call again)."""
    _, engine = flash
    a = engine.new_sequence()
    prompt(a)
    b = a.fork()
    assert_same(snapshot(b), refs["s300"], "the fork")
    for i, (x, y) in enumerate(zip(X, Y, strict=True)):
        assert bits_equal(b.decode(int(y)), refs["y"][i]), f"fork, step {i}"
        assert bits_equal(a.decode(int(x)), refs["x"][i]), f"parent, step {i}"
    a.truncate(300)
    b.truncate(300)
    assert_same(snapshot(a), refs["s300"], "the parent truncated")
    assert_same(snapshot(b), refs["s300"], "the fork truncated")
    a.release()
    b.release()


@SHARES_REFS
def test_truncate_on_the_gpu(flash, refs) -> None:
    """(b) P's last 44 tokens and 10 more in one call, then 4 decode steps from graphs; truncated to
    300 (that call run again as P's 44), then X decoded from the graphs captured past 310: the
    fresh sequence's outputs, bit for bit."""
    _, engine = flash
    u = engine.new_sequence()
    u.prefill(P[:256])
    u.prefill(np.r_[P[256:], Z[:10]])
    for t in Z[10:]:
        u.decode(int(t))
    u.truncate(300)
    assert_same(snapshot(u), refs["s300"], "truncated to 300")
    for i, t in enumerate(X):
        assert bits_equal(u.decode(int(t)), refs["x"][i]), f"decode step {i} after the truncate"
    u.release()


@SHARES_REFS
def test_save_load_on_the_gpu(flash, refs) -> None:
    """(c) P saved, loaded into a new engine and continued with X: as continued in place."""
    model, _ = flash
    with flashv41.Engine(model, max_seq=MAX_SEQ, max_tokens=MAX_TOKENS) as other:
        seq = other.load_sequence(refs["saved"])
        assert_same(snapshot(seq), refs["s300"], "loaded")
        for i, t in enumerate(X):
            assert bits_equal(seq.decode(int(t)), refs["x"][i]), f"decode step {i} after the load"


def load_script(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_speculative_example_at_flash_dimensions(synth_model, capsys: pytest.CaptureFixture[str]) -> None:
    """The example's verify calls of K + 1 = 5 tokens run the decode step's kernels: the same tokens
    as plain decoding and the same state, bit for bit; its accepted-token rate is printed."""
    example = load_script(ROOT / "examples" / "speculative.py", "examples_speculative_gpu")
    status = example.main(["--model", str(flash_path(synth_model)), "--prompt-len", "64", "--tokens", "48",
                           "--draft", "4"])
    out = capsys.readouterr().out
    print(out)
    assert status == 0, out


def test_the_timing_script_runs(synth_model, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """tools/sequence_timing.py on the test's flash model at 4k positions (its 64k run on the
    flash preset writes a 2.4 GB model and takes minutes)."""
    timing = load_script(ROOT / "tools" / "sequence_timing.py", "sequence_timing")
    assert timing.main(["--model", str(flash_path(synth_model)), "--max-seq", "4096", "--workdir", str(tmp_path),
                        "--reps", "3"]) == 0
    out = capsys.readouterr().out
    print(out)
    for row in ("fork", "checkpoint", "truncate to the checkpoint", "truncate, 2 tokens run again", "save", "load"):
        assert f"\n  {row} " in out, row

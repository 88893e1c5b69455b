"""The engine on a real GPU: the small preset and a few flash-sized layers against the oracle,
device memory returned by `release` and `close` (the driver's free-memory figure), and bitwise
determinism run to run. Agreement as in tests/test_engine.py."""

from __future__ import annotations

import numpy as np
import pytest

import flashv41
from flashv41.check import Flips, agreement
from flashv41.host.oracle import Oracle
from flashv41.memory import device_free_bytes
from tests.test_engine import assert_flips_rare, compare_call

pytestmark = pytest.mark.gpu

FLASH3 = dict(vocab=2048, compress_ratios=(0, 2, 2), kv_sources=(1,), index_sources=(1,), candidate_source=99,
              engram_layers=(0, 1), engram_rows=120_000, context_length=4096)
# every branch a captured step forks (stages.branches): kv + index sources of both ratios, the
# candidate source, an index source without a kv source after it, and an engram layer whose
# rows and projection run beside three layers
FLASH4 = dict(vocab=2048, compress_ratios=(0, 2, 1, 1), kv_sources=(1, 2), index_sources=(1, 2, 3),
              candidate_source=2, engram_layers=(0, 3), engram_rows=120_000, context_length=4096)


def flash3(wtype: str) -> dict:
    """FLASH3's arguments with attention and engram weights of type wtype (Q8_0: FLASH3's file)."""
    return FLASH3 if wtype == "Q8_0" else dict(FLASH3, weight_type=wtype)


def run_and_check(engine, oracle, ids, prompt, chunked, what):
    """Prefill `prompt` tokens in calls of `chunked`, then decode the rest one by one, comparing
    every call layer by layer (tests/test_engine.py's compare_call); the run's flips must be rare."""
    seq, ref = engine.new_sequence(), oracle.new_sequence()
    run = Flips()
    for s in range(0, prompt, chunked):
        compare_call(seq, ref, ids[s:min(prompt, s + chunked)], f"prefill at {s}", run=run)
    for i, tok in enumerate(ids[prompt:]):
        compare_call(seq, ref, np.array([tok]), f"decode at {prompt + i}", run=run)
    seq.release()
    assert_flips_rare(run, what)


def test_small_prefill_chunks_and_decode(synth_model):
    model = flashv41.load_model(synth_model("small"))
    with flashv41.Engine(model, max_seq=128, max_tokens=32) as engine:
        oracle = Oracle(model, max_seq=128)
        ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 40 + 3 * model.config.window)
        run_and_check(engine, oracle, ids, 40, chunked=16, what="small")


# (weight type, prefill call): the products each default path picks (stages.linear.pick_kernel)
# at flash sizes: Q8_0 in calls of 64 (narrow) and of 200 (pipe), Q4_K in calls of 200 (tc) with
# its decode steps' wq_b, wo_a, wo_b and engram wkv on imma
PICKED_PATHS = [("Q8_0", 64), ("Q8_0", 200), ("Q4_K", 200)]


@pytest.mark.parametrize("wtype,chunked", PICKED_PATHS, ids=[f"{t}-{c}" for t, c in PICKED_PATHS])
def test_flash_dimension_layers(synth_model, wtype, chunked):
    """Three layers at V4.1-Flash sizes (window only + engram, ratio-2 kv/index source + engram,
    ratio-2 consumer), a Q2_K engram table: 200 tokens in calls of `chunked`, then decode."""
    model = flashv41.load_model(synth_model("flash", **flash3(wtype)))
    with flashv41.Engine(model, max_seq=512, max_tokens=max(64, chunked)) as engine:
        oracle = Oracle(model, max_seq=512)
        ids = np.random.default_rng(1).integers(0, 2048, 204)
        run_and_check(engine, oracle, ids, 200, chunked=chunked, what=f"flash layers, {wtype}")


@pytest.mark.device_memory
def test_release_and_close_return_device_memory(synth_model):
    """Sequences give back all they take, and so do engines, to the byte. What a process's first
    engine and prefill take once stays with the process: the modules of the kernels they are the
    first to launch, and the driver's local-memory reservation, which grows when a kernel needing
    more stack first runs. So one engine runs a round and closes before the count starts (counted
    from before it, the first GPU suite run lost 8 MiB here, 2026-12-07, H100, the test first in
    its process). After that, twenty rounds of sequences must not take a byte, and each engine
    closed must give back all but at most one 2 MiB page of the driver's small-allocation pool
    (test_reliability_memory's allowance), each checked alone, so a leak names the step that made
    it."""
    import gc

    model = flashv41.load_model(synth_model("small"))

    def round_of_sequences(engine) -> None:
        seqs = [engine.new_sequence() for _ in range(3)]
        for seq in seqs:
            seq.prefill(np.arange(5))
        for seq in seqs:
            seq.release()

    with flashv41.Engine(model, max_seq=128, max_tokens=16) as first:
        round_of_sequences(first)
    gc.collect()
    before = device_free_bytes()
    engine = flashv41.Engine(model, max_seq=128, max_tokens=16)
    round_of_sequences(engine)
    with_engine = device_free_bytes()
    for _ in range(20):
        round_of_sequences(engine)
    after = device_free_bytes()
    assert after >= with_engine, f"sequences leaked {with_engine - after} bytes of device memory"
    engine.close()
    gc.collect()
    page = 2 << 20  # the driver hands small allocations out of 2 MiB pages
    closed = device_free_bytes()
    assert closed >= before - page, f"an engine that ran 21 rounds leaked {before - closed} bytes once closed"
    for i in range(3):
        flashv41.Engine(model, max_seq=128, max_tokens=16).close()
        gc.collect()
        now = device_free_bytes()
        assert now >= before - page, f"bare engine {i} leaked {before - now} bytes once closed"


def test_bitwise_deterministic(synth_model):
    model = flashv41.load_model(synth_model("small"))
    ids = np.random.default_rng(2).integers(0, model.config.vocab_size, 24)
    runs = []
    with flashv41.Engine(model, max_seq=64, max_tokens=16) as engine:
        for _ in range(3):
            seq = engine.new_sequence()
            outs = [seq.prefill(ids[:20])] + [seq.decode(int(t)) for t in ids[20:]]
            runs.append(np.concatenate(outs))
            seq.release()
    assert all(np.array_equal(runs[0].view(np.uint32), r.view(np.uint32)) for r in runs[1:])


GRAPH_PRESETS = ["small", "flash3", "flash4", "flash3-Q4_K"]
GRAPH_STEPS = 48


def graph_model(synth_model, preset: str):
    flash = {"flash3": FLASH3, "flash4": FLASH4, "flash3-Q4_K": flash3("Q4_K")}
    path = synth_model("small") if preset == "small" else synth_model("flash", **flash[preset])
    return flashv41.load_model(path)


def decode_steps(model, graphs: bool, free: list[int] | None = None) -> tuple[np.ndarray, int]:
    """GRAPH_STEPS decode steps of one sequence, over every graph key (a first step with nothing to
    score, group completions or not, masked tokens or not): (the highways, the graphs the sequence
    captured). `free`, where given, receives the GPU's free memory before the middle step and after
    the last (the engine still open)."""
    ids = np.random.default_rng(5).integers(0, model.config.vocab_size, GRAPH_STEPS)
    masks = [None if i % 5 else bool(i % 10) for i in range(GRAPH_STEPS)]
    with flashv41.Engine(model, max_seq=256, max_tokens=16, graphs=graphs) as engine:
        assert engine.graphs == graphs
        seq = engine.new_sequence()
        got = []
        for i in range(GRAPH_STEPS):
            if i == GRAPH_STEPS // 2 and free is not None:
                free.append(device_free_bytes())
            got.append(seq.decode(int(ids[i]), masks[i]))
        if free is not None:
            free.append(device_free_bytes())
        return np.concatenate(got), len(seq.graphs)


@pytest.mark.parametrize("preset", GRAPH_PRESETS)
def test_graph_decode_is_eager_decode(synth_model, preset):
    """Decode replayed from CUDA graphs gives the eager launches' results bit for bit, over steps of
    every graph key."""
    model = graph_model(synth_model, preset)
    eager, _ = decode_steps(model, False)
    replayed, graphs = decode_steps(model, True)
    assert graphs >= 4, f"only {graphs} graphs were captured"
    assert np.array_equal(eager.view(np.uint32), replayed.view(np.uint32)), \
        f"graph decode differs from eager decode: agreement {agreement(replayed, eager)}"


@pytest.mark.device_memory
@pytest.mark.parametrize("preset", GRAPH_PRESETS)
def test_graph_decode_allocates_nothing(synth_model, preset):
    """Once every graph key has its graph, a replayed decode step allocates no device memory
    (docs/performance.md M1; imma's workspaces included, flash3-Q4_K). It reads the GPU's free
    memory: run alone (test_graph_decode_is_eager_decode, which needs no such quiet, runs the same
    steps eagerly too, among the other workers)."""
    model = graph_model(synth_model, preset)
    free: list[int] = []
    _, graphs = decode_steps(model, True, free)
    assert graphs >= 4, f"only {graphs} graphs were captured"
    assert free[1] == free[0], f"graph decode steps allocated {free[0] - free[1]} bytes of device memory"


def check_batch_equals_each_alone(model, prompt_lengths: tuple[int, ...], steps: int) -> None:
    """Sequences prefilled to prompt_lengths decode `steps` steps together (the batch's graph
    captured at the second step and replayed from the third); each row must equal the sequence's
    own graph-replayed decode bit for bit (B <= 8: the same product kernels and attention path)."""
    vocab = model.config.vocab_size
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, vocab, n) for n in prompt_lengths]
    nexts = [rng.integers(0, vocab, steps) for _ in prompts]
    with flashv41.Engine(model, max_seq=512, max_tokens=64) as engine:
        alone = []
        for prompt, nxt in zip(prompts, nexts, strict=True):
            seq = engine.new_sequence()
            seq.prefill(prompt)
            alone.append([seq.decode(int(t)) for t in nxt])
            seq.release()
        seqs = [engine.new_sequence() for _ in prompts]
        for seq, prompt in zip(seqs, prompts, strict=True):
            seq.prefill(prompt)
        for step in range(steps):
            got = engine.decode_batch(seqs, [int(n[step]) for n in nexts])
            for b in range(len(seqs)):
                differ = int((got[b] != alone[b][step][0]).sum())
                assert differ == 0, f"step {step}: sequence {b} differs from its own decode in {differ} values"
        assert len(engine._batch_graphs) == 1, "the batch's steps share one graph"


def test_small_batch_decode_equals_each_alone(synth_model):
    """The small preset (window 16, every block type): eight sequences at positions 3 to 40, across
    the window's wrap and both compressor ratios' groups, six steps together."""
    model = flashv41.load_model(synth_model("small"))
    check_batch_equals_each_alone(model, (3, 14, 15, 16, 17, 30, 33, 40), 6)


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_K", "Q2_K"])
def test_flash_batch_decode_equals_each_alone(synth_model, wtype):
    """decode_batch at V4.1-Flash sizes (the three layers above): three sequences at positions 9,
    127 and 130 (before the window's first wrap, across it and past it; odd and even, so the
    ratio-2 groups complete in some and not others), five steps together. Each type takes imma for
    some matrices and stream for the rest (linear_imma.decode_pick): Q8_0 the tall wq_b alone, Q4_K
    every large one, Q2_K those with N >= K."""
    model = flashv41.load_model(synth_model("flash", **flash3(wtype)))
    check_batch_equals_each_alone(model, (9, 127, 130), 5)


def check_batch_split_agrees(model, prompt_lengths: tuple[int, ...], steps: int) -> None:
    """Past eight sequences a batch's products run on the narrow tensor-core kernel, which a
    sequence alone (the stream kernel) does not, so there the check is that a sequence's outputs
    do not depend on its batch: the sequences decoded `steps` steps as one batch and, from the same
    prompts, as two batches of the halves (each still past eight) must agree bit for bit."""
    vocab = model.config.vocab_size
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, vocab, n) for n in prompt_lengths]
    nexts = [rng.integers(0, vocab, steps) for _ in prompts]
    half = len(prompts) // 2
    assert half > 8, "both halves must be batches past the stream kernel's eight tokens"
    with flashv41.Engine(model, max_seq=512, max_tokens=64) as engine:
        whole = [engine.new_sequence() for _ in prompts]
        parts = [engine.new_sequence() for _ in prompts]
        for seq, other, prompt in zip(whole, parts, prompts, strict=True):
            seq.prefill(prompt)
            other.prefill(prompt)
        for step in range(steps):
            ids = [int(n[step]) for n in nexts]
            got = engine.decode_batch(whole, ids)
            split = np.concatenate([engine.decode_batch(parts[:half], ids[:half]),
                                    engine.decode_batch(parts[half:], ids[half:])])
            for b in range(len(prompts)):
                differ = int((got[b] != split[b]).sum())
                assert differ == 0, (f"step {step}: sequence {b} differs by {differ} values between the batch of "
                                     f"{len(prompts)} and its half")


def test_small_large_batch_is_batch_independent(synth_model):
    """The small preset: 20 sequences at positions 3 to 41 (across the window's wrap and the
    compressor groups), four steps, as one batch of 20 and two of 10."""
    model = flashv41.load_model(synth_model("small"))
    check_batch_split_agrees(model, tuple(3 + 2 * i for i in range(20)), 4)


def test_flash_large_batch_is_batch_independent(synth_model):
    """V4.1-Flash sizes (FLASH3, Q8_0): 18 sequences at positions 9 to 144, three steps, as one
    batch of 18 and two of 9."""
    model = flashv41.load_model(synth_model("flash", **FLASH3))
    check_batch_split_agrees(model, tuple(9 + 8 * i for i in range(18)), 3)

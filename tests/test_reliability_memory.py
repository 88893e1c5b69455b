"""No device memory leaks: sequences created and released (or dropped), failing calls, a failure
inside a call, engines created and closed, an engine that fails to build.

On the simulator the driver has no free-memory figure (numba reports infinity), so what is
measured is what live Python objects hold: the bytes of every simulated device array still
reachable (tests/reliability.py live_device_bytes). That is what the GPU frees too: numba returns
an allocation to the driver once nothing references it. The `gpu` test repeats the cycle at the
small preset with the driver's figure, with decode steps (CUDA-graph replay) in every sequence.
"""

from __future__ import annotations

import numpy as np
import pytest

import flashv41
from flashv41.host.errors import CapacityError, FlashError, InputError, SequenceStateError
from flashv41.memory import estimate_memory
from flashv41.stages.backend import using_simulator
from flashv41.stages.norm_rope_quant import _placeholders
from tests.reliability import TWO_LAYER_TINY, free_device_bytes, live_device_bytes

MAX_SEQ, MAX_TOKENS = 16, 3


def failing_forward(engine, after: int):
    """engine.attention.forward raising on its `after`-th call, as a device error inside a call would."""
    forward = engine.attention.forward
    count = [0]

    def failing(*args, **kwargs):
        count[0] += 1
        if count[0] == after:
            raise RuntimeError("injected device failure")
        return forward(*args, **kwargs)

    return failing


@pytest.mark.slow
@pytest.mark.skipif(not using_simulator(), reason="counts the simulator's device arrays; test_gpu_memory_comes_back "
                    "is the GPU's")
def test_sequences_and_engines_give_their_memory_back(synth_model, monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path) -> None:
    model = flashv41.load_model(synth_model("tiny", **TWO_LAYER_TINY))
    estimate = estimate_memory(model.config, model.weights, MAX_SEQ, MAX_TOKENS)
    _placeholders()  # allocated once a process, by its first call: not a sequence's (run alone, this test's)
    start = live_device_bytes()
    engine = flashv41.Engine(model, max_seq=MAX_SEQ, max_tokens=MAX_TOKENS)
    with_engine = live_device_bytes()
    assert with_engine - start >= estimate.weight_bytes + estimate.workspace_bytes

    # one sequence holds what the estimate says (less the hash history, which lives on the host) and
    # its truncate checkpoint
    per_sequence = estimate.state_bytes_per_sequence - MAX_SEQ * 8 + estimate.checkpoint_bytes
    seq = engine.new_sequence()
    assert live_device_bytes() - with_engine == per_sequence
    seq.prefill(np.array([3, 126, 7]))
    seq.decode(9)
    # a fork, rewound, and a sequence saved and loaded: each holds one sequence's memory, and gives it
    # back
    base = live_device_bytes()
    fork = seq.fork()
    fork.prefill(np.array([5, 6]))
    fork.truncate(4)
    saved = tmp_path / "seq.npz"
    fork.save(saved)
    loaded = engine.load_sequence(saved)
    assert live_device_bytes() - base == 2 * per_sequence
    fork.release()
    del loaded
    assert live_device_bytes() == base, "a fork or a loaded sequence kept device memory"
    for bad in (lambda: seq.prefill(np.array([1, 128])), lambda: seq.prefill(np.zeros(MAX_SEQ, np.int64)),
                lambda: seq.decode(2.0)):  # type: ignore[arg-type]
        with pytest.raises(FlashError):
            bad()
    monkeypatch.setattr(engine.attention, "forward", failing_forward(engine, after=2))
    with pytest.raises(RuntimeError, match="injected"):
        seq.decode(4)
    monkeypatch.undo()
    seq.release()
    assert live_device_bytes() == with_engine, "a released sequence kept device memory"

    # many sequences: released, dropped without release, or left for close()
    kept = []
    for i in range(40):
        s = engine.new_sequence()
        if i % 3 == 0:
            s.release()
        elif i % 3 == 1:
            kept.append(s)
        del s  # dropped: its state goes with the last reference
    assert live_device_bytes() - with_engine == len(kept) * per_sequence
    engine.close()
    assert all(s.released for s in kept)
    assert live_device_bytes() == start, "a closed engine kept device memory"
    del kept, engine

    # engines built and closed, one with host-resident tables, and engines that fail to build: past
    # the context length (refused up front), and a float max_tokens, which today fails part-way,
    # after the first uploads, with a TypeError (see test_reliability_engine.test_not_yet_an_input_error)
    for kwargs in ({}, {"table_residency": "host"}, {"max_seq": 10**6}, {"max_tokens": 2.5}):
        try:
            with flashv41.Engine(model, **{"max_seq": MAX_SEQ, "max_tokens": MAX_TOKENS, **kwargs}) as other:
                other.new_sequence()
        except (CapacityError, InputError, TypeError):
            pass
    closed = flashv41.load_model(synth_model("tiny", **TWO_LAYER_TINY))
    closed.close()
    with pytest.raises(SequenceStateError):
        flashv41.Engine(closed, max_seq=MAX_SEQ, max_tokens=MAX_TOKENS)
    with pytest.raises(InputError):
        flashv41.Engine(model, max_seq=MAX_SEQ, max_tokens=MAX_TOKENS, table_residency="disk")
    assert live_device_bytes() == start, "engines built and closed kept device memory"
    model.close()


@pytest.mark.gpu
@pytest.mark.device_memory
def test_gpu_memory_comes_back(synth_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The small preset: 100 sequences that prefill, decode (CUDA graphs captured per sequence) and
    see bad calls and an injected failure, released or dropped; then engines built and closed.

    The first round of calls loads every kernel's module, and the driver keeps that code (a few MiB)
    for the life of the process: it is not held by a sequence. So the baseline is read after a first
    round, and every later round must come back to it exactly. Closed engines must give back all but that
    first-use code, to within one 2 MiB page of the driver's small-allocation pool."""
    import gc

    model = flashv41.load_model(synth_model("small"))
    start = free_device_bytes()
    engine = flashv41.Engine(model, max_seq=128, max_tokens=16)
    with_engine = free_device_bytes()
    rng = np.random.default_rng(3)

    def run_round(engine: flashv41.Engine, round_: int) -> None:
        seqs = [engine.new_sequence() for _ in range(5)]
        for s in seqs:
            s.prefill(rng.integers(0, 510, 20))
            for _ in range(4):
                s.decode(int(rng.integers(0, 512)))
            with pytest.raises(FlashError):
                s.prefill(np.array([1, 512]))
        if round_ % 5 == 0:
            monkeypatch.setattr(engine.attention, "forward", failing_forward(engine, after=3))
            with pytest.raises(RuntimeError, match="injected"):
                seqs[0].prefill(np.arange(4))
            monkeypatch.undo()
        for i, s in enumerate(seqs):
            if i % 2 == 0:
                s.release()
        del seqs, s
        gc.collect()

    run_round(engine, 0)
    after_first = free_device_bytes()
    first_use_code = with_engine - after_first
    print(f"\nfirst round of calls: {first_use_code} bytes of driver memory")
    assert first_use_code <= 64 << 20, f"the first round kept {first_use_code} bytes"
    for round_ in range(1, 20):
        run_round(engine, round_)
        assert free_device_bytes() == after_first, f"round {round_}: sequences kept device memory"
    engine.close()
    del engine
    gc.collect()
    page = 2 << 20  # the driver hands small allocations out of 2 MiB pages
    closed = free_device_bytes()
    assert closed >= start - first_use_code - page, f"a closed engine kept {start - first_use_code - closed} bytes"
    for kwargs in ({}, {"table_residency": "host"}):
        for repeat in range(4):
            with flashv41.Engine(model, max_seq=128, max_tokens=16, **kwargs) as other:
                other.new_sequence().prefill(np.arange(8))
            gc.collect()
            if repeat == 0:
                before = free_device_bytes()
        kept = before - free_device_bytes()
        assert kept <= page, f"three more engines {kwargs or ''} kept {kept} bytes"
    model.close()

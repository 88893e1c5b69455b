"""flashv41.bench without a GPU: the L2 policy (copies, plans, what the JSON says), the order in
which the L2-honest timings queue their work, and the probe kernels of stages.bandwidth against
NumPy on the simulator (in compile-check mode: compiled for sm_90). No timing is asserted."""

from __future__ import annotations

import json
import weakref

import numpy as np
import pytest
from numba import cuda  # noqa: E402  (after conftest chose the backend)

from flashv41.bench import core as bench
from flashv41.bench.core import (
    HBM_FACTOR,
    L2_FALLBACK,
    BenchContext,
    BenchOptions,
    BenchRow,
    L2Plan,
    copies_needed,
    format_table,
    plan_l2,
    report,
)
from flashv41.host.errors import CapacityError, FlashError, UnsupportedError
from flashv41.stages.backend import using_simulator
from flashv41.stages.bandwidth import NEVER, L2Evictor, copy_words, fill_words, read_words, words_buffer

L2 = 50 << 20
MB = 10**6

# ------------------------------------------------------------------------------------ the L2 policy


@pytest.mark.parametrize("nbytes", [1, 860_000, 7 * MB, 44_600_000, L2, 167 * MB, 4 * L2 - 1])
def test_copies_reach_four_l2_and_no_more_than_needed(nbytes: int) -> None:
    copies = copies_needed(nbytes, L2)
    assert copies >= 2, "consecutive calls must read different copies"
    assert copies * nbytes >= HBM_FACTOR * L2
    assert copies == 2 or (copies - 1) * nbytes < HBM_FACTOR * L2, "one copy fewer would do"


def test_copies_of_the_flash_weights() -> None:
    """What the module docstrings promise for the H200's 50 MiB L2."""
    assert copies_needed(6_963_200, L2) == 31  # Q8_0 attn.wq_a [1280, 5120]
    assert copies_needed(860_160, L2) == 244  # Q2_K attn.wkv [512, 5120]
    assert copies_needed(167_116_800, L2) == 2  # Q8_0 engram wkv [25600, 6144]


@pytest.mark.parametrize("nbytes,rotate,mode", [
    (4 * L2, True, "hbm"), (4 * L2, False, "hbm"), (253 * MB, False, "hbm"),
    (4 * L2 - 1, True, "rotate"), (41 * MB, True, "rotate"),
    (4 * L2 - 1, False, "evict"), (134 * MB, False, "evict"), (0, False, "evict"),
])
def test_plan_by_size(nbytes: int, rotate: bool, mode: str) -> None:
    plan = plan_l2(nbytes, L2, rotate)
    assert plan.mode == mode
    assert plan.copies == (copies_needed(nbytes, L2) if mode == "rotate" else 1)


def test_plan_words() -> None:
    rotated = plan_l2(7 * MB, L2, True)  # 30 copies: 210 MB
    assert rotated.describe() == "rotated over 30 copies (210 MB, 4.0x L2)"
    assert rotated.short() == "L2: 30 copies"
    assert plan_l2(134 * MB, L2, False).describe().startswith("L2 evicted between repetitions")
    assert plan_l2(5 * L2, L2, False).describe() == "data 5.0x L2: read from HBM"
    assert bench.HOST.describe() == "host clock: no device data"


def test_row_json_says_what_was_done() -> None:
    row = BenchRow("gemv.attn.wq_a.Q8_0", 2e-6, 1.8e-6, bytes=7 * MB, l2=plan_l2(7 * MB, L2, True))
    got = row.to_json()
    assert got["l2"].startswith("rotated over 30 copies") and got["l2_mode"] == "rotate"
    assert got["ratio"] == pytest.approx(2 / 1.8)
    untimed = BenchRow("stack.memory", 0.0, 0.0).to_json()
    assert untimed["l2"] is None and untimed["l2_mode"] is None
    json.dumps([got, untimed])


def test_report_and_table() -> None:
    bandwidths = {"memcpy": 3.95e12, "copy_kernel": 4.02e12, "read_kernel": 4.21e12}
    rows = [BenchRow("copy.read_kernel", 0.1275e-3, 0.1275e-3, bytes=512 << 20, l2=plan_l2(512 << 20, L2, False)),
            BenchRow("attention.decode.Q2_K.swa.graph", 30e-6, 10e-6, bytes=41 * MB, l2=plan_l2(41 * MB, L2, False))]
    ctx = BenchContext(BenchOptions(), "H200", max(bandwidths.values()), rows, bandwidths, L2, "driver")
    got = json.loads(json.dumps(report(ctx)))
    assert got["copy_bandwidths"] == bandwidths and got["copy_bandwidth_bytes_per_s"] == 4.21e12
    assert got["l2_bytes"] == L2 and got["l2_source"] == "driver" and "evicted" in got["l2_policy"]
    assert [r["l2_mode"] for r in got["rows"]] == ["hbm", "evict"]
    table = format_table(ctx.gpu, ctx.copy_bandwidth, ctx.rows, ctx.copy_bandwidths, ctx.l2_bytes)
    assert "4.210 TB/s" in table and "memcpy 3.950" in table and "read_kernel 4.210" in table
    assert "L2 50 MiB" in table and "[L2: evicted]" in table and "[L2: data 10.2x]" in table


def test_l2_size_falls_back_without_a_driver_figure() -> None:
    if not using_simulator():
        pytest.skip("on a GPU the driver reports the L2")
    size, source = bench.device_l2_bytes()
    assert size == L2_FALLBACK and "assumed" in source


@pytest.mark.skipif(not using_simulator(), reason="on a GPU the benchmark would run")
def test_run_refuses_the_simulator() -> None:
    with pytest.raises(UnsupportedError, match="needs a CUDA GPU"):
        bench.run(BenchOptions(rows=("engram.hash*",)), print_fn=lambda _: None)


def test_every_case_still_listed() -> None:
    names = [c.name for c in bench.all_cases(BenchOptions(weight_types=("Q8_0",)))]
    assert "gemv.attn.wq_a.Q8_0" in names and "attention.decode.Q8_0" in names and "stack.decode" in names
    assert "prefill.gemm.engram.wkv.Q8_0" in names and "engram.hash.64k" in names
    assert "head.decode.Q8_0" in names
    # the sparse attention alone: each kernel family beside the other, prefill chunks and batches
    assert "sparse.prefill.fused.512" in names and "sparse.prefill.fused.64" in names
    assert "sparse.batch.cuda.8" in names and "sparse.batch.fused.128" in names
    assert not any(".tc." in n for n in names if n.startswith("sparse."))
    # and the decode steps' own sizes on the CUDA cores (their default) beside the fused kernel
    assert "sparse.batch.cuda.1" in names and "sparse.batch.fused.8" in names
    # beside each picked decode row, the kernel not picked for it (stages.linear_imma.decode_pick)
    assert "gemv.imma.attn.wq_a.Q8_0" in names and "gemv.imma.t8.engram.wkv.Q8_0" in names
    # Q8_0 streams everywhere but on the tall wq_b
    assert [name for name in names if name.startswith("gemv.stream.")] == ["gemv.stream.attn.wq_b.Q8_0",
                                                                           "gemv.stream.t8.attn.wq_b.Q8_0"]
    assert "prefill.gemm.attn.wo_a.Q8_0" in names
    # Q8_0 has one prefill kernel: the rows are the picked kernel's, none forced
    assert not [name for name in names if name.startswith(("prefill.gemm.tc.", "prefill.gemm.pipe."))]
    # BF16's picked rows (wgmma on compute capability 9.0), each with pipe's beside it (the kernel it displaced)
    bf16 = [c.name for c in bench.all_cases(BenchOptions(weight_types=("BF16",))) if c.name.startswith("prefill.gemm.")]
    assert "prefill.gemm.attn.wo_a.BF16" in bf16 and "prefill.gemm.pipe.attn.wo_a.BF16" in bf16
    assert len(bf16) == 2 * len([name for name in bf16 if name.startswith("prefill.gemm.pipe.")])
    q2 = [c.name for c in bench.all_cases(BenchOptions(weight_types=("Q2_K",)))]
    assert "gemv.stream.engram.wkv.Q2_K" in q2 and "gemv.imma.attn.wq_a.Q2_K" in q2
    assert "gemv.imma.attn.wo_b.Q2_K" in q2 and "gemv.stream.t8.attn.wq_b.Q2_K" in q2
    q3 = [c.name for c in bench.all_cases(BenchOptions(weight_types=("Q3_K", "Q6_K")))]
    assert "gemv.imma.engram.wkv.Q6_K" in q3
    # Q3_K is picked as Q2_K is (stages.linear_imma.DECODE_PICKS), so its rows are Q2_K's
    assert "gemv.imma.attn.wq_a.Q3_K" in q3 and "gemv.imma.attn.wo_b.Q3_K" in q3
    assert "gemv.stream.attn.wq_b.Q3_K" in q3 and "gemv.stream.t8.engram.wkv.Q3_K" in q3
    q4 = [c.name for c in bench.all_cases(BenchOptions(weight_types=("Q4_K", "MXFP4")))]
    assert "gemv.imma.attn.wq_a.Q4_K" in q4 and "gemv.stream.attn.wo_a.Q4_K" in q4
    assert "gemv.stream.attn.wo_b.Q4_K" in q4 and "gemv.imma.attn.wo_b.MXFP4" in q4
    assert "gemv.stream.engram.wkv.MXFP4" in q4

def test_the_40_layer_stack_is_a_row_of_its_own() -> None:
    """`--rows stack.decode.40` picks the real 40-layer schedule alone, `stack.decode` the six-layer
    stack alone, `stack.*` both; each has its own cached model file and its own row names."""
    from flashv41.bench import stack
    from flashv41.host.synth import preset

    cases = bench.all_cases(BenchOptions(weight_types=("Q8_0",)))
    assert [c.name for c in bench.select_cases(cases, ["stack.decode.40"])] == ["stack.decode.40"]
    assert [c.name for c in bench.select_cases(cases, ["stack.decode"])] == ["stack.decode"]
    assert [c.name for c in bench.select_cases(cases, ["stack.*"])] == [
        "stack.decode", "stack.decode.40", "stack.decode.batch"]
    assert [c.name for c in bench.select_cases(cases, ["stack.decode.batch"])] == ["stack.decode.batch"]
    real = next(s for s in stack.STACKS if s.case == "stack.decode.40")
    assert real.preset == "flash40" and preset(real.preset).n_layers == 40 and real.suffix == ".40"
    assert len({s.filename for s in stack.STACKS}) == len(stack.STACKS), "each stack caches its own file"
    assert stack.STACKS[0] == stack.Stack("stack.decode", "flash", "", "flash-stack-Q8_0.gguf"), \
        "the six-layer rows keep their names and their cached file"


# ------------------------------------------------------------------- the queue of the timed calls


class Recorder:
    """Stands in for the sleeping kernel, the evictor and the measured call: records the order."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def hold(self, stream, seconds: float) -> None:
        self.log.append("hold" if seconds > 0 else "no hold")

    def evict(self, stream) -> None:
        self.log.append("evict")

    def call(self) -> None:
        self.log.append("call")


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(bench, "_hold", rec.hold)
    return rec


def test_evicted_time_evicts_before_every_timed_call(recorder: Recorder) -> None:
    bench.evicted_time(recorder.call, reps=3, warmup=2, stream=0, evict=recorder.evict, n=4, hold_s=0.01)
    log = recorder.log
    # warm-up: 2 calls, then two groups issued to time Python's issue cost
    assert log[:2] == ["call", "call"] and log[2:18] == ["evict", "call"] * 8
    timed = log[18:]
    assert timed == (["hold"] + ["evict", "call"] * 4) * 3


def test_pipelined_eviction_has_no_hold(recorder: Recorder) -> None:
    bench.evicted_time(recorder.call, reps=2, warmup=0, stream=0, evict=recorder.evict, n=2, hold_s=0.0)
    assert "hold" not in recorder.log and recorder.log[-4:] == ["evict", "call"] * 2


def test_stage_time_evicts_only_data_under_four_l2(recorder: Recorder) -> None:
    ctx = BenchContext(BenchOptions(reps=20, warmup=1), "test", 4e12, l2_bytes=L2, evictor=recorder)
    _, plan = ctx.stage_time(recorder.call, 5 * L2, stream=0, n=2)
    assert plan.mode == "hbm" and "evict" not in recorder.log
    _, plan = ctx.stage_time(recorder.call, L2, stream=0, n=2)
    assert plan.mode == "evict" and recorder.log.count("evict") == 2 * 2 + 20 * 2
    _, plan = ctx.python_time(recorder.call, L2, stream=0, n=2)
    assert plan.mode == "evict" and recorder.log[-1] == "call" and recorder.log[-2] == "evict"


class Weight:
    """A stand-in for a DeviceWeight (the rotation only copies and passes it on)."""

    def __init__(self, tag: int) -> None:
        self.tag = tag


def test_rotated_time_reads_the_copies_in_turn_and_frees_them(recorder: Recorder) -> None:
    ctx = BenchContext(BenchOptions(reps=20, warmup=0), "test", 4e12, l2_bytes=L2)
    made: list[weakref.ref] = []

    def copy(w: Weight) -> Weight:
        c = Weight(len(made) + 1)
        made.append(weakref.ref(c))
        return c

    seen: list[int] = []
    nbytes = 60 * MB  # 4 copies make 4x L2
    _, plan = ctx.rotated_time(Weight(0), copy, lambda w: seen.append(w.tag), nbytes, stream=0, n=3)
    assert plan.mode == "rotate" and plan.copies == 4 and len(made) == 3
    assert seen == [i % 4 for i in range(len(seen))] and len(seen) == 2 * 3 + 20 * 3
    assert all(ref() is None for ref in made), "the rotation copies outlived the row"


def test_rotated_time_prepares_every_copy_before_the_timing(recorder: Recorder) -> None:
    ctx = BenchContext(BenchOptions(reps=20, warmup=0), "test", 4e12, l2_bytes=L2)
    seen: list[int] = []
    prepared: list[int] = []
    ctx.rotated_time(Weight(0), lambda w: Weight(w.tag + 1), lambda w: seen.append(w.tag), 60 * MB, stream=0, n=3,
                     prepare=lambda w: prepared.append(len(seen)))
    assert prepared == [0, 0, 0, 0]  # one call on each of the 4 items, all before the first timed call


# ------------------------------------------------------------------------- the probe kernels


def buffer(values: np.ndarray):
    return cuda.to_device(np.ascontiguousarray(values, dtype=np.uint32).reshape(1, -1))


@pytest.mark.parametrize("vectors,blocks", [(1, 1), (37, 2), (64, 2), (300, 3)])
def test_copy_kernel_copies_every_word(vectors: int, blocks: int) -> None:
    """Counts that are and are not whole unrolled rounds of the grid (32 threads a block here)."""
    src = np.random.default_rng(vectors).integers(0, 2**32, 4 * vectors, dtype=np.uint32)
    dst = buffer(np.zeros_like(src))
    copy_words(buffer(src), dst, blocks=blocks)
    got = dst.copy_to_host()[0]
    bad = np.flatnonzero(got != src)
    assert bad.size == 0, f"{bad.size} words differ, first at {bad[:5]}"


@pytest.mark.parametrize("where", [0, 5, 4 * 300 - 1])
def test_read_kernel_reads_every_word(where: int) -> None:
    """Zeros but one word NEVER: the thread that loads it (and only it) sees xor NEVER and writes
    the sink; all zeros: the sink is never written."""
    words = np.zeros(4 * 300, np.uint32)
    sink = cuda.to_device(np.array([7], np.uint32))
    read_words(buffer(words), sink, blocks=3)
    assert sink.copy_to_host()[0] == 7
    words[where] = NEVER
    read_words(buffer(words), sink, blocks=3)
    assert sink.copy_to_host()[0] == NEVER


def test_fill_and_evictor() -> None:
    dst = buffer(np.ones(4 * 45, np.uint32))
    fill_words(dst, 0xABCD, blocks=2)
    assert (dst.copy_to_host() == 0xABCD).all()
    assert (words_buffer(100).copy_to_host() == 0).all() and words_buffer(100).shape == (1, 28)
    evictor = L2Evictor(4096)
    evictor.evict()
    assert evictor.nbytes == 4096 and evictor.sink.copy_to_host().shape == (1,)
    evictor.free()
    assert evictor.buffer is None


def test_probe_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match="uint32"):
        copy_words(cuda.to_device(np.zeros((1, 6), np.uint32)), cuda.to_device(np.zeros((1, 6), np.uint32)))
    with pytest.raises(ValueError, match="copy"):
        copy_words(buffer(np.zeros(8)), buffer(np.zeros(12)))


def test_plan_type_is_frozen() -> None:
    plan = L2Plan("evict", 1, L2)
    with pytest.raises(AttributeError):
        plan.mode = "hbm"  # type: ignore[misc]


class NoEvictor:
    freed = False

    def __init__(self, nbytes: int) -> None:
        pass

    def free(self) -> None:
        NoEvictor.freed = True


def fake_gpu(monkeypatch: pytest.MonkeyPatch, cases: list) -> None:
    """bench.run's GPU parts stood in for (the GPU's name, its L2, the copy rows, the evictor), with
    `cases` as the selected rows."""
    import flashv41.stages.bandwidth as bandwidth

    copies = [BenchRow(f"copy.{name}", 1e-4, 1e-4, bytes=int(4e8)) for name in ("memcpy", "copy_kernel", "read_kernel")]
    NoEvictor.freed = False
    monkeypatch.setattr(bench, "require_gpu", lambda: None)
    monkeypatch.setattr(bench, "backend_name", lambda: "Fake GPU")
    monkeypatch.setattr(bench, "device_l2_bytes", lambda: (L2, "driver"))
    monkeypatch.setattr(bench, "measure_copy_bandwidths", lambda reps, warmup, l2: copies)
    monkeypatch.setattr(bench, "all_cases", lambda options: cases)
    monkeypatch.setattr(bandwidth, "L2Evictor", NoEvictor)


def fake_case(i: int) -> bench.BenchCase:
    return bench.BenchCase(f"fake.{i}", lambda ctx: [BenchRow(f"fake.{i}", 2e-6, 1e-6, bytes=MB)])


def test_run_walks_the_rows_with_progress(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys) -> None:
    """bench.run's own loop (the GPU named first, the rows' progress, each row's line, the table,
    the JSON) with the GPU parts stood in for: the loop itself is host code and must not wait for a
    GPU run to be exercised."""
    fake_gpu(monkeypatch, [fake_case(i) for i in range(3)])
    lines: list[str] = []
    ctx = bench.run(BenchOptions(workdir=tmp_path / "work"), tmp_path / "bench.json", lines.append)
    names = ["copy.memcpy", "copy.copy_kernel", "copy.read_kernel", "fake.0", "fake.1", "fake.2"]
    assert [r.name for r in ctx.rows] == names and NoEvictor.freed
    assert any(line.startswith("  fake.2: 2.0 us (bound 1.0 us, ratio 2.00") for line in lines)
    assert "Fake GPU" in capsys.readouterr().err.splitlines()[0]
    got = json.loads((tmp_path / "bench.json").read_text())
    assert [r["name"] for r in got["rows"]] == names and got["complete"] and got["interrupted_at"] is None


def test_an_interrupted_run_keeps_its_rows(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys) -> None:
    """Ctrl-C (or a time limit's SIGINT) in the second row: the table and the JSON of the rows before
    it, the JSON saying where the run stopped, the evictor freed, then the interrupt goes on."""
    def stopped(ctx) -> list[BenchRow]:
        raise KeyboardInterrupt

    fake_gpu(monkeypatch, [fake_case(0), bench.BenchCase("fake.stopped", stopped), fake_case(2)])
    lines: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        bench.run(BenchOptions(workdir=tmp_path / "work"), tmp_path / "bench.json", lines.append)
    got = json.loads((tmp_path / "bench.json").read_text())
    assert [r["name"] for r in got["rows"]][3:] == ["fake.0"]
    assert not got["complete"] and got["interrupted_at"] == "fake.stopped" and NoEvictor.freed
    assert "fake.0" in lines[-1] and "fake.2" not in lines[-1]  # the table, last
    assert "bench: interrupted in fake.stopped" in capsys.readouterr().err


def test_a_failing_row_leaves_the_others(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys) -> None:
    """A case that raises (here as the batch row did, a CapacityError) loses its own rows only: the
    rows after it run, the table and the JSON keep theirs and list the failure, and the run ends in
    one error naming the case."""
    def failing(ctx) -> list[BenchRow]:
        raise CapacityError("128 tokens at position 0 go past max_seq 104")

    fake_gpu(monkeypatch, [fake_case(0), bench.BenchCase("fake.failing", failing), fake_case(2)])
    lines: list[str] = []
    with pytest.raises(FlashError, match=r"1 of 3 rows failed: fake.failing \(CapacityError: 128 tokens"):
        bench.run(BenchOptions(workdir=tmp_path / "work"), tmp_path / "bench.json", lines.append)
    got = json.loads((tmp_path / "bench.json").read_text())
    assert [r["name"] for r in got["rows"]][3:] == ["fake.0", "fake.2"] and got["complete"]
    assert got["failed"] == [{"case": "fake.failing", "error": "CapacityError: 128 tokens at position 0 go past "
                                                                "max_seq 104"}]
    assert "fake.2" in lines[-1] and NoEvictor.freed
    assert "bench: fake.failing failed (CapacityError" in capsys.readouterr().err


def test_real_table_rows_have_the_official_table() -> None:
    """`engram.step.real.*` run on a one-layer model whose table is V4.1-Flash's first, 384,006,168
    rows (a hole), one case per residency."""
    from flashv41.bench import engram
    from flashv41.host.synth import REAL_TABLE_ROWS

    cfg = engram.engram_config("flash", **engram.REAL_MODEL)
    assert cfg.table_rows == REAL_TABLE_ROWS[:1] and engram.REAL_MODEL["holes"] == "tables"
    names = [c.name for c in bench.all_cases(BenchOptions(weight_types=("Q8_0",)))]
    assert [n for n in names if n.startswith("engram.step.real.")] == [
        f"engram.step.real.{r}" for r in ("device", "pinned", "host")]


def test_host_link_is_measured_once_a_run() -> None:
    """A case that needs the host link's bandwidth reads the run's `copy.host_link` row when an
    earlier case measured it, and adds no second one."""
    from flashv41.bench import engram
    from flashv41.bench.core import BenchContext, BenchRow

    link = BenchRow("copy.host_link", 4e-3, 4e-3, bytes=engram.HOST_LINK_BYTES)
    ctx = BenchContext(BenchOptions(), "a GPU", 4e12, rows=[link])
    rows: list = []
    assert engram.host_link_seconds(ctx, rows) == 4e-3 / engram.HOST_LINK_BYTES and rows == []


@pytest.mark.parametrize("row", ["sparse.prefill.fused.12", "sparse.batch.fused.10", "sparse.batch.cuda.2"])
def test_sparse_rows_run(monkeypatch: pytest.MonkeyPatch, row: str) -> None:
    """The sparse rows' cases at a small shape (16 heads x 64, 8 window slots, the top 16 of 32
    groups), their step called once where the GPU would time it: a row of the kernels it names,
    its FLOPs those of the shape."""
    from flashv41.bench import sparse
    from flashv41.bench.core import BenchContext, L2Plan
    from flashv41.stages import sparse_attention as sa

    for name, value in (("HEADS", 16), ("DIM", 64), ("ROPE", 8), ("WINDOW", 8), ("GROUPS", 32), ("SELECTED", 16)):
        monkeypatch.setattr(sparse, name, value)
    chosen: list[str] = []
    for fn in ("sparse_attention", "sparse_attention_tables"):
        real = getattr(sa, fn)
        monkeypatch.setattr(sa, fn, lambda *a, _real=real, **k: (chosen.append(k["cores"]), _real(*a, **k)))
    calls: list[int] = []

    def stage_time(self, fn, data_bytes, stream, n=8, hold_s=0.005):
        fn()
        calls.append(data_bytes)
        return 1e-3, L2Plan("hbm", data_bytes, 1)

    monkeypatch.setattr(BenchContext, "stage_time", stage_time)
    kind, cores, count = row.split(".")[1:]
    case = (sparse.prefill_case if kind == "prefill" else sparse.batch_case)(cores, int(count))
    (got,) = case.run(BenchContext(BenchOptions(), "a GPU", 4e12))
    assert got.name == row and chosen == [cores] and len(calls) == 1
    assert got.flops == 4 * int(count) * 16 * (8 + 16) * 64 and "16 heads x 64, 24 entries" in got.note

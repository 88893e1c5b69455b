"""flashv41.bench.prefill_stack without a GPU: the category table against every part a prefill
marks and every step a decode step and a batch step show, the FLOP count against a hand count,
which rows a --rows pattern picks, and the rows a timed run makes. No timing is asserted (the
simulator's events time nothing)."""

from __future__ import annotations

import fnmatch
import json

import numpy as np
import pytest

import flashv41
from flashv41.bench import core as bench
from flashv41.bench import prefill_stack as ps
from flashv41.bench.core import BenchOptions, BenchRow, L2Plan
from flashv41.bench.stack import STACKS
from flashv41.host.errors import CapacityError
from flashv41.stages.hyper import POST_PRODUCT_MAX_TOKENS
from flashv41.stages.trace import Traced

# one chunk past the tokens a hc post forms the next mixes' product for and the products' stream
# kernel takes: every prefill chunk's path, at the fewest tokens that take it
TOKENS = POST_PRODUCT_MAX_TOKENS + 1


@pytest.fixture(scope="module")
def tiny_engine(tiny_path):
    model = flashv41.load_model(tiny_path)
    engine = flashv41.Engine(model, max_seq=2 * TOKENS, max_tokens=TOKENS)
    yield engine
    engine.close()
    model.close()


@pytest.fixture(scope="module")
def marked(tiny_engine) -> dict[str, float]:
    """The parts of a one-chunk prefill of the tiny preset (every block type, two engram layers),
    as the bench's events see them; the engine is left unwatched."""
    events = ps.PartEvents(tiny_engine.attention.stream)
    seq = tiny_engine.new_sequence()
    ps.prefill_chunks(tiny_engine, seq, np.arange(TOKENS) % tiny_engine.cfg.vocab_size, events)
    seq.release()
    return events.collect()


class StepNames:
    """An observer that keeps the name of every step it sees."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def before(self, step, call) -> None:
        self.names.add(step.name)

    def after(self, step, call) -> None:
        pass


@pytest.fixture(scope="module")
def steps(tiny_engine) -> set[str]:
    """The names of every step of a decode step and a decode_batch step of two sequences (a
    prefill's are the decode step's: the plan's names do not depend on the token count)."""
    seen = StepNames()
    a, b = tiny_engine.new_sequence(), tiny_engine.new_sequence()
    tiny_engine.observers.append(seen)
    try:
        a.decode(1)
        b.decode(2)
        tiny_engine.decode_batch([a, b], [3, 4])
    finally:
        tiny_engine.observers.remove(seen)
        a.release()
        b.release()
    return seen.names


@pytest.fixture(scope="module")
def callback_steps(synth_model) -> set[str]:
    """The names of the steps a decode step adds with an FFN callback and a head (the tiny preset
    with its MoE and head tensors, a callback writing zeros)."""
    import flashv41

    def zero(layer, x, out, stream) -> None:
        out.copy_to_device(np.zeros(out.shape, np.uint16))

    seen = StepNames()
    with flashv41.load_model(synth_model("tiny", moe=True)) as model:
        engine = flashv41.Engine(model, max_seq=8, max_tokens=2, ffn=zero)
        engine.observers.append(seen)
        engine.new_sequence().decode(1)
        engine.close()
    return seen.names


@pytest.mark.slow
def test_every_part_a_prefill_marks_has_a_category(marked: dict[str, float]) -> None:
    split = ps.split_by_category(marked)  # a KeyError names any part CATEGORIES does not know
    assert list(split) == list(ps.CATEGORY_NAMES)
    # every stage's marks came through, and the steps after them under their own names
    for part in ("wq_a + wkv", "compress products", "wk", "index products", "index_scores", "select",
                 "sparse_attention", "wo_b", "ring_write", "hc mixes product", "engram rows", "engram wkv",
                 "engram hash (host)", "highway download", "attention (swa)"):
        assert part in marked, f"{part!r} was not marked ({sorted(marked)})"


def test_every_step_of_a_decode_and_a_batch_has_a_category(steps: set[str], marked: dict[str, float],
                                                          callback_steps: set[str]) -> None:
    assert steps <= set(marked), "a prefill's steps are a decode step's"
    for name in steps | callback_steps:
        assert ps.category_of(name) in ps.CATEGORY_NAMES


def test_the_table_holds_no_name_nothing_emits(steps: set[str], marked: dict[str, float],
                                               callback_steps: set[str]) -> None:
    seen = set(marked) | steps | callback_steps
    stale = [p for p in ps.CATEGORIES if not any(fnmatch.fnmatchcase(name, p) for name in seen)]
    assert not stale, f"CATEGORIES names parts no prefill or plan of the tiny preset emits: {stale}"


def test_an_unknown_part_fails_loudly() -> None:
    with pytest.raises(KeyError, match="'a new kernel' has no category"):
        ps.split_by_category({"wq_b": 1.0, "a new kernel": 1.0})


def test_watching_leaves_the_engine_as_it_found_it(tiny_engine, marked: dict[str, float]) -> None:
    assert tiny_engine.observers == []
    assert all(stage.trace is None for stage in tiny_engine.plan.stages if isinstance(stage, Traced))


def test_flops_of_a_tiny_prompt(tiny_engine) -> None:
    """Five tokens of the tiny preset, counted by hand: dim 32, q_lora 32, 2 heads x 64, 2 output
    groups of 32 (64 values each), hc 4 (24 mixes), window 8, an indexer of 2 heads x 32 with top
    4; ratios 0, 2, 2, 1, 1, 1, kv sources 1 and 3, index sources 1, 3 and 5; engram before 0 and 1
    (2 columns of 256, wkv [160, 512])."""
    cfg = tiny_engine.cfg
    assert (cfg.dim, cfg.q_lora_rank, cfg.n_heads, cfg.head_dim, cfg.hc, cfg.window) == (32, 32, 2, 64, 4, 8)
    # per token and layer: wq_a 1024 + wkv 2048 + wq_b 4096 + wo_a 4096 + wo_b 2048 + hc 2 x 3072
    every_layer = 6 * 5 * 19456
    compressors = 5 * 4096 + 2 * 2048 + 5 * 2048 + 5 * 2048  # layer 1 kv + gate, wk x 2 groups; layer 3
    indexers = 3 * 5 * (2048 + 64)
    engram = 2 * 5 * 160 * 512
    # visible groups at p = 1..5: ratio 2: 0 0+1 1 2 2 = 6, ratio 1: 15
    scores = 2 * (6 + 15 + 15) * 2 * 32
    # entries: window 1+2+3+4+5 = 15 a layer; + ratio 2: 0+1+1+2+2, ratio 1: 1+2+3+4+4
    entries = 6 * 15 + 2 * 6 + 3 * 14
    want = ps.PrefillFlops(2 * (every_layer + compressors + indexers + engram), scores, 4 * entries * 2 * 64)
    assert ps.prefill_flops(cfg, 5) == want
    assert want.total == want.products + want.index_scores + want.attention


def test_the_stack_rows_run_only_when_named() -> None:
    names = [s.name for s in ps.PREFILL_STACKS]
    assert names == ["prefill.stack.4k.40", "prefill.stack.32k.40", "prefill.stack.32k", "prefill.stack.128k",
                     "prefill.stack.1m"]
    cases = bench.all_cases(BenchOptions(weight_types=("Q8_0",)))
    assert [c.name for c in bench.select_cases(cases, ["prefill.stack*"])] == names
    assert [c.name for c in bench.select_cases(cases, ["prefill.stack.32k"])] == ["prefill.stack.32k"]
    assert not set(names) & {c.name for c in bench.select_cases(cases, [])}, "a plain bench runs them"
    assert not set(names) & {c.name for c in bench.select_cases(cases, ["prefill.gemm.*"])}
    assert "prefill.gemm.attn.wq_a.Q8_0" in [c.name for c in bench.select_cases(cases, [])]
    forty = [s for s in ps.PREFILL_STACKS if s.preset == "flash40"]
    assert {s.filename for s in forty} == {STACKS[1].filename} and all(not s.overrides for s in forty), \
        "the 40-layer rows reuse stack.decode.40's model file"
    assert max(s.tokens for s in ps.PREFILL_STACKS) <= ps.CONTEXT_6
    assert [s.name for s in ps.PREFILL_STACKS if s.target] == ["prefill.stack.32k"]


def test_rows_of_a_run(tiny_engine, marked: dict[str, float]) -> None:
    stack = ps.PrefillStack("prefill.stack.test", "tiny", 5, "unused.gguf", target=ps.TARGET_TOKENS_S)
    parts = {part: 1e-3 * (i + 1) for i, part in enumerate(marked)}
    l2 = L2Plan("hbm", 1 << 30, 50 << 20)
    rows = ps.stack_rows(stack, tiny_engine.cfg, 0.5, parts, l2)
    head = rows[0]
    flops = ps.prefill_flops(tiny_engine.cfg, 5).total
    assert head.name == "prefill.stack.test" and head.median_s == 0.5 and head.flops == flops
    assert head.ratio == pytest.approx(0.5 / (flops / (bench.PEAK_TFLOPS * 1e12)))
    assert list(head.split) == list(ps.CATEGORY_NAMES)
    assert sum(head.split.values()) == pytest.approx(sum(parts.values()))
    assert "10 tokens/s wall clock (P5L must reach 8,000" in head.note
    assert all(f"{name} {seconds:.2f} s (" in head.note for name, seconds in head.split.items())
    assert [r.name for r in rows[1:]] == [f"prefill.stack.test.part.{p}" for p in parts]
    got = json.loads(json.dumps(head.to_json()))
    assert got["split"] == pytest.approx(head.split) and got["l2_mode"] == "hbm"


def test_a_row_without_a_split_keeps_its_json() -> None:
    assert "split" not in BenchRow("gemv.attn.wq_a.Q8_0", 2e-6, 1e-6).to_json()


def test_an_engine_too_large_is_refused(tiny_path) -> None:
    model = flashv41.load_model(tiny_path)
    try:
        estimate = ps.require_memory(model, 64, 8, 1 << 40, "prefill.stack.test")
        with pytest.raises(CapacityError, match=r"prefill.stack.test: an engine with max_seq 64 .* needs about"):
            ps.require_memory(model, 64, 8, estimate.total_bytes(1) - 1, "prefill.stack.test")
    finally:
        model.close()


def test_the_timed_prefill_shows_its_progress(tiny_engine, capsys: pytest.CaptureFixture[str]) -> None:
    """A named prefill (the timed one) says on stderr how many chunks it runs (a log line every
    PROGRESS_EVERY_S seconds after that, a bar on a terminal); the warm-up, unnamed, says nothing."""
    seq = tiny_engine.new_sequence()
    ps.prefill_chunks(tiny_engine, seq, np.arange(2 * TOKENS) % tiny_engine.cfg.vocab_size,
                      ps.PartEvents(tiny_engine.attention.stream), "prefill.stack.test")
    seq.release()
    assert "prefill.stack.test: 2 chunks" in capsys.readouterr().err
    seq = tiny_engine.new_sequence()
    ps.prefill_chunks(tiny_engine, seq, np.arange(TOKENS) % tiny_engine.cfg.vocab_size,
                      ps.PartEvents(tiny_engine.attention.stream))
    seq.release()
    assert capsys.readouterr().err == ""

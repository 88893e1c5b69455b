"""AttentionStage.forward against host.oracle.attention.attention_layer, layer by layer, every block type.

The stage and the oracle run side by side on the same x (the normed sublayer input, drawn once per
layer and position, so every chunking sees the same inputs), each with its own state (device
AttentionState / oracle LayerState) and its own shared runtime, fed down the six-layer stack.

What is compared, per layer call:
- the capture keys: the same set as the oracle's;
- integers exactly: the groups a chunk completes, the selection and the candidate blocks, except on
  rows where the index scores themselves differ (then the oracle's select() applied to the stage's
  own scores must give the stage's selection, and those scores must agree with the oracle's to a
  cosine of 0.999: a bf16 ulp in a projection that moves an fp4 code of an index query or key moves
  a score by a few percent at most, and nothing else can change it);
- the layer output on the other rows: cosine >= 0.99999 and no value off by more than
  2^-4 of its row's largest (one flipped fp8 / fp4 code, diluted by the softmax and the projections,
  stays far below that; a wrong row, scale, rotation or order does not).
Across chunkings the outputs at each position agree with the one-shot prefill the same way.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from numba import cuda  # noqa: E402  (after conftest chose the backend)

from flashv41.host.errors import CapacityError, InputError, SequenceStateError, UnsupportedError
from flashv41.host.numerics import bf16, from_bits, to_bits
from flashv41.host.oracle import Oracle
from flashv41.host.oracle import attention as oracle
from flashv41.model import load_model
from flashv41.stages.attention import AttentionStage  # noqa: E402
from flashv41.stages.sparse_attention import SparseWorkspace  # noqa: E402

COSINE = 0.99999
STATE_SAME = 0.999
STATE_COSINE = 0.9999
ROW_REL = 2.0**-4
SCORE_COSINE = 0.999
X_STD = 0.025  # the normed sublayer input: attn_norm weights ~0.025 times a unit-RMS row


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    den = np.sqrt((a64 @ a64) * (b64 @ b64))
    return 1.0 if den == 0 else float(a64 @ b64 / den)


def assert_rows_close(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    c = cosine(got, ref)
    limit = ROW_REL * np.abs(ref).max(axis=-1, keepdims=True)
    worst = float((np.abs(got - ref) - limit).max()) if got.size else 0.0
    assert c >= COSINE and worst <= 0, (f"{what}: cosine {c:.7f} (>= {COSINE}), "
                                        f"worst excess over the row bound {worst:.3e}")


class SideBySide:
    """One sequence on the stage and on the oracle, with the inputs of every (layer, position)."""

    def __init__(self, stage: AttentionStage, orc: Oracle, total: int, seed: int):
        cfg = stage.cfg
        self.stage, self.orc, self.cfg = stage, orc, cfg
        rng = np.random.default_rng(seed)
        self.x = [bf16((rng.standard_normal((total, cfg.dim)) * X_STD).astype(np.float32)) for _ in cfg.roles]
        self.out = [np.zeros((total, cfg.dim), np.float32) for _ in cfg.roles]
        self.state = stage.new_state()
        self.ostates = [oracle.LayerState.create(cfg, role, stage.max_seq) for role in cfg.roles]
        self.weights = [orc.attention_weights(i) for i in range(cfg.n_layers)]
        self.position = 0
        self.flipped_rows = 0
        self.explained = np.zeros(0, bool)  # rows of the current call whose selection differs, explained
        self.worst = [(1.0, 0.0) for _ in cfg.roles]  # per layer: lowest cosine, largest |error|

    def run(self, chunks: list[int]) -> None:
        for t in chunks:
            self.forward(t)

    def forward(self, t: int) -> None:
        cfg, start = self.cfg, self.position
        shared, oshared = self.stage.new_shared(), oracle.SharedRuntime()
        xd = cuda.device_array((self.stage.max_tokens, cfg.dim), np.uint16)
        out = cuda.device_array((self.stage.max_tokens, cfg.dim), np.uint16)
        positions = start + np.arange(t)
        for role in cfg.roles:
            i = role.layer
            x = self.x[i][start:start + t]
            xd[:t].copy_to_device(to_bits(x))
            cap: dict = {}
            ocap: dict = {}
            self.stage.forward(i, xd, out, self.state, shared, start, t, cap)
            ref = oracle.attention_layer(cfg, role, self.weights[i], self.orc.tables, self.ostates[i], oshared, x,
                                         start, ocap)
            got = from_bits(out.copy_to_host()[:t])
            where = f"layer {i} ({role.block_type}) positions {start}..{start + t - 1}"
            assert set(cap) == set(ocap), f"{where}: capture keys {sorted(cap)} vs {sorted(ocap)}"
            same = np.ones(t, bool)
            if role.ratio > 0:
                assert np.array_equal(cap["groups"], ocap["groups"]), where
                same = self.check_selection(role, cap, ocap, positions, where)
            assert_rows_close(got[same], ref[same], where)
            self.worst[i] = (min(self.worst[i][0], cosine(got[same], ref[same])),
                             max(self.worst[i][1], float(np.abs(got[same] - ref[same]).max(initial=0))))
            self.out[i][start:start + t] = got
        self.position += t

    def check_selection(self, role, cap: dict, ocap: dict, positions: np.ndarray, where: str) -> np.ndarray:
        """Rows whose selection (and candidate blocks) equal the oracle's. On an index source the other
        rows must be explained by its own scores (see the module docstring); a consumer may differ
        only on rows its index source explained."""
        differs = ~np.all(cap["selection"] == ocap["selection"], axis=1)
        if "candidates" in ocap:
            differs |= ~np.all(cap["candidates"] == ocap["candidates"], axis=1)
        if not role.index_source:
            assert not (differs & ~self.explained).any(), f"{where}: selection differs where its source's did not"
            return ~differs
        self.explained = differs
        if not differs.any():
            return ~differs
        assert "index_score" in cap, f"{where}: selection differs before any group is complete"
        candidates = cap.get("candidates") if role.uses_candidates else None
        own, _ = oracle.select(self.cfg, role, cap["index_score"], positions, candidates)
        assert np.array_equal(own, cap["selection"]), f"{where}: the selection is not top-k of the stage's own scores"
        for r in np.flatnonzero(differs):
            c = cosine(cap["index_score"][r], ocap["index_score"][r])
            assert c >= SCORE_COSINE, f"{where}: row {r} selection differs with scores at cosine {c:.5f}"
        self.flipped_rows += int(differs.sum())
        assert self.flipped_rows <= 0.1 * len(positions) * self.cfg.n_layers + 1, f"{where}: too many flipped rows"
        return ~differs

    def report(self) -> str:
        return "\n".join(f"layer {i} {role.block_type:28s} cosine >= {c:.7f}, max |error| {e:.3e}, "
                         f"max |out| {np.abs(self.out[i]).max():.3e}"
                         for i, (role, (c, e)) in enumerate(zip(self.cfg.roles, self.worst, strict=True)))

    def check_state(self) -> None:
        """Rings and caches against the oracle's. They hold quantised values (fp8 rows, fp4 latents
        and keys) computed from inputs equal up to fp32 rounding, so a value sitting on a rounding
        boundary can land one code apart: at least STATE_SAME of the values must be identical,
        and the arrays agree to cosine STATE_COSINE (a single fp4 flip among ~16k values costs
        about 5e-6 of cosine)."""
        for i, (layer, ostate) in enumerate(zip(self.state.layers, self.ostates, strict=True)):
            pairs = [("ring", layer.ring, ostate.window_ring)]
            if layer.source is not None:
                pairs += [("compressed", layer.source.compressed, ostate.compressed),
                          ("index keys", layer.source.index_keys, ostate.index_keys)]
            for what, dev, ref in pairs:
                got = from_bits(dev.copy_to_host())
                same = float((got == ref).mean())
                assert same >= STATE_SAME, f"layer {i} {what}: only {same:.5f} of the values identical"
                assert cosine(got, ref) >= STATE_COSINE, f"layer {i} {what}: cosine {cosine(got, ref):.7f}"


@pytest.fixture(scope="module")
def tiny(tiny_path):
    model = load_model(tiny_path)
    max_seq = 32
    stage = AttentionStage(model, 12, max_seq)
    yield stage, Oracle(model, max_seq)
    stage.free()
    model.close()


@pytest.fixture(scope="module")
def one_shot(tiny):
    """Prefill of 12 positions in one call (the window wraps, six ratio-2 groups), then decode steps."""
    run = SideBySide(*tiny, total=16, seed=1)
    run.run([12, 1, 1, 1, 1])
    return run


def test_prefill_then_decode(one_shot):
    one_shot.check_state()


@pytest.mark.slow
@pytest.mark.parametrize("chunks", [[3, 3, 3, 3, 1, 1, 1, 1], [5, 5, 2, 1, 1, 1, 1]], ids=["chunks3", "chunks5"])
def test_chunked_prefill_matches_one_shot(tiny, one_shot, chunks):
    """Chunks of 3 and 5 (groups and the window split across calls), then decode: each call against
    the oracle, and every position's output against the one-shot run's."""
    run = SideBySide(*tiny, total=16, seed=1)
    run.run(chunks)
    run.check_state()
    for i, (got, ref) in enumerate(zip(run.out, one_shot.out, strict=True)):
        assert_rows_close(got, ref, f"layer {i}: chunks {chunks} vs one shot")


@pytest.mark.slow
def test_prefill_in_sparse_subchunks(tiny, one_shot, monkeypatch):
    """The one-shot run's 12-token prefill and decode steps with the sparse attention's workspace cut
    to 5 tokens: the prefill's attention runs in sub-chunks of 5, 5 and 2, the later ones reading the
    earlier ones' window rows from the chunk's. Every layer's output has the one-shot run's bits: the
    cores are chosen for the whole chunk, and neither the simulator's (CUDA cores) nor a GPU's (tensor
    cores, head_dim 64) gives a token other bits for another cut."""
    stage, _ = tiny
    cfg = stage.cfg
    entries = stage.sparse_ws.scores.shape[2]
    monkeypatch.setattr(stage, "sparse_ws", SparseWorkspace.allocate(5, cfg.n_heads, cfg.head_dim, entries, most=5))
    state = stage.new_state()
    xd = cuda.device_array((stage.max_tokens, cfg.dim), np.uint16)
    out = cuda.device_array((stage.max_tokens, cfg.dim), np.uint16)
    start = 0
    for t in (12, 1, 1, 1, 1):
        shared = stage.new_shared()
        for role in cfg.roles:
            i = role.layer
            xd[:t].copy_to_device(to_bits(one_shot.x[i][start:start + t]))
            stage.forward(i, xd, out, state, shared, start, t)
            got, want = out.copy_to_host()[:t], to_bits(one_shot.out[i][start:start + t])
            assert np.array_equal(got, want), f"layer {i} positions {start}..{start + t - 1}: " \
                f"{int((got != want).sum())} of {got.size} values differ from the one-shot run's"
        start += t
    state.free()


def test_decode_allocates_nothing_and_uploads_the_position(tiny, monkeypatch):
    """A decode step down the stack makes no device allocation and one host-to-device copy (the
    positions, shared by the layers)."""
    stage, _ = tiny
    cfg = stage.cfg
    state = stage.new_state()
    x = cuda.to_device(np.zeros((1, cfg.dim), np.uint16))
    out = cuda.device_array((1, cfg.dim), np.uint16)
    shared = stage.new_shared()
    for layer in range(cfg.n_layers):
        stage.forward(layer, x, out, state, shared, 0, 1)

    def refuse(*args, **kwargs):
        raise AssertionError("a device allocation inside a decode step")

    for name in ("device_array", "to_device", "device_array_like", "pinned_array", "mapped_array", "managed_array"):
        if hasattr(cuda, name):
            monkeypatch.setattr(cuda, name, refuse)
    copies = []
    array_type = type(stage.positions)
    original = array_type.copy_to_device

    def counted(self, *args, **kwargs):
        copies.append(self.shape)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(array_type, "copy_to_device", counted)
    for position in (1, 2):
        shared = stage.new_shared()
        for layer in range(cfg.n_layers):
            stage.forward(layer, x, out, state, shared, position, 1)
    assert copies == [(1,), (1,)]
    state.free()


def test_errors_are_clear(tiny):
    stage, _ = tiny
    cfg = stage.cfg
    state = stage.new_state()
    x = cuda.to_device(np.zeros((stage.max_tokens + 1, cfg.dim), np.uint16))
    out = cuda.device_array((stage.max_tokens + 1, cfg.dim), np.uint16)
    with pytest.raises(CapacityError, match="max_tokens"):
        stage.forward(0, x, out, state, stage.new_shared(), 0, stage.max_tokens + 1)
    with pytest.raises(CapacityError, match="max_seq"):
        stage.forward(0, x, out, state, stage.new_shared(), stage.max_seq - 1, 2)
    with pytest.raises(InputError, match="attention x"):
        stage.forward(0, cuda.device_array((4, cfg.dim), np.float32), out, state, stage.new_shared(), 0, 2)
    with pytest.raises(InputError, match="attention out"):
        stage.forward(0, x, cuda.device_array((4, cfg.dim + 1), np.uint16), state, stage.new_shared(), 0, 2)
    with pytest.raises(InputError, match="layer 9"):
        stage.forward(9, x, out, state, stage.new_shared(), 0, 2)
    consumer = next(r.layer for r in cfg.roles if r.ratio > 0 and not r.kv_source and not r.index_source)
    with pytest.raises(InputError, match="no kv source ran before it"):
        stage.forward(consumer, x, out, state, stage.new_shared(), 0, 2)
    later = next(r.layer for r in cfg.roles if r.uses_candidates)
    shared = stage.new_shared()
    for layer in range(later):
        if cfg.roles[layer].candidate_source:
            continue  # skip the candidate source: its mask is missing below
        stage.forward(layer, x, out, state, shared, 0, 2)
    with pytest.raises(InputError, match="candidate mask"):
        stage.forward(later, x, out, state, shared, 0, 2)
    state.free()
    state.free()
    with pytest.raises(SequenceStateError):
        stage.forward(0, x, out, state, stage.new_shared(), 0, 2)
    with pytest.raises(SequenceStateError):
        state.reset()


def test_stage_free_is_idempotent(tiny_path):
    model = load_model(tiny_path)
    stage = AttentionStage(model, 2, 16)
    assert stage.weight_bytes(1) > stage.weight_bytes(0) > 0 and stage.workspace_bytes() > 0
    stage.free()
    stage.free()
    with pytest.raises(SequenceStateError):
        stage.new_state()
    with pytest.raises(CapacityError, match="context length"):
        AttentionStage(model, 2, model.config.context_length + 1)
    model.close()


def test_model_without_engram_layers(synth_model):
    """A model with no engram layer (as the flash-dimension GPU test and the bench write one) loads
    and runs the whole stack."""
    model = load_model(synth_model("tiny", engram_layers=()))
    assert model.config.engram is None
    stage = AttentionStage(model, 2, 8)
    state = stage.new_state()
    x = cuda.to_device(np.zeros((2, model.config.dim), np.uint16))
    out = cuda.device_array((2, model.config.dim), np.uint16)
    shared = stage.new_shared()
    for layer in range(model.config.n_layers):
        stage.forward(layer, x, out, state, shared, 0, 2)
    assert not from_bits(out.copy_to_host()).any()  # x = 0: every projection and the attention are zero
    stage.free()
    model.close()


def test_bench_cases():
    """The attention bench rows (flashv41 bench, GPU only): one case per weight type at 1k, Q8_0 and
    BF16 at 16k, 64k and 1M too; the bound adds the caches a step reads; clear refusal of a type
    without random stored blocks."""
    from flashv41.bench.attention import cache_bytes, cases
    from flashv41.bench.core import BenchOptions
    from flashv41.host.config import LayerRole

    assert [c.name for c in cases(BenchOptions(weight_types=("Q8_0", "Q2_K", "BF16")))] == [
        "attention.decode.Q8_0", "attention.decode.Q2_K", "attention.decode.BF16", "attention.decode.Q8_0.16k",
        "attention.decode.BF16.16k", "attention.decode.Q8_0.64k", "attention.decode.BF16.64k",
        "attention.decode.Q8_0.1m", "attention.decode.BF16.1m"]
    flash = SimpleNamespace(window=128, index_topk=512, head_dim=512, index_head_dim=128)
    swa = LayerRole(0, 0, False, False, False, False, False)
    index_r1 = LayerRole(3, 1, True, True, True, False, False)
    consumer_r2 = LayerRole(2, 2, False, False, False, False, False)
    assert cache_bytes(flash, swa, 65535) == 128 * 512 * 2
    assert cache_bytes(flash, swa, 10) == 11 * 512 * 2  # only the positions that exist
    assert cache_bytes(flash, consumer_r2, 65535) == (128 + 512) * 512 * 2
    assert cache_bytes(flash, index_r1, 65535) == (128 + 512) * 512 * 2 + 65536 * 128 * 2

    assert [c.name for c in cases(BenchOptions(weight_types=("Q4_K",)))] == ["attention.decode.Q4_K"]
    with pytest.raises(UnsupportedError, match="Q4_0"):
        cases(BenchOptions(weight_types=("Q4_0",)))


# ---- on the GPU -----------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_small_prefill_chunks_and_decode(small_path):
    """The small preset (dim 256, 4 heads x 64, window 16, index 4 x 64 top-8): one-shot prefill of
    40, then chunks of 3 and 5 to 40, each followed by decode steps past several window wraps."""
    model = load_model(small_path)
    max_seq = 64
    stage = AttentionStage(model, 40, max_seq)
    orc = Oracle(model, max_seq)
    one = SideBySide(stage, orc, total=48, seed=2)
    one.run([40] + [1] * 8)
    one.check_state()
    print(f"\nsmall, one-shot prefill + decode ({one.flipped_rows} rows with a different selection):\n" + one.report())
    for step in (3, 5):
        run = SideBySide(stage, orc, total=48, seed=2)
        run.run([step] * (40 // step) + [40 % step] * (40 % step > 0) + [1] * 8)
        run.check_state()
        for i, (got, ref) in enumerate(zip(run.out, one.out, strict=True)):
            assert_rows_close(got, ref, f"layer {i}: chunks of {step} vs one shot")
    stage.free()
    model.close()


@pytest.mark.gpu
def test_flash_dimensions(synth_model):
    """V4.1-Flash dimensions (64 heads x 512, q_lora 1280, window 128, index 32 x 128, top-512,
    8 output groups), the six-layer schedule, no engram: prefill of 200 tokens in chunks of 64, then
    8 decode steps, each layer against the oracle. Prints cosine and max error per layer."""
    path = synth_model("flash", vocab=1024, engram_layers=())
    model = load_model(path)
    max_seq = 256
    stage = AttentionStage(model, 64, max_seq)
    orc = Oracle(model, max_seq)
    run = SideBySide(stage, orc, total=208, seed=3)
    run.run([64, 64, 64, 8] + [1] * 8)
    run.check_state()
    print(f"\nflash dimensions, 200 prefill + 8 decode ({run.flipped_rows} rows with a different selection):\n"
          + run.report())
    stage.free()
    model.close()

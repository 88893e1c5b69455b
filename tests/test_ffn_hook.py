"""The FFN sublayer as a hook (flashv41.ffn): what the callback is given and where its output goes,
a zero callback giving ffn=None's highway bit for bit, its errors, and when graphs stay on."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest

import flashv41
from flashv41 import engine as engine_module
from flashv41.check import BIT_EQUAL_MIN, INPUT_ULPS, bf16_ulp, compare_call
from flashv41.ffn import FfnStream, capturable, host_ffn, is_capturable, stream_handle
from flashv41.host.errors import CallbackError, InputError, SequenceStateError, UnsupportedError
from flashv41.host.numerics import bf16, from_bits
from flashv41.host.oracle import Oracle

TOKENS = np.array([5, 17, 99, 3, 42, 8, 77, 120, 1, 64, 33])


@pytest.fixture(scope="module")
def moe_model(synth_model):
    with flashv41.load_model(synth_model("tiny", moe=True)) as model:
        yield model


def half(layer: int, x: np.ndarray) -> np.ndarray:
    """A host FFN: y = x / 2 + layer / 8 (exact in bf16 for these inputs' scale)."""
    return (x * np.float32(0.5) + np.float32(layer / 8)).astype(np.float32)


def test_a_zero_callback_is_the_zero_ffn_bit_for_bit(moe_model) -> None:
    """The callback's path (mixes_norm, the callback, post_mix) with an output of zeros gives the
    highway of ffn=None's fused launches, bit for bit, prefill chunk and decode step alike."""
    def zero(layer, x, out, stream) -> None:
        out.copy_to_device(np.zeros(out.shape, np.uint16))

    plain = flashv41.Engine(moe_model, max_seq=32, max_tokens=8)
    hooked = flashv41.Engine(moe_model, max_seq=32, max_tokens=8, ffn=zero)
    assert any(lp.hyper.ffn_in_one for lp in plain.plan.layers)
    assert not any(lp.hyper.ffn_in_one for lp in hooked.plan.layers)
    assert [lp.ffn for lp in plain.plan.layers] == [None] * 6
    a, b = plain.new_sequence(), hooked.new_sequence()
    for ids in (TOKENS[:8], TOKENS[8:9]):
        assert np.array_equal(a.prefill(ids).view(np.uint32), b.prefill(ids).view(np.uint32))
    assert np.array_equal(a.logits().view(np.uint32), b.logits().view(np.uint32))


def test_the_callback_gets_the_ffn_input_and_its_output_is_added(moe_model) -> None:
    """Each layer's x is ffn_norm(hc_pre(h, the attention's pre)), as the oracle computes it from the
    same inputs (>= 99% bit-equal, none more than INPUT_ULPS bf16 ulps off: flashv41.check says why a
    normed input may be three), and what the callback writes is the sublayer's output: the layers
    agree with an oracle running the same host function."""
    seen: dict[int, np.ndarray] = {}

    def recording(layer: int, x: np.ndarray) -> np.ndarray:
        seen[layer] = x.copy()
        return half(layer, x)

    engine = flashv41.Engine(moe_model, max_seq=32, max_tokens=16, ffn=host_ffn(recording))
    ref = Oracle(moe_model, max_seq=32, ffn=half).new_sequence()
    _, call = compare_call(engine.new_sequence(), ref, TOKENS)
    assert call.ok, call.describe()
    for i, cap in enumerate(ref.captures):
        want = cap["ffn_in"]
        got = seen[i]
        assert got.shape == (TOKENS.size, moe_model.config.dim)
        equal = float((got == want).mean())
        ulp = np.maximum(bf16_ulp(want), bf16_ulp(got))
        assert equal >= BIT_EQUAL_MIN and (np.abs(got - want) <= INPUT_ULPS * ulp).all(), \
            f"layer {i}: {equal:.2%} bit-equal"
        assert np.array_equal(cap["ffn_out"], bf16(half(i, want)))


def test_a_raising_callback_fails_its_call_and_leaves_the_engine_usable(moe_model) -> None:
    state = {"raise": True}

    def flaky(layer, x, out, stream) -> None:
        if state["raise"] and layer == 2:
            raise RuntimeError("the experts are on holiday")
        out.copy_to_device(np.zeros(out.shape, np.uint16))

    engine = flashv41.Engine(moe_model, max_seq=32, max_tokens=8, ffn=flaky)
    seq = engine.new_sequence()
    with pytest.raises(CallbackError, match=r"the FFN callback .*flaky raised RuntimeError at layer 2 \(3 tokens\): "
                                            r"the experts are on holiday") as caught:
        seq.prefill(TOKENS[:3])
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert seq.failed
    with pytest.raises(SequenceStateError, match="failed in the middle of a call"):
        seq.logits()
    state["raise"] = False
    other = engine.new_sequence()
    assert other.prefill(TOKENS[:3]).shape == (3, 4, 32)
    engine.close()
    with pytest.raises(SequenceStateError, match="released"):
        other.logits()
    with pytest.raises(SequenceStateError, match="engine was closed"):
        engine.new_sequence()


def test_host_ffn_names_a_wrong_output(moe_model) -> None:
    engine = flashv41.Engine(moe_model, max_seq=32, max_tokens=8, ffn=host_ffn(lambda layer, x: x[:, :3]))
    with pytest.raises(CallbackError, match=r"host_ffn\(.*lambda.*\) raised InputError at layer 0") as caught:
        engine.new_sequence().prefill(TOKENS[:2])
    assert "returned float32 (2, 3) for layer 0, expected float (2, 32)" in str(caught.value)


def test_bad_ffn_arguments(moe_model, tiny_path) -> None:
    with pytest.raises(InputError, match="ffn must be a callable"):
        flashv41.Engine(moe_model, max_seq=32, max_tokens=8, ffn=3)  # type: ignore[arg-type]
    with flashv41.load_model(tiny_path) as plain, pytest.raises(UnsupportedError, match="ffn_norm"):
        flashv41.Engine(plain, max_seq=32, max_tokens=8, ffn=host_ffn(half))


def test_graphs_stay_on_only_for_a_capturable_callback(moe_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where graphs would run, a callback not marked capturable turns them off for its engine, with
    one warning; a capturable one, and ffn=None, keep them."""
    monkeypatch.setattr(engine_module, "graphs_available", lambda: True)
    monkeypatch.setattr(engine_module, "GraphRunner", lambda: SimpleNamespace())

    def eager(layer, x, out, stream) -> None:
        pass

    with pytest.warns(UserWarning, match=r"FFN callback .*eager is not marked capturable") as record:
        assert not flashv41.Engine(moe_model, max_seq=16, max_tokens=4, ffn=eager).graphs
    assert len(record) == 1

    @capturable
    def launched(layer, x, out, stream) -> None:
        pass

    assert is_capturable(launched) and not is_capturable(eager)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert flashv41.Engine(moe_model, max_seq=16, max_tokens=4, ffn=launched).graphs
        assert flashv41.Engine(moe_model, max_seq=16, max_tokens=4).graphs


def test_the_stream_handle() -> None:
    assert stream_handle(0) == 0 and stream_handle(None) == 0
    assert stream_handle(SimpleNamespace(handle=1234)) == 1234
    assert stream_handle(SimpleNamespace(handle=SimpleNamespace(value=77))) == 77  # a ctypes pointer
    assert stream_handle(SimpleNamespace(stream=SimpleNamespace(handle=99))) == 99  # a graph builder
    assert FfnStream(0, 0).handle == 0


def test_the_callback_sees_device_arrays_and_the_stream(moe_model) -> None:
    """x and out are the engine's workspaces' first T rows (bf16 bits), the stream the stages'."""
    calls = []

    def look(layer, x, out, stream) -> None:
        calls.append((layer, x.shape, x.dtype, out.shape, stream))
        out.copy_to_device(x.copy_to_host())  # the identity FFN

    engine = flashv41.Engine(moe_model, max_seq=16, max_tokens=8, ffn=look)
    engine.new_sequence().prefill(TOKENS[:4])
    assert [c[0] for c in calls] == list(range(6))
    assert all(c[1] == (4, 32) and c[2] == np.uint16 and c[3] == (4, 32) for c in calls)
    assert all(c[4] == FfnStream(0, 0) for c in calls)
    assert from_bits(engine.ffn_out[:4].copy_to_host()).shape == (4, 32)

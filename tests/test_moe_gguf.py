"""The FFN and head tensors in the three layouts: host.synth writes them (`moe=True`) after the
others, which keep their bytes; host.gguf_moe reads them back, with their keys, into MoEConfig, and
refuses a partial or misshapen set naming the tensor or key at fault."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType

import flashv41
from flashv41.host import gguf_layout as L
from flashv41.host.config import V41_ROUTE_SCALE, V41_SCORE_FUNC, V41_SWIGLU_LIMIT
from flashv41.host.errors import InputError, ModelFormatError, UnsupportedError
from flashv41.host.gguf_moe import DS4_MOE_KEYS, MOE_KEYS, host_dequantize
from flashv41.host.synth import resolve_type_map
from tests.gguf_edit import rewrite_gguf

LAYOUTS = (L.LLAMA_CPP, L.MXXM_T, L.DS4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_files_load_in_every_layout(synth_model, layout: str) -> None:
    with flashv41.load_model(synth_model("tiny", moe=True, layout=layout)) as model:
        cfg = model.config
        assert cfg.ffn_norm and cfg.head
        assert cfg.moe is not None
        assert (cfg.moe.n_experts, cfg.moe.n_active, cfg.moe.inter_dim, cfg.moe.shared_inter_dim) == (4, 2, 64, 64)
        assert (cfg.moe.score_func, cfg.moe.route_scale, cfg.moe.swiglu_limit, cfg.moe.norm_topk) == \
            ("sqrtsoftplus", 1.5, 10.0, True)
        assert cfg.moe.defaults == ()
        assert model.tensor(2, "exp_probs_b").name == "blk.2.exp_probs_b.bias"
        assert model.tensor(0, "ffn_down_exps").shape == (4, 32, 64)
        assert model.tensor(None, "output").shape == (cfg.vocab_size, cfg.dim)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_leaves_the_other_tensors_bytes_alone(synth_model, layout: str) -> None:
    """A model written with moe=True holds every tensor of the one written without, byte for byte
    (its FFN and head tensors come after them), and a file without them loads as before."""
    with flashv41.load_model(synth_model("tiny", layout=layout)) as plain, \
            flashv41.load_model(synth_model("tiny", moe=True, layout=layout)) as moe:
        assert not plain.config.ffn_norm and plain.config.moe is None and not plain.config.head
        names = {t.name: t for t in moe.weights}
        for t in plain.weights:
            assert np.array_equal(np.asarray(t.data), np.asarray(names[t.name].data)), t.name
        extra = set(names) - {t.name for t in plain.weights}
        assert len(extra) == plain.config.n_layers * 9 + 2


def test_host_only_expert_types(synth_model) -> None:
    """Routed experts in IQ2_XXS (ds4's gate / up) and Q2_K load, and dequantise through gguf-py to
    values of the intended RMS (gain / sqrt(fan_in))."""
    path = synth_model("tiny256", moe=True, type_map={"ffn_gate_exps": "IQ2_XXS", "ffn_up_exps": "IQ2_XXS",
                                                      "ffn_down_exps": "Q2_K"})
    with flashv41.load_model(path) as model:
        ref = model.tensor(0, "ffn_gate_exps")
        assert int(ref.ggml_type) == GGMLQuantizationType.IQ2_XXS
        values = host_dequantize(ref.data[1], ref.ggml_type)
        assert values.shape == (256, 256)
        rms = float(np.sqrt(np.mean(values.astype(np.float64) ** 2)))
        assert rms == pytest.approx(1.5 / 16, rel=0.05)
        assert int(model.tensor(3, "ffn_down_exps").ggml_type) == GGMLQuantizationType.Q2_K


def test_type_map_keeps_host_only_types_to_the_experts() -> None:
    with pytest.raises(UnsupportedError, match="only the routed experts"):
        resolve_type_map({"attn_q_b": "IQ2_XXS"})
    assert resolve_type_map({"ffn_down_exps": "IQ2_XXS"})["ffn_down_exps"] == GGMLQuantizationType.IQ2_XXS


def test_type_map_needs_the_moe(synth_model) -> None:
    with pytest.raises(InputError, match="has no ffn_gate_exps tensor"):
        synth_model("tiny", type_map={"ffn_gate_exps": "Q8_0"})


def _rewritten(src: Path, tmp_path: Path, **changes) -> Path:
    return rewrite_gguf(src, tmp_path / "edited.gguf", **changes)


@pytest.fixture(scope="module")
def moe_path(synth_model) -> Path:
    return synth_model("tiny", moe=True)


@pytest.mark.parametrize("drop, message", [
    ("blk.3.ffn_up_exps.weight", "tensor blk.3.ffn_up_exps.weight is missing, but the file has"),
    ("blk.0.exp_probs_b.bias", "tensor blk.0.exp_probs_b.bias is missing"),
    ("output_norm.weight", "tensor output_norm.weight is missing, but the file has output.weight"),
    ("blk.5.ffn_norm.weight", "tensor blk.5.ffn_norm.weight is missing"),
])
def test_a_partial_set_is_refused(moe_path: Path, tmp_path: Path, drop: str, message: str) -> None:
    with pytest.raises(ModelFormatError, match=message):
        flashv41.load_model(_rewritten(moe_path, tmp_path, drop_tensors=[drop]))


def test_misshapen_tensors_are_refused(moe_path: Path, tmp_path: Path) -> None:
    wrong = np.zeros((4, 64, 2 * 34), np.uint8)  # Q8_0 rows of 64 values where the router says 32
    edited = _rewritten(moe_path, tmp_path, replace_tensors={"blk.1.ffn_gate_exps.weight":
                                                             (wrong, GGMLQuantizationType.Q8_0)})
    with pytest.raises(ModelFormatError, match=r"blk\.1\.ffn_gate_exps\.weight has shape \[4, 64, 64\]"):
        flashv41.load_model(edited)
    head = np.zeros((7, 32), np.float32)
    edited = _rewritten(moe_path, tmp_path, replace_tensors={"output.weight": (head, GGMLQuantizationType.F32)})
    with pytest.raises(ModelFormatError, match=r"output\.weight has shape \[7, 32\]"):
        flashv41.load_model(edited)


def _key(name: str) -> str:
    return L.key(MOE_KEYS[name])


@pytest.mark.parametrize("changes, error, message", [
    ({"set_keys": {_key("n_experts"): (5, GGUFValueType.UINT32, None)}}, ModelFormatError,
     "expert_count = 5, but the MoE tensors have 4"),
    ({"set_keys": {_key("inter_dim"): (32, GGUFValueType.UINT32, None)}}, ModelFormatError,
     "expert_feed_forward_length = 32"),
    ({"drop_keys": [_key("n_active")]}, ModelFormatError, "expert_used_count .* is missing"),
    ({"set_keys": {_key("n_active"): (5, GGUFValueType.UINT32, None)}}, ModelFormatError,
     "expert_used_count = 5, expected 1 to the 4 experts"),
    ({"set_keys": {_key("n_shared"): (2, GGUFValueType.UINT32, None)}}, UnsupportedError, "one shared expert"),
    ({"drop_keys": [_key("score_func")], "set_keys": {_key("gating_func"): (3, GGUFValueType.UINT32, None)}},
     UnsupportedError, "expert_gating_func = 3, not a gating function"),
    ({"set_keys": {_key("score_func"): ("relu", GGUFValueType.STRING, None)}}, UnsupportedError,
     "scoring function 'relu'"),
    ({"set_keys": {_key("route_scale"): (float("nan"), GGUFValueType.FLOAT32, None)}}, ModelFormatError,
     "route scale nan must be finite"),
])
def test_bad_moe_keys_are_refused(moe_path: Path, tmp_path: Path, changes: dict, error: type,
                                  message: str) -> None:
    with pytest.raises(error, match=message):
        flashv41.load_model(_rewritten(moe_path, tmp_path, **changes))


def test_silent_keys_take_v41_values(moe_path: Path, tmp_path: Path) -> None:
    """Where a file does not say the scoring function, route scale, SwiGLU limit or normalisation,
    V4.1's own values apply, and the config names them; gguf-py's gating number and per-layer
    clamp array are read where a file has those instead."""
    silent = [_key(n) for n in ("score_func", "route_scale", "swiglu_limit", "norm_topk")]
    with flashv41.load_model(_rewritten(moe_path, tmp_path, drop_keys=silent)) as model:
        moe = model.config.moe
        assert moe is not None
        assert (moe.score_func, moe.route_scale, moe.swiglu_limit, moe.norm_topk) == \
            (V41_SCORE_FUNC, V41_ROUTE_SCALE, V41_SWIGLU_LIMIT, True)
        assert set(moe.defaults) == {"score_func", "route_scale", "swiglu_limit", "norm_topk"}
    gguf_py = {_key("gating_func"): (2, GGUFValueType.UINT32, None),
               _key("swiglu_clamp"): ([7.0] * 6, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)}
    edited = _rewritten(moe_path, tmp_path, drop_keys=[_key("score_func"), _key("swiglu_limit")], set_keys=gguf_py)
    with flashv41.load_model(edited) as model:
        assert model.config.moe is not None
        assert (model.config.moe.score_func, model.config.moe.swiglu_limit) == ("sigmoid", 7.0)


def test_ds4_reads_its_config_json(synth_model, tmp_path: Path) -> None:
    """A ds4 file without its HF-named MoE keys still says them in the config.json it carries."""
    src = synth_model("tiny", moe=True, layout=L.DS4, n_active=3, route_scale=2.5)
    keys = [L.key(DS4_MOE_KEYS[n]) for n in ("n_active", "route_scale", "score_func")]
    with flashv41.load_model(_rewritten(src, tmp_path, drop_keys=keys)) as model:
        assert model.config.moe is not None
        assert (model.config.moe.n_active, model.config.moe.route_scale) == (3, 2.5)
        assert model.config.moe.defaults == ()

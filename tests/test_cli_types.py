"""Every weight type through the command line: a synthetic model whose every matrix that can hold the
type's blocks takes it (weight type, table type and a type map of the other matrices), in the
llama.cpp, mxxm-t or ds4 layout, one file or a split set; `flashv41 info` names every tensor's type
and `flashv41 run --check` agrees with the oracle layer by layer. Then `synth --type-map` itself:
its types, its summary line, and each bad map refused as one line before anything is written.

The models are one layer, a ratio-2 kv and index source with engram (it has every matrix role, and
a two-token prompt fills a compressor group), with bigram-only engram and two
hyper-connection copies (the engram projection's [dim * (hc + 1), cols * 256] is the largest matrix,
and the simulator's K-quant products are slow). Q3_K .. Q6_K and Q2_K need rows of 256 values: the
tiny256 preset; the others run on tiny's sizes."""

from __future__ import annotations

from pathlib import Path

import pytest

import flashv41
from flashv41.cli import SYNTH_TYPES, main
from flashv41.host import gguf_layout as L
from flashv41.host.quants import FORMATS, GGMLType
from flashv41.host.synth import TYPE_MAP_ROLES, WRITABLE_TYPES, write_synthetic
from tests.test_gguf_layouts import roles_of

ONE_LAYER = {"compress_ratios": (2,), "kv_sources": (0,), "index_sources": (0,), "candidate_source": 1,
             "engram_layers": (0,), "max_ngram": 2, "hc": 2}
# (type, preset, layout, shards, decode steps): the types spread over the layouts and split sets, so
# each of those runs with some type other than the defaults. A prompt of up to 8 tokens takes the
# decode GEMV (stages.linear.pick_kernel), so the prefill streams every matrix as a decode step
# does; the tiny256 models skip the decode step, which would only repeat those products at 10-15 s
# a call on the simulator (the tiny ones, a second a call, take one; the prefill GEMM of the new
# types is tests/test_quants_more.py's)
CASES = [
    ("Q3_K", "tiny256", L.LLAMA_CPP, 1, 0),
    ("Q4_K", "tiny256", L.MXXM_T, 1, 0),
    ("Q5_K", "tiny256", L.DS4, 1, 0),
    ("Q6_K", "tiny256", L.LLAMA_CPP, 3, 0),
    ("Q2_K", "tiny256", L.MXXM_T, 2, 0),
    ("MXFP4", "tiny", L.DS4, 1, 1),
    ("BF16", "tiny", L.LLAMA_CPP, 2, 1),
    ("Q8_0", "tiny", L.MXXM_T, 1, 1),
]


def info_types(out: str) -> list[tuple[str, str, str]]:
    """(section, tensor, type) of every tensor line of `flashv41 info`'s tensor listing."""
    rows, section = [], ""
    listing = out[out.index("tensors (shape"):]
    for line in listing.splitlines()[1:]:
        if line.startswith("    "):
            role, type_name = line.split()[:2]
            rows.append((section, role, type_name))
        elif line.startswith("  "):
            section = line.split(":")[0].strip().split(" (")[0]
        else:
            break
    return rows


def section_of(name: str) -> str:
    parts = name.split(".")
    return f"layer {parts[1]}" if parts[0] == "blk" else "model"


def stem_of(name: str) -> str:
    parts = name.removesuffix(".weight").split(".")
    return ".".join(parts[2:] if parts[0] == "blk" else parts)


def every_fitting_role(gtype: str, preset: str, layout: str, tmp_path: Path) -> tuple[dict[str, str], dict]:
    """The type map that gives `gtype` to every matrix role and the table whose rows hold its
    blocks (not ds4's tables: E4M3 rows only), and each (layer, role)'s type without it."""
    default = write_synthetic(tmp_path / "default.gguf", preset, layout=layout, **ONE_LAYER)
    model = flashv41.load_model(default)
    try:
        refs = {key: model.tensor(*key) for key in roles_of(model.config)}
    finally:
        model.close()
    default.unlink()
    values = FORMATS[GGMLType[gtype]].block_values
    fits = {role for (_, role), ref in refs.items() if role in TYPE_MAP_ROLES and ref.shape[-1] % values == 0}
    if layout == L.DS4:
        fits.discard(L.ENGRAM_TABLE)
    return {role: gtype for role in sorted(fits)}, {key: ref.ggml_type.name for key, ref in refs.items()}


# the tiny256 cases take 4-11 s each on the simulator: the full suite's, not the quick tier's
@pytest.mark.parametrize(("gtype", "preset", "layout", "shards", "decode"),
                         [pytest.param(*c, id=c[0], marks=[pytest.mark.slow] if c[1] == "tiny256" else [])
                          for c in CASES])
def test_every_type_runs_check(gtype: str, preset: str, layout: str, shards: int, decode: int, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    type_map, defaults = every_fitting_role(gtype, preset, layout, tmp_path)
    path = write_synthetic(tmp_path / "m.gguf", preset, layout=layout, shards=shards, type_map=type_map, **ONE_LAYER)
    model = flashv41.load_model(path)
    try:
        assert model.config.layout == layout and len(model.weights.files) == shards
        listed = [(layer, role, model.tensor(layer, role)) for layer, role in roles_of(model.config)]
        for layer, role, ref in listed:
            want = gtype if role in type_map else defaults[(layer, role)]
            assert ref.ggml_type.name == want, (layer, role)
        typed = {role for _, role, ref in listed if ref.ggml_type.name == gtype}
        # every matrix the engine streams in decode holds the type (index keys: rows of head_dim 64)
        assert {"attn_q_a", "attn_q_b", "attn_kv", "attn_output_a", "attn_output_b", "hc_attn_fn",
                "engram_wkv", "indexer.attn_q_b", "attn_compressor_kv"} <= typed, typed
        # info names each tensor by its name in the file without `blk.N.` and `.weight`, under its layer
        expected = sorted((section_of(t.name), stem_of(t.name), t.ggml_type.name) for t in model.weights)
    finally:
        model.close()

    assert main(["info", str(path)]) == 0
    assert sorted(info_types(capsys.readouterr().out)) == expected

    assert main(["run", str(path), "--prompt-len", "2", "--decode", str(decode), "--check"]) == 0
    assert "check: every layer agrees" in capsys.readouterr().out


def test_synth_type_map(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--weight-type and --table-type take every type; --type-map (given twice here) sets roles by
    their llama.cpp or layout names over both, and the summary line says what went where."""
    path = tmp_path / "m.gguf"
    assert main(["synth", "--preset", "tiny256", "-o", str(path), "--weight-type", "Q5_K", "--table-type", "Q6_K",
                 "--layout", "mxxm-t", "--type-map", "attn_q_b=Q3_K,hc_ffn_fn=MXFP4",
                 "--type-map", "engram_embed=q4_k"]) == 0
    out = capsys.readouterr().out
    assert "weights Q5_K, attn_q_b Q3_K, hc_ffn_fn MXFP4, engram tables Q4_K" in out and "layout mxxm-t" in out
    model = flashv41.load_model(path)
    try:
        for layer, role in roles_of(model.config):
            t = model.tensor(layer, role).ggml_type.name
            want = {"attn_q_b": "Q3_K", "hc_ffn_fn": "MXFP4", L.ENGRAM_TABLE: "Q4_K", "attn_q_a": "Q5_K"}.get(role)
            assert want is None or t == want, (layer, role, t)
    finally:
        model.close()


def test_synth_takes_every_writable_type() -> None:
    assert set(SYNTH_TYPES) == set(WRITABLE_TYPES) == {t.name for t in GGMLType}


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and captured.out == "" and "Traceback" not in captured.err, captured
    return lines[0]


@pytest.mark.parametrize(("args", "words"), [
    (["--type-map", "attn_q_b"], ["argument --type-map:", "item 1, 'attn_q_b', is not role=TYPE"]),
    (["--type-map", "attn_q_b=Q4_K,attn_q_b=Q5_K"], ["argument --type-map:", "given twice"]),
    (["--type-map", "attn_q_b=Q4_K", "--type-map", "attn_q_b=Q5_K"], ["--type-map: role 'attn_q_b' is given twice"]),
    (["--type-map", "attn_qb=Q4_K"], ["unknown role 'attn_qb'", "attn_q_b"]),
    (["--type-map", "attn_q_b=Q4_0"], ["attn_q_b=Q4_0", "unknown type 'Q4_0'"]),
    (["--type-map", "attn_kv_a_norm=BF16"], ["attn_kv_a_norm", "is a vector"]),
    (["--type-map", "attn_q_b=Q4_K"], ["attn_q_b=Q4_K", "blk.0.attn_q_b.weight [128, 32]", "rows of 32 values"]),
    (["--type-map", "engram_embd=E4M3_ROW264"], ["engram_embd=E4M3_ROW264", "ds4"]),
    (["--layout", "ds4", "--type-map", "engram_embd=Q8_0"], ["engram_embd=Q8_0", "E4M3_ROW264"]),
    (["--weight-type", "Q4_0"], ["argument --weight-type: invalid choice: 'Q4_0'"]),
])
def test_synth_bad_type_map_is_one_line(args: list[str], words: list[str], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before anything is written: one line naming the role (and the tensor and type), exit 2."""
    assert main(["synth", "-o", str(tmp_path / "m.gguf"), *args]) == 2
    line = one_error_line(capsys)
    assert line.startswith("flashv41: error: "), line
    for w in words:
        assert w in line, (w, line)
    assert list(tmp_path.iterdir()) == []

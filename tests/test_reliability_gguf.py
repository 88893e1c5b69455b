"""Broken and foreign GGUF files, beyond tests/test_gguf_load.py's one-edit-per-rule cases: files
that are not GGUF at all, damaged headers (cut anywhere, bytes overwritten at random), misshapen,
missing and unknown-typed tensors, inconsistent engram tables, damaged values. Each must give a
`FlashError` (`ModelFormatError` or `UnsupportedError`) naming the file and the key or tensor,
quickly (a damaged length must not turn into a long loop or a huge allocation), and afterwards a
good model must still load and run through the engine.
"""

from __future__ import annotations

import gc
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GQ
from gguf import GGUFReader

import flashv41
from flashv41.check import compare_call
from flashv41.host import gguf_layout as L
from flashv41.host.errors import FlashError, InputError, ModelFormatError, SequenceStateError, UnsupportedError
from flashv41.host.gguf_file import open_gguf
from flashv41.host.oracle import Oracle
from tests.gguf_edit import field_value, rewrite_gguf
from tests.reliability import TWO_LAYER_TINY


def expect(path: Path, error: type[Exception], *fragments: str) -> str:
    """load_model(path) raises `error` (exactly that class) whose message holds every fragment."""
    with pytest.raises(FlashError) as caught:
        flashv41.load_model(path)
    message = str(caught.value)
    assert type(caught.value) is error, f"{type(caught.value).__name__}: {message}"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def key(name: str) -> str:
    return L.key(name)


def with_key(src: Path, dst: Path, name: str, change: Callable[[object], object]) -> Path:
    """A copy of src whose metadata key `name` holds change(old value), same type."""
    field = GGUFReader(src).get_field(name)
    assert field is not None, name
    value, vtype, sub_type = field_value(field)
    return rewrite_gguf(src, dst, set_keys={name: (change(value), vtype, sub_type)})


def patched(src: Path, dst: Path, patch: Callable[[GGUFReader], None]) -> Path:
    """A copy of src with bytes changed in place through a writable GGUFReader (for damage that
    GGUFWriter cannot produce: lengths, type numbers, invalid UTF-8)."""
    shutil.copy(src, dst)
    reader = GGUFReader(dst, "r+")
    patch(reader)
    reader.data.flush()
    del reader
    return dst


# --- not a GGUF file --------------------------------------------------------------------------------


# words of gguf-py's or NumPy's own exceptions, which a message about a user's file must not carry
JARGON = ("dtype", "ValueError", "IndexError", "KeyError", "b''", "Sorry")


@pytest.mark.parametrize(("content", "words"), [
    (b"", "the file is empty (0 bytes)"),
    (b"hello, world\n", "it looks like a text file"),
    (b"GG", "only 2 bytes"),
    (b"GGUF", "the file ends inside its GGUF header"),
    (b"GGUF\x03\x00\x00\x00", "the file ends inside its GGUF header"),
    (b"\x00" * 64, "not a GGUF file: it starts with"),
    ("random", "not a GGUF file: it starts with"),
    ("random after the magic", "GGUF version"),
    (b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}", "it looks like a safetensors file"),
    (b"PK\x03\x04" + bytes(40), "it looks like a zip archive"),
], ids=["empty", "text", "two bytes", "magic only", "magic and version", "zeros", "random", "random after magic",
        "safetensors", "zip"])
def test_not_a_gguf(tmp_path: Path, content: bytes | str, words: str) -> None:
    """Each is one sentence about the file, in its owner's terms: empty, too short, truncated, what
    it looks like instead, never the exception gguf-py or NumPy raised on the way."""
    rng = np.random.default_rng(0)
    if content == "random":
        content = rng.bytes(4096)
    elif content == "random after the magic":
        content = b"GGUF" + rng.bytes(4096)
    path = tmp_path / "x.gguf"
    path.write_bytes(content)  # type: ignore[arg-type]
    message = expect(path, ModelFormatError, "x.gguf", words)
    assert not any(jargon in message for jargon in JARGON), message


def test_no_such_file(tmp_path: Path) -> None:
    expect(tmp_path / "absent.gguf", ModelFormatError, "absent.gguf", "no such file")
    expect(tmp_path, ModelFormatError, str(tmp_path), "is a directory, not a GGUF model file")


@pytest.mark.parametrize(("path", "words"), [
    (None, "the path of its GGUF file, got NoneType None"),
    (7, "the path of its GGUF file, got int 7"),
    ("", "the path of its GGUF file, got an empty path"),
])
def test_not_a_path(path: object, words: str) -> None:
    with pytest.raises(InputError, match=words):
        flashv41.load_model(path)  # type: ignore[arg-type]


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.3, 0.6, 0.95])
def test_truncated_anywhere_in_the_header(tiny_path: Path, tmp_path: Path, fraction: float) -> None:
    header = int(GGUFReader(tiny_path).data_offset)
    path = tmp_path / "x.gguf"
    path.write_bytes(tiny_path.read_bytes()[:max(8, int(header * fraction))])
    message = expect(path, ModelFormatError, "x.gguf", "the file ends inside its GGUF header", "truncated")
    assert not any(jargon in message for jargon in JARGON), message


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_in_the_data(tiny_path: Path, tmp_path: Path, keep: float) -> None:
    data = tiny_path.read_bytes()
    path = tmp_path / "x.gguf"
    path.write_bytes(data[:int(len(data) * keep)])
    expect(path, ModelFormatError, "x.gguf", "truncated", "tensor")


def test_damaged_headers_fail_cleanly_and_quickly(tiny_path: Path, tmp_path: Path) -> None:
    """300 copies of the tiny model with one to three header bytes overwritten at random (seeded):
    each loads (the bytes were padding, a name's letter, or a value that is still valid) or raises a
    FlashError, never another exception, and within a second (a load of these takes 7-25 ms; the
    interpreter's cyclic garbage collector is held off while one is timed, so that a collection of
    the whole suite's heap is not counted against it). Before host.gguf_model guarded it, a damaged
    array length made gguf-py loop 2^40 times, and a damaged vocab_size padded the token map to
    gigabytes; and copy 29, whose engram.primes length becomes 46,852 entries that still fit in the
    file, took 1.07 s once and 1.6-1.9 s on 2026-12-02 while gguf-py read them one memory-map view
    at a time (host.gguf_file now reads a numeric array in one view: a few ms)."""
    data = bytearray(tiny_path.read_bytes())
    header = int(GGUFReader(tiny_path).data_offset)
    rng = np.random.default_rng(8)
    path = tmp_path / "x.gguf"
    outcomes = {"loaded": 0, "refused": 0}
    for _ in range(300):
        damaged = bytearray(data)
        for _ in range(int(rng.integers(1, 4))):
            damaged[int(rng.integers(0, header))] = int(rng.integers(0, 256))
        path.write_bytes(damaged)
        outcome, seconds = timed_load(path)
        outcomes[outcome] += 1
        assert seconds < 1.0, "a damaged header took over a second"
    assert outcomes["refused"] > 250, outcomes


def timed_load(path: Path) -> tuple[str, float]:
    """("loaded" or "refused", the seconds load_model took, the cyclic garbage collector held off
    meanwhile); any error but a FlashError propagates."""
    gc.disable()
    try:
        start = time.perf_counter()
        try:
            flashv41.load_model(path).close()
            outcome = "loaded"
        except FlashError:
            outcome = "refused"
        return outcome, time.perf_counter() - start
    finally:
        gc.enable()


@pytest.mark.parametrize("layout", L.LAYOUTS)
def test_reader_fields_are_gguf_pys(synth_model, layout: str) -> None:
    """flashv41's reader (host.gguf_file's, which reads a numeric metadata array in one view) gives
    every field exactly as gguf-py's own reader does: offsets, types, parts (dtype and values),
    data indices and contents; and the same tensors."""
    path = synth_model("tiny") if layout == L.LLAMA_CPP else synth_model("tiny", layout=layout)
    ours, theirs = open_gguf(path)[0], GGUFReader(path)
    assert_fields_are_gguf_pys(ours, theirs)
    assert [(t.name, t.data_offset) for t in ours.tensors] == [(t.name, t.data_offset) for t in theirs.tensors]


def assert_fields_are_gguf_pys(ours: GGUFReader, theirs: GGUFReader) -> None:
    """Every field of our reader as gguf-py's reader gives it: offsets, types, data indices, parts
    (dtype, values and bytes) and contents, in the same order."""
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
        assert len(mine.parts) == len(field.parts), name
        for a, b in zip(mine.parts, field.parts, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b) and a.tobytes() == b.tobytes(), name
        assert mine.contents() == field.contents(), name


def write_string_arrays(path: Path, strings: list[str]) -> None:
    """A GGUF of no tensors whose metadata holds `strings` as an array (and an empty array, and a
    number array after them, so what follows the strings is read from the right offset)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(path, "deepseek4")
    writer.add_array("tokenizer.ggml.tokens", strings)
    writer.add_array("test.empty", [])
    writer.add_array("test.after", [3, 1, 4, 1, 5])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_string_arrays_are_gguf_pys(tmp_path: Path) -> None:
    """A metadata array of strings (host.gguf_file slices each string itself, where gguf-py reads it
    through its general path): every field as gguf-py's reader gives it (assert_fields_are_gguf_pys),
    for empty, ASCII and multi-byte strings."""
    path = tmp_path / "strings.gguf"
    strings = ["", "a", "<|begin▁of▁sentence|>", "Ġthe", "日本語", "x" * 300] + [f"t{i}" for i in range(500)]
    write_string_arrays(path, strings)
    ours = open_gguf(path)[0]
    assert_fields_are_gguf_pys(ours, GGUFReader(path))
    assert ours.fields["tokenizer.ggml.tokens"].contents() == strings


def test_a_string_past_the_end_is_refused(tmp_path: Path) -> None:
    """A string of a metadata array whose length runs past the end of the file: a ModelFormatError
    naming the file, as for any other value read past its end."""
    path = tmp_path / "strings.gguf"
    write_string_arrays(path, ["abc", "def", "ghi"])
    data = bytearray(path.read_bytes())
    at = bytes(data).index(b"def") - 8  # the second string's 8-byte length
    data[at:at + 8] = (1 << 30).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    expect(path, ModelFormatError, "strings.gguf", "ends inside its GGUF header")


def test_huge_metadata_array_length(tiny_path: Path, tmp_path: Path) -> None:
    def patch(reader: GGUFReader) -> None:
        field = reader.get_field(key("engram.token_map"))
        assert field is not None
        field.parts[4][0] = 1 << 40  # [key length, key, value type, item type, length, items...]

    path = patched(tiny_path, tmp_path / "x.gguf", patch)
    start = time.perf_counter()
    expect(path, ModelFormatError, "x.gguf", f"{1 << 40} entries", "bytes left")
    assert time.perf_counter() - start < 1.0


def test_invalid_utf8_string(tiny_path: Path, tmp_path: Path) -> None:
    def patch(reader: GGUFReader) -> None:
        field = reader.get_field("general.architecture")
        assert field is not None
        field.parts[-1][0] = 0xFF  # the first byte of the value

    path = patched(tiny_path, tmp_path / "x.gguf", patch)
    expect(path, ModelFormatError, "general.architecture", "UTF-8")


def test_unknown_tensor_type_number(tiny_path: Path, tmp_path: Path) -> None:
    name = "blk.2.attn_q_b.weight"

    def patch(reader: GGUFReader) -> None:
        t = next(t for t in reader.tensors if t.name == name)
        t.field.parts[4][0] = 200  # [name length, name, n_dims, dims, type, offset]

    path = patched(tiny_path, tmp_path / "x.gguf", patch)
    expect(path, UnsupportedError, name, "type number 200")


# --- tensors ------------------------------------------------------------------------------------------


def _stored(path: Path, name: str) -> np.ndarray:
    return np.asarray(next(t for t in GGUFReader(path).tensors if t.name == name).data)


@pytest.mark.parametrize(("name", "replacement", "fragments"), [
    ("blk.3.attn_norm.weight", lambda d: (np.ones(31, np.float32), GQ.F32), ["[31]", "[32]"]),
    ("token_embd.weight", lambda d: (np.zeros((128, 68), np.uint8), GQ.Q8_0), ["[128, 64]", "[128, 32]"]),
    ("blk.0.engram_embd.weight", lambda d: (np.zeros((d.shape[0], 256), np.uint8), GQ.BF16),
     ["[78, 128]", "[rows, 256]"]),
    ("blk.1.attn_compressor_kv.weight", lambda d: (d[:-1], GQ.BF16), ["[63, 32]", "[64, 32]"]),
], ids=["1-D norm", "embedding width", "engram row width", "compressor rows"])
def test_misshapen_tensor(tiny_path: Path, tmp_path: Path, name: str, replacement, fragments: list[str]) -> None:
    data, qtype = replacement(_stored(tiny_path, name))
    path = rewrite_gguf(tiny_path, tmp_path / "x.gguf", replace_tensors={name: (data, qtype)})
    expect(path, ModelFormatError, name, *fragments)


@pytest.mark.parametrize(("name", "qtype", "block_bytes"), [
    ("blk.2.attn_q_b.weight", GQ.Q4_0, 18),  # blocks of 32 values, as every row width here allows
    ("token_embd.weight", GQ.Q5_0, 22),
    ("blk.4.attn_output_b.weight", GQ.Q4_1, 20),
])
def test_unsupported_quant_type(tiny_path: Path, tmp_path: Path, name: str, qtype: GQ, block_bytes: int) -> None:
    t = next(t for t in GGUFReader(tiny_path).tensors if t.name == name)
    rows, cols = (int(n) for n in reversed(t.shape.tolist()))
    as_other = np.zeros((rows, cols // 32 * block_bytes), np.uint8)
    path = rewrite_gguf(tiny_path, tmp_path / "x.gguf", replace_tensors={name: (as_other, qtype)})
    expect(path, UnsupportedError, name, qtype.name)


@pytest.mark.parametrize("name", ["blk.0.engram_embd.weight", "blk.1.engram_wkv.weight", "blk.5.attn_sinks.weight",
                                  "blk.3.indexer.proj.weight", "blk.1.hc_ffn_base.weight"])
def test_missing_tensor(tiny_path: Path, tmp_path: Path, name: str) -> None:
    path = rewrite_gguf(tiny_path, tmp_path / "x.gguf", drop_tensors=[name])
    expect(path, ModelFormatError, name, "missing")


# --- metadata -------------------------------------------------------------------------------------------


ENGRAM_EDITS = [  # (key, change of the value, words of the error)
    ("engram.primes", lambda v: v[:-1], ["3 entries", "expected 4"]),
    ("engram.primes", lambda v: [1, *v[1:]], ["below 2"]),
    ("engram.offsets", lambda v: [0, 0, 0, 0], ["running sums"]),
    ("engram.multipliers", lambda v: [1 << 62, *v[1:]], ["overflows int64"]),
    ("engram.token_map", lambda v: [-2, *v[1:]], ["-1 (unmapped)"]),
    ("engram.layer_ids", lambda v: [1, 0], ["increasing"]),
    ("engram.layer_ids", lambda v: [0, 9], ["below block_count 6"]),
    ("engram.head_count", lambda v: 0, ["heads=0"]),
    ("engram.max_ngram_size", lambda v: 1, ["max_ngram_size=1"]),
]


@pytest.mark.parametrize(("name", "change", "words"), ENGRAM_EDITS,
                         ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(ENGRAM_EDITS)])
def test_inconsistent_engram_tables(tiny_path: Path, tmp_path: Path, name: str, change, words: list[str]) -> None:
    path = with_key(tiny_path, tmp_path / "x.gguf", key(name), change)
    message = expect(path, ModelFormatError, "x.gguf", *words)
    if name != "engram.head_count" and name != "engram.max_ngram_size":
        assert key(name) in message


VALUE_EDITS = [  # (key, new value, error class, words)
    ("vocab_size", 1 << 31, ModelFormatError, ["token_embd.weight", "vocab_size is 2147483648"]),
    ("attention.output_group_count", 0, ModelFormatError, ["output groups"]),
    ("attention.sliding_window", 5000, ModelFormatError, ["sliding_window", "context_length"]),
    ("attention.indexer.top_k", 0, ModelFormatError, ["top_k"]),
    ("hyper_connection.sinkhorn_iterations", 1 << 30, ModelFormatError, ["sinkhorn_iterations", "at most 1000"]),
    ("attention.indexer.key_length", 48, ModelFormatError, ["indexer.key_length", "multiple of 32"]),
    ("attention.layer_norm_rms_epsilon", float("nan"), ModelFormatError, ["layer_norm_rms_epsilon", "nan"]),
    ("rope.freq_base", -1e4, ModelFormatError, ["rope.freq_base", "-10000.0"]),
    ("hyper_connection.epsilon", float("inf"), ModelFormatError, ["hyper_connection.epsilon", "inf"]),
    ("attention.head_count_kv", 2, UnsupportedError, ["head_count_kv"]),
    ("attention.compress_ratios", [0, 2, 2, 1, 4, 1], UnsupportedError, ["layer 4", "compress ratio 4"]),
]


@pytest.mark.parametrize(("name", "value", "error", "words"), VALUE_EDITS, ids=[k for k, *_ in VALUE_EDITS])
def test_damaged_values(tiny_path: Path, tmp_path: Path, name: str, value, error: type[Exception],
                        words: list[str]) -> None:
    path = with_key(tiny_path, tmp_path / "x.gguf", key(name), lambda _: value)
    expect(path, error, "x.gguf", *words)


def test_wrong_architecture_spelled_like_ours(tiny_path: Path, tmp_path: Path) -> None:
    # metadata keys stay under deepseek41.*, only general.architecture changes
    path = rewrite_gguf(tiny_path, tmp_path / "x.gguf", arch="deepseek4")
    expect(path, UnsupportedError, "architecture", "'deepseek4'")


# --- and afterwards ---------------------------------------------------------------------------------------


def test_a_good_model_runs_after_failures(synth_model, tiny_path: Path, tmp_path: Path) -> None:
    """Failed loads (and an engine asked to use a closed model) leave nothing behind: a good model
    then loads, and the engine runs it in agreement with the oracle."""
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + bytes(100))
    for path in (tmp_path / "bad.gguf",
                 rewrite_gguf(tiny_path, tmp_path / "x.gguf", drop_tensors=["blk.2.attn_q_b.weight"])):
        with pytest.raises(ModelFormatError):
            flashv41.load_model(path)
    closed = flashv41.load_model(tiny_path)
    closed.close()
    with pytest.raises(SequenceStateError, match="closed"):
        flashv41.Engine(closed, max_seq=16, max_tokens=4)

    model = flashv41.load_model(synth_model("tiny", **TWO_LAYER_TINY))
    with flashv41.Engine(model, max_seq=16, max_tokens=4) as engine:
        seq = engine.new_sequence()
        _, call = compare_call(seq, Oracle(model, max_seq=16).new_sequence(), np.array([5, 127, 9]))
        assert call.ok, call.describe()
    model.close()

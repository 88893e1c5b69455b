"""Text where the file has a tokenizer: the tokenizer.ggml.* keys of synthetic models (none in the
tiny preset's 128 tokens), flashv41.Text against a BPE that the tokenizers package trains and
encodes itself, the DeepSeek-V3 pre-tokenizer's splits, the refusals, and `run --prompt`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType, Keys, TokenType

from flashv41 import load_model
from flashv41.cli import main
from flashv41.host import synth
from flashv41.host.errors import InputError, ModelFormatError, UnsupportedError
from flashv41.host.synth import write_synthetic
from flashv41.host.vocab import BOS_TEXT, EOS_TEXT, byte_tokens, has_vocab, synthetic_vocab
from flashv41.runner import run_model
from flashv41.text import Text
from tests.gguf_edit import rewrite_gguf

tokenizers = pytest.importorskip("tokenizers")

VOCAB = 400  # the tiny preset with a vocabulary large enough for a byte-level BPE (>= 258)
TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "Hello, World! It's 2026: 1234567 digits; 3.14159...",
    "  leading spaces, trailing  \n\n tabs\tand\r\nnewlines ",
    "naïve café — Zürich, Ελληνικά, русский",
    "世界こんにちは 你好 안녕하세요 🙂👍🏽",
    "symbols: <>&|~^`{}[]()#%$@*+=_-\\/\"'",
    "",
]


@pytest.fixture(scope="module")
def text_path(synth_model) -> Path:
    """A tiny model with its MoE and head, and a 400-token vocabulary: so a tokenizer."""
    return synth_model("tiny", vocab=VOCAB, moe=True)


def test_synthetic_vocabulary() -> None:
    """256 bytes, letter merges, then bos and eos; none below 258 tokens."""
    assert synthetic_vocab(128) is None and synthetic_vocab(257) is None
    v = synthetic_vocab(VOCAB)
    assert v is not None
    assert len(v.tokens) == len(set(v.tokens)) == VOCAB and v.tokens[:256] == byte_tokens()
    assert len(v.merges) == VOCAB - 258 and v.merges[0] == "Ġ e"
    assert (v.bos_id, v.eos_id) == (VOCAB - 2, VOCAB - 1) and v.tokens[-2:] == [BOS_TEXT, EOS_TEXT]
    assert list(np.flatnonzero(v.token_types == TokenType.CONTROL)) == [VOCAB - 2, VOCAB - 1]
    assert byte_tokens()[ord(" ")] == "Ġ" and byte_tokens()[ord("\n")] == "Ċ" and byte_tokens()[ord("a")] == "a"


def test_tiny_carries_no_tokenizer(tiny_path: Path) -> None:
    with load_model(tiny_path) as model:
        assert not has_vocab(model.weights.readers[0])
        with pytest.raises(UnsupportedError, match=r"tiny\S*: the file has no tokenizer \(tokenizer\.ggml\.\*\)"):
            Text.from_model(model)


def test_synthetic_round_trip(text_path: Path) -> None:
    """Every text comes back from its ids; bos first, as the file says; merged tokens used."""
    with load_model(text_path) as model:
        text = Text.from_model(model)
    assert (text.bos_id, text.eos_id, text.add_bos) == (VOCAB - 2, VOCAB - 1, True)
    for s in TEXTS:
        ids = text.encode(s)
        assert ids.dtype == np.int64 and ids[0] == text.bos_id and ids.max() < VOCAB
        assert text.decode(ids[1:]) == s
    assert text.encode("the").size < 1 + 3  # "t" "h" "e" merged
    assert list(text.encode(f"a{EOS_TEXT}b")) == [VOCAB - 2, ord("a"), VOCAB - 1, ord("b")]


def test_deepseek_v3_splits(text_path: Path) -> None:
    """Numbers in runs of at most three digits, CJK and kana runs apart, words with their space."""
    with load_model(text_path) as model:
        text = Text.from_model(model)
    pieces = [p for p, _ in text._tokenizer.pre_tokenizer.pre_tokenize_str("Hello world 12345 世界こんにちは!! end")]
    b = byte_tokens()
    cjk = "".join(b[x] for x in "世界こんにちは".encode())
    assert pieces == ["Hello", "Ġworld", "Ġ", "123", "45", "Ġ", cjk, "!!", "Ġend"]


def train_reference(size: int) -> tokenizers.Tokenizer:
    """The tokenizers package's own byte-level BPE (GPT-2 pre-tokenizer), trained on TEXTS with two
    markers first."""
    t = tokenizers
    tok = t.Tokenizer(t.models.BPE())
    tok.pre_tokenizer = t.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = t.decoders.ByteLevel()
    trainer = t.trainers.BpeTrainer(vocab_size=size, initial_alphabet=t.pre_tokenizers.ByteLevel.alphabet(),
                                    special_tokens=[BOS_TEXT, EOS_TEXT], show_progress=False)
    tok.train_from_iterator(TEXTS * 3, trainer)
    return tok


def test_equals_the_tokenizers_package(text_path: Path, tmp_path: Path) -> None:
    """A BPE trained by the tokenizers package, written into a file as llama.cpp's converter writes
    one ("gpt-2" pre-tokenizer, no bos added), encodes and decodes every text as the package does."""
    reference = train_reference(VOCAB)
    model_json = json.loads(reference.to_str())["model"]
    by_id = sorted(model_json["vocab"].items(), key=lambda kv: kv[1])
    tokens = [token for token, _ in by_id]
    assert [i for _, i in by_id] == list(range(len(tokens))) and len(tokens) <= VOCAB
    merges = [m if isinstance(m, str) else " ".join(m) for m in model_json["merges"]]
    types = [TokenType.CONTROL if tok in (BOS_TEXT, EOS_TEXT) else TokenType.NORMAL for tok in tokens]
    path = rewrite_gguf(text_path, tmp_path / "trained.gguf", set_keys={
        Keys.Tokenizer.PRE: ("gpt-2", GGUFValueType.STRING, None),
        Keys.Tokenizer.LIST: (tokens, GGUFValueType.ARRAY, GGUFValueType.STRING),
        Keys.Tokenizer.MERGES: (merges, GGUFValueType.ARRAY, GGUFValueType.STRING),
        Keys.Tokenizer.TOKEN_TYPE: ([int(x) for x in types], GGUFValueType.ARRAY, GGUFValueType.INT32),
        Keys.Tokenizer.BOS_ID: (0, GGUFValueType.UINT32, None),
        Keys.Tokenizer.EOS_ID: (1, GGUFValueType.UINT32, None),
        Keys.Tokenizer.ADD_BOS: (False, GGUFValueType.BOOL, None),
    })
    with load_model(path) as model:
        text = Text.from_model(model)
    for s in [*TEXTS, "unseen words: zebra quokka 98765", f"{EOS_TEXT}end"]:
        want = reference.encode(s).ids
        assert list(text.encode(s)) == want, s
        assert text.decode(want) == reference.decode(want, skip_special_tokens=False), s
    assert text.decode(np.array([], np.int64)) == ""


@pytest.mark.parametrize(("keys", "error", "words"), [
    ({Keys.Tokenizer.PRE: ("llama-bpe", GGUFValueType.STRING, None)}, UnsupportedError,
     "tokenizer.ggml.pre is 'llama-bpe', a pre-tokenizer flashv41 does not know (known: deepseek-v3, gpt-2)"),
    ({Keys.Tokenizer.MODEL: ("llama", GGUFValueType.STRING, None)}, UnsupportedError,
     "tokenizer.ggml.model is 'llama'; flashv41 reads only byte-level BPE tokenizers ('gpt2')"),
    ({Keys.Tokenizer.MERGES: (["Ġe"], GGUFValueType.ARRAY, GGUFValueType.STRING)}, ModelFormatError,
     "tokenizer.ggml.merges[0] is 'Ġe', not two tokens with a space between"),
    ({Keys.Tokenizer.EOS_ID: (VOCAB, GGUFValueType.UINT32, None)}, ModelFormatError,
     f"tokenizer.ggml.eos_token_id is {VOCAB}, past the {VOCAB} tokens"),
    ({Keys.Tokenizer.TOKEN_TYPE: ([1, 1], GGUFValueType.ARRAY, GGUFValueType.INT32)}, ModelFormatError,
     f"tokenizer.ggml.token_type has 2 entries, tokenizer.ggml.tokens {VOCAB}"),
])
def test_refusals(text_path: Path, tmp_path: Path, keys: dict, error: type[Exception], words: str) -> None:
    path = rewrite_gguf(text_path, tmp_path / "bad.gguf", set_keys=keys)
    with load_model(path) as model, pytest.raises(error) as caught:
        Text.from_model(model)
    assert str(caught.value) == f"bad.gguf: {words}"


def test_without_the_tokenizers_package(text_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # what an import finds of a package not installed
    with load_model(text_path) as model, pytest.raises(UnsupportedError, match=r"pip install tokenizers"):
        Text.from_model(model)


def test_bad_input(text_path: Path) -> None:
    with load_model(text_path) as model:
        text = Text.from_model(model)
    with pytest.raises(InputError, match=f"token id {VOCAB} at position 1 is outside the tokenizer's {VOCAB}"):
        text.decode([3, VOCAB])
    with pytest.raises(InputError, match="1-D sequence of token ids"):
        text.decode(np.zeros((2, 2), np.int64))
    with pytest.raises(InputError, match="encode takes a str, got bytes"):
        text.encode(b"abc")  # type: ignore[arg-type]


def test_run_prompt_and_generated_text(text_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`run --prompt` feeds the text's ids (bos first); `--generate` prints the tokens' text too."""
    with load_model(text_path) as model:
        ids = Text.from_model(model).encode("the fox")
    assert main(["run", "--oracle", str(text_path), "--prompt", "the fox", "--generate", "2",
                 "--ffn", "host-moe"]) == 0
    out = capsys.readouterr().out
    shown = "[" + ", ".join(str(int(i)) for i in ids) + "]"
    assert f"tokens: prompt {ids.size} {shown}" in out
    generated = next(x for x in out.splitlines() if x.startswith("generated: "))
    gen_ids = [int(v) for v in generated.split("[")[1].rstrip("]").split(", ")]
    with load_model(text_path) as model:
        want = Text.from_model(model).decode(gen_ids)
    assert f"generated text: {want!r}" in out.splitlines()


def test_run_prompt_errors(text_path: Path, tiny_path: Path, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--oracle", str(tiny_path), "--prompt", "hello"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"flashv41: error: --prompt: {tiny_path.name}: the file has no tokenizer (tokenizer.ggml.*); "
        "give the prompt's ids with --tokens")
    no_bos = rewrite_gguf(text_path, tmp_path / "no-bos.gguf",
                          set_keys={Keys.Tokenizer.ADD_BOS: (False, GGUFValueType.BOOL, None)})
    assert main(["run", "--oracle", str(no_bos), "--prompt", ""]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "flashv41: error: --prompt is empty: it encodes to no tokens"
    assert main(["run", "--oracle", str(text_path), "--prompt", "a", "--tokens", "1"]) == 2  # mutually exclusive
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(InputError, match=r"either token ids \(--tokens\) or text \(--prompt\), not both"):
        run_model(text_path, True, np.array([1]), 8, 1, 0, prompt_text="a")


@pytest.mark.parametrize("layout", ["llama.cpp", "mxxm-t", "ds4"])
def test_every_layout_carries_it(tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same keys in every layout, and the tensors those of the same file written without them."""
    with_text = write_synthetic(tmp_path / "text.gguf", "tiny", layout=layout, vocab=VOCAB)
    monkeypatch.setattr(synth, "synthetic_vocab", lambda size: None)
    without = write_synthetic(tmp_path / "plain.gguf", "tiny", layout=layout, vocab=VOCAB)
    with load_model(with_text) as model, load_model(without) as plain:
        text = Text.from_model(model)
        assert text.decode(text.encode("a b")[1:]) == "a b" and not has_vocab(plain.weights.readers[0])
        assert model.weights.names() == plain.weights.names()
        stored = {t.name: t for t in model.weights}
        for ref in plain.weights:
            assert np.array_equal(stored[ref.name].raw(), ref.raw()), ref.name

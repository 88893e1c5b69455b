"""Files with the old `deepseek4.engram.*` keys (only the engram geometry): the token map, pad id,
primes, offsets and multipliers are rebuilt from the file's tokenizer and table sizes
(host.engram_rebuild) and equal exactly those a file storing them holds, where that file's tables
were derived the official way; the normaliser agrees with the `tokenizers` library the reference
uses; a file with old keys and no tokenizer is refused, naming what is missing. CPU only."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, Keys, TokenType

import flashv41
from flashv41.cli import main
from flashv41.host import gguf_layout as L
from flashv41.host.config import EngramConfig
from flashv41.host.engram_rebuild import (
    V41_COMPRESSED_VOCAB,
    V41_ENGRAM_PAD_ID,
    V41_NUM_EMBEDDINGS,
    compressed_token_map,
    normalise,
    primes_from_rows,
    rebuild_tables,
    token_text,
)
from flashv41.host.engram_tables import engram_primes
from flashv41.host.errors import InputError, ModelFormatError, UnsupportedError
from flashv41.host.synth import preset
from flashv41.host.vocab import Vocab, byte_tokens, synthetic_vocab
from tests.gguf_edit import expect_load_error, field_value, rewrite_gguf

SMALL = preset("small")  # 512 tokens: it carries a byte-level BPE
TABLES = ("token_map", "primes", "offsets", "multipliers")


def official_token_map(vocab: Vocab) -> tuple[np.ndarray, int]:
    """The reference's build_compressed_token_map, run with the `tokenizers` library on the file's
    tokenizer (flashv41.text builds it): each id's one-token decoding, keyed by the raw token where it
    holds U+FFFD, else by the library normaliser's output (or the text where that is empty)."""
    tk = pytest.importorskip("tokenizers")
    from flashv41.text import build_tokenizer

    backend = build_tokenizer(vocab, "test.gguf")
    sentinel = "\ue000"
    norm = tk.normalizers.Sequence([
        tk.normalizers.NFKC(), tk.normalizers.NFD(), tk.normalizers.StripAccents(), tk.normalizers.Lowercase(),
        tk.normalizers.Replace(tk.Regex(r"[ \t\r\n]+"), " "), tk.normalizers.Replace(tk.Regex(r"^ $"), sentinel),
        tk.normalizers.Strip(), tk.normalizers.Replace(sentinel, " "),
    ])
    keys: dict[str, int] = {}
    out = []
    for i in range(len(vocab.tokens)):
        text = backend.decode([i], skip_special_tokens=False)
        key = backend.id_to_token(i) if "\ufffd" in text else (norm.normalize_str(text) or text)
        out.append(keys.setdefault(key, len(keys)))
    return np.asarray(out, dtype=np.int64), len(keys)


def official_multipliers(layer_ids: tuple[int, ...], max_ngram: int, compressed: int) -> np.ndarray:
    """The reference's compute_hash_multipliers, transcribed apart from host.engram_tables."""
    bound = max(1, (np.iinfo(np.int64).max // compressed) // 2)
    return np.stack([np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram,), dtype=np.int64) * 2 + 1
                     for layer in layer_ids])


def official_primes(n_layers: int, max_ngram: int, heads: int, engram_vocab_size: int) -> np.ndarray:
    """The reference's EngramLayout primes with find_next_prime, by trial division."""
    def prime(n: int) -> bool:
        return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))

    seen: set[int] = set()
    out = np.zeros((n_layers, max_ngram - 1, heads), np.int64)
    for layer in range(n_layers):
        for g in range(max_ngram - 1):
            current = engram_vocab_size - 1
            for h in range(heads):
                current += 1
                while not prime(current) or current in seen:
                    current += 1
                seen.add(current)
                out[layer, g, h] = current
    return out


def with_old_keys(src: Path, dst: Path) -> Path:
    """`src` rewritten as a file converted before 2026-09-11: its four geometry keys under
    deepseek4.engram.*, every deepseek41.engram.* key gone."""
    reader = GGUFReader(src)
    engram = [name for name in reader.fields if name.startswith(L.key("engram."))]
    old = {}
    for name, full in L.OLD_ENGRAM_KEYS.items():
        field = reader.get_field(L.key(L.ENGRAM_KEYS[name]))
        assert field is not None, name
        old[full] = field_value(field)
    return rewrite_gguf(src, dst, drop_keys=engram, set_keys=old)


@pytest.fixture(scope="module")
def stored_path(synth_model) -> Path:
    """The small preset storing the official tables of its tokenizer."""
    return synth_model("small", engram_map="tokenizer")


@pytest.fixture(scope="module")
def old_path(stored_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_old_keys(stored_path, tmp_path_factory.mktemp("old") / "old.gguf")


def _engram(path: Path) -> EngramConfig:
    model = flashv41.load_model(path)
    try:
        assert model.config.engram is not None
        return model.config.engram
    finally:
        model.close()


def test_the_stored_tables_are_the_official_ones(stored_path: Path) -> None:
    vocab = synthetic_vocab(SMALL.vocab)
    assert vocab is not None
    want_map, compressed = official_token_map(vocab)
    e = _engram(stored_path)
    assert not e.rebuilt
    assert np.array_equal(e.token_map, want_map)
    assert int(e.token_map.max()) + 1 == compressed
    assert e.pad_id == want_map[V41_ENGRAM_PAD_ID]
    assert np.array_equal(e.multipliers, official_multipliers(SMALL.engram_layers, SMALL.max_ngram, compressed))
    primes = official_primes(len(SMALL.engram_layers), SMALL.max_ngram, SMALL.engram_heads, SMALL.engram_vocab_size)
    assert np.array_equal(e.primes, primes)
    flat = primes.reshape(len(SMALL.engram_layers), -1)
    running = np.concatenate([np.zeros((flat.shape[0], 1), np.int64), np.cumsum(flat, axis=1)[:, :-1]], axis=1)
    assert np.array_equal(e.offsets.reshape(flat.shape), running)


def test_old_keys_rebuild_the_stored_tables(stored_path: Path, old_path: Path) -> None:
    fields = GGUFReader(old_path).fields
    assert not any(name.startswith(L.key("engram.")) for name in fields)
    assert all(name in fields for name in L.OLD_ENGRAM_KEYS.values())
    stored, rebuilt = _engram(stored_path), _engram(old_path)
    assert rebuilt.rebuilt and not stored.rebuilt
    for name in TABLES:
        a, b = getattr(stored, name), getattr(rebuilt, name)
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        assert np.array_equal(a, b), name
    assert rebuilt.pad_id == stored.pad_id
    for name in ("layer_ids", "n_heads", "head_dim", "max_ngram", "table_rows"):
        assert getattr(rebuilt, name) == getattr(stored, name), name


def test_info_says_the_tables_were_rebuilt(stored_path: Path, old_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    line = "engram tables: rebuilt from the file's tokenizer (old deepseek4.engram.* keys)"
    assert main(["info", str(old_path)]) == 0
    assert line in capsys.readouterr().out
    assert main(["info", str(stored_path)]) == 0
    assert line not in capsys.readouterr().out


def test_old_keys_without_a_tokenizer_are_refused(tiny_path: Path, tmp_path: Path) -> None:
    path = with_old_keys(tiny_path, tmp_path / "x.gguf")  # tiny's 128 tokens carry no tokenizer
    expect_load_error(path, UnsupportedError, "deepseek4.engram.", "before 2026-09-11", "no tokenizer",
                      "tokenizer.ggml", L.OLD_ENGRAM_REPAIR)


def test_old_keys_with_another_tokenizer_kind_are_refused(old_path: Path, tmp_path: Path) -> None:
    path = rewrite_gguf(old_path, tmp_path / "x.gguf",
                        set_keys={Keys.Tokenizer.MODEL: ("llama", GGUFValueType.STRING, None)})
    expect_load_error(path, UnsupportedError, "'llama'", "byte-level BPE", "rebuild the engram tables",
                      L.OLD_ENGRAM_REPAIR)


def test_old_keys_missing_a_geometry_key_are_named(old_path: Path, tmp_path: Path) -> None:
    path = rewrite_gguf(old_path, tmp_path / "x.gguf", drop_keys=[L.OLD_ENGRAM_KEYS["n_heads"]])
    expect_load_error(path, ModelFormatError, L.OLD_ENGRAM_KEYS["n_heads"])


def test_skipping_the_normalisation_changes_the_map(stored_path: Path) -> None:
    """The mutation the comparison above must catch: keys taken as decoded, not normalised, give
    another map (" e" and "E" no longer fold onto "e") and so another compressed vocabulary and other
    multipliers."""
    vocab = synthetic_vocab(SMALL.vocab)
    assert vocab is not None
    stored = _engram(stored_path)
    raw_map, raw_compressed = compressed_token_map(vocab, skip_normalisation=True)
    assert not np.array_equal(raw_map, stored.token_map)
    assert raw_compressed > int(stored.token_map.max()) + 1
    wrong = official_multipliers(SMALL.engram_layers, SMALL.max_ngram, raw_compressed)
    assert not np.array_equal(wrong, stored.multipliers)


# text whose one-token decodings the normaliser must fold as the library does: case, accents, compatibility
# forms, final sigma, dotted capital I, whitespace runs and kinds, a lone space, partial UTF-8
HARD_TEXTS = (
    " The", "the", "THE", "Ġx", " café", "CAFÉ", "cafe\u0301", "ﬁ", "Ｔｈｅ", "ΣΟΦΟΣ", "σοφος", "İstanbul", "\u212a",
    "ß", "STRASSE", "\t\n", "  x  ", " ", "  ", "\n", "\r\n", "\u00a0", "\u3000", "\x0b", "\x1c", "\x1f ", "\u2028",
    "a\u200bb", "①", "㎏", "ǅ", "Å", "\u0345", "e\u20dd", "한국어", "日本語", "😀", "<think>", "</think>", "\ufffd",
)


def _hard_vocab() -> Vocab:
    chars = byte_tokens()
    tokens = list(chars)
    for text in HARD_TEXTS:  # those of one byte are byte tokens already (a token string appears once)
        token = "".join(chars[b] for b in text.encode("utf-8"))
        if token not in tokens:
            tokens.append(token)
    # partial UTF-8 of more than one byte: a character's head, its tail; then markers and a filler
    tokens += ["".join(chars[b] for b in "日".encode()[:2]), "".join(chars[b] for b in "日".encode()[1:])]
    tokens += ["<｜begin▁of▁sentence｜>", "<｜▁pad▁｜>", "[PAD0]"]
    types = np.full(len(tokens), TokenType.NORMAL, np.int32)
    types[-3:-1] = TokenType.CONTROL
    types[-1] = TokenType.UNUSED
    return Vocab(tokens, types, [], "deepseek-v3", None, None, False)


def test_hard_tokens_map_as_the_library_maps_them() -> None:
    vocab = _hard_vocab()
    got, compressed = compressed_token_map(vocab)
    want, want_compressed = official_token_map(replace(vocab, tokens=vocab.tokens[:-1],
                                                       token_types=vocab.token_types[:-1]))
    assert got[-1] == -1  # an UNUSED filler has no entry in the reference's lookup
    bad = np.flatnonzero(got[:-1] != want)
    assert not bad.size, [(vocab.tokens[i], token_text(vocab.tokens[i]), int(got[i]), int(want[i])) for i in bad[:5]]
    assert compressed == want_compressed


def test_normalise_agrees_with_the_library_below_u07fd() -> None:
    """Every code point below U+07FD alone, between letters and after a space (above it, Unicode data
    newer than the library's may differ: host.engram_rebuild's docstring)."""
    tk = pytest.importorskip("tokenizers")
    norm = tk.normalizers.Sequence([
        tk.normalizers.NFKC(), tk.normalizers.NFD(), tk.normalizers.StripAccents(), tk.normalizers.Lowercase(),
        tk.normalizers.Replace(tk.Regex(r"[ \t\r\n]+"), " "), tk.normalizers.Replace(tk.Regex(r"^ $"), "\ue000"),
        tk.normalizers.Strip(), tk.normalizers.Replace("\ue000", " "),
    ])
    texts = [form.format(chr(c)) for c in range(0x7FD) for form in ("{}", "A{}B", " {}", "{} ")]
    texts += list(HARD_TEXTS)
    bad = [(t, normalise(t), norm.normalize_str(t)) for t in texts if normalise(t) != norm.normalize_str(t)]
    assert not bad, bad[:5]


def test_primes_from_the_official_table_sizes() -> None:
    primes = primes_from_rows(V41_NUM_EMBEDDINGS, 4, 8, "f.gguf")
    assert np.array_equal(primes, engram_primes(2, 4, 8, 16_000_000))
    assert tuple(int(p.sum()) for p in primes) == V41_NUM_EMBEDDINGS


@pytest.mark.parametrize("rows", [(661, 864), (660, 865)])
def test_table_sizes_that_are_no_prime_construction_are_named(rows: tuple[int, int]) -> None:
    with pytest.raises(ModelFormatError, match="rows"):
        primes_from_rows(rows, SMALL.max_ngram, SMALL.engram_heads, "f.gguf")


def test_official_tables_need_the_official_vocabulary() -> None:
    vocab = synthetic_vocab(SMALL.vocab)
    assert vocab is not None
    with pytest.raises(UnsupportedError, match=f"{V41_COMPRESSED_VOCAB}"):
        rebuild_tables(vocab, (1, 14), 4, 8, V41_NUM_EMBEDDINGS, "f.gguf")


def test_synth_engram_map_is_checked() -> None:
    with pytest.raises(InputError, match="too few"):
        preset("tiny", engram_map="tokenizer")
    with pytest.raises(InputError, match="engram_map"):
        preset("small", engram_map="stubs")

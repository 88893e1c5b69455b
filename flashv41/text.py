"""Text in and out where the file has a tokenizer: `Text.from_model(model)`, `encode`, `decode`.

The file's byte-level BPE (host.vocab reads its tokenizer.ggml.* keys) is rebuilt as a Hugging
Face `tokenizers` Tokenizer: a BPE model of the file's tokens and merges, the pre-tokenizer its
`tokenizer.ggml.pre` names (the split patterns llama.cpp uses for that name, then the byte-to-character
mapping), the byte-level decoder, and the CONTROL / USER_DEFINED tokens as added tokens, so that
"<｜end▁of▁sentence｜>" in a text is that one token. `tokenizers` is an optional dependency (the
`text` extra): without it, building a Text is an UnsupportedError saying how to install it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import TokenType

from flashv41.host.errors import InputError, UnsupportedError
from flashv41.host.model import Model
from flashv41.host.vocab import Vocab, read_vocab, split_merge

# per tokenizer.ggml.pre name, the patterns the text is split by before the bytes are mapped,
# each split keeping its matches and the text between them as pieces of their own; None: GPT-2's
# own pattern, which the byte-level pre-tokenizer applies itself. The DeepSeek-V3 patterns are
# those of llama.cpp's llama-vocab.cpp (and of DeepSeek-V3's tokenizer.json): numbers in runs of
# at most three digits, runs of CJK ideographs and kana, then words, punctuation and spaces.
PRE_TOKENIZERS: dict[str, tuple[str, ...] | None] = {
    "deepseek-v3": (
        r"\p{N}{1,3}",
        r"[一-龥぀-ゟ゠-ヿ]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "gpt-2": None,
}
INSTALL = "pip install tokenizers (or flashv41's extra: pip install 'flashv41[text]')"
ADDED_TYPES = (TokenType.CONTROL, TokenType.USER_DEFINED)


def _tokenizers() -> Any:
    """The `tokenizers` package, or an UnsupportedError saying how to install it."""
    try:
        import tokenizers
    except ImportError:
        raise UnsupportedError(f"text needs the tokenizers package: {INSTALL}") from None
    return tokenizers


def build_tokenizer(vocab: Vocab, fname: str) -> Any:
    """A `tokenizers.Tokenizer` of a file's vocabulary. UnsupportedError for a pre-tokenizer name
    not in PRE_TOKENIZERS (its split patterns would be a guess)."""
    if vocab.pre not in PRE_TOKENIZERS:
        raise UnsupportedError(f"{fname}: tokenizer.ggml.pre is {vocab.pre!r}, a pre-tokenizer flashv41 does not "
                               f"know (known: {', '.join(PRE_TOKENIZERS)})")
    tk = _tokenizers()
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    tokenizer = tk.Tokenizer(tk.models.BPE(ids, [split_merge(m) for m in vocab.merges]))
    patterns = PRE_TOKENIZERS[vocab.pre]
    if patterns is None:
        tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        splits = [tk.pre_tokenizers.Split(tk.Regex(p), behavior="isolated") for p in patterns]
        tokenizer.pre_tokenizer = tk.pre_tokenizers.Sequence(
            [*splits, tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = tk.decoders.ByteLevel()
    added = [tk.AddedToken(vocab.tokens[i], special=vocab.token_types[i] == TokenType.CONTROL, normalized=False)
             for i in np.flatnonzero(np.isin(vocab.token_types, ADDED_TYPES))]
    tokenizer.add_special_tokens(added)
    return tokenizer


class Text:
    """A model file's tokenizer: text to token ids and back.

    bos_id / eos_id: the file's markers (None where it names none); add_bos: whether `encode` starts
    the ids with bos, as the file says its model's input does (tokenizer.ggml.add_bos_token).
    """

    def __init__(self, vocab: Vocab, vocab_size: int, fname: str) -> None:
        if len(vocab.tokens) > vocab_size:
            raise UnsupportedError(f"{fname}: the tokenizer has {len(vocab.tokens)} tokens, the model's vocabulary "
                                   f"{vocab_size}: ids past it have no embedding")
        self._tokenizer = build_tokenizer(vocab, fname)
        self.bos_id = vocab.bos_id
        self.eos_id = vocab.eos_id
        self.add_bos = vocab.add_bos and vocab.bos_id is not None

    @classmethod
    def from_model(cls, model: Model) -> Text:
        """The tokenizer of a loaded model's file (a split set's first shard holds it). UnsupportedError
        for a file without one ("the file has no tokenizer"), another kind than a byte-level BPE, an
        unknown pre-tokenizer, or without the tokenizers package."""
        fname = model.weights.path.name
        return cls(read_vocab(model.weights.readers[0], fname), model.config.vocab_size, fname)

    def encode(self, text: str) -> np.ndarray:
        """The token ids of `text` (int64 [T]), with bos first when the file says so; the CONTROL and
        USER_DEFINED tokens' own strings in the text become those tokens."""
        if not isinstance(text, str):
            raise InputError(f"encode takes a str, got {type(text).__name__}")
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos:
            ids = [self.bos_id, *ids]
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids: Any) -> str:
        """The text of token ids (any integer sequence), markers included as their strings; bytes that
        do not end a whole UTF-8 character show as U+FFFD."""
        values = np.asarray(ids)
        if values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
            raise InputError(f"decode takes a 1-D sequence of token ids, got shape {values.shape} {values.dtype}")
        size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        bad = np.flatnonzero((values < 0) | (values >= size))
        if bad.size:
            raise InputError(f"token id {int(values[bad[0]])} at position {int(bad[0])} is outside the tokenizer's "
                             f"{size} tokens")
        return str(self._tokenizer.decode([int(v) for v in values], skip_special_tokens=False))

"""The exceptions flashv41 raises: one base class, a few kinds a caller may want to tell apart.

Every message names what is wrong (the key, the tensor, the token, the position, the type), what
was expected and what was found, so a user can act on it without reading our code.
"""

from __future__ import annotations


class FlashError(Exception):
    """Base class of every error flashv41 raises on purpose."""


class ModelFormatError(FlashError):
    """A GGUF file that is not a model we can run: missing or misshapen keys and tensors, bad tables."""


class UnsupportedError(FlashError):
    """Something well formed that flashv41 does not support (yet): a layout, a quant type, a size."""


class InputError(FlashError, ValueError):
    """Bad input through the Python API: token ids, masks, shapes, dtypes."""


class CapacityError(FlashError):
    """A request past what was allocated: positions past max_seq, more tokens than max_tokens."""


class SequenceFileError(FlashError):
    """A saved sequence that cannot be loaded: not a flashv41 sequence file, damaged or cut short,
    another format version, or saved from another model."""


class SequenceStateError(FlashError):
    """A call on something that can no longer take it: a released sequence, a closed engine, a
    closed model."""


class CallbackError(FlashError):
    """A caller's callback (an Engine's FFN) raised inside a call: the message names it, the layer and
    the token count, its exception is the cause. The call's sequence is marked failed (its state may be
    half written); the engine and its other sequences stay usable."""


def plural(count: int, noun: str) -> str:
    """`count` and `noun` as a message says them: 1 token, 2 tokens, 0 decode steps (the plural is
    the noun with an s)."""
    return f"{count} {noun}{'' if count == 1 else 's'}"

"""Validating the token ids (and the optional token mask) a caller hands in: one check for the
oracle, the engine and the engram hasher, so they refuse the same input with the same words.

The words are the caller's: what was handed in (no token ids, a float, a string, an id past the
vocabulary), never the NumPy dtype that a conversion happened to produce.

What the check returns, `Tokens`, is the one form the ids take from there on: int64 [T] on the
host, which the engine uploads once (the embedding kernel reads that device copy) and the engram
hasher reads as it is. A hasher given `Tokens` does not check them again.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np

from flashv41.host.errors import InputError


class Tokens(NamedTuple):
    """Token ids that passed `check_tokens` (a tuple, so `ids, mask = check_tokens(...)` unpacks)."""

    ids: np.ndarray  # int64 [T], each in [0, vocab); a copy of the caller's, never a view of it
    mask: np.ndarray | None  # bool [T], False: the token takes no part in any n-gram; None: every token does

    def part(self, start: int, stop: int) -> Tokens:
        """Tokens start .. stop - 1 (a prefill chunk, a batch's one sequence), still checked."""
        return Tokens(self.ids[start:stop], None if self.mask is None else self.mask[start:stop])


def _what(value: object) -> str:
    """A value as a message names it: `'abc' (a string)`, `1.5 (a float)`, `None`."""
    if value is None:
        return "None"
    if isinstance(value, (str, bytes)):
        return f"{value!r} (a string)"
    if isinstance(value, (bool, np.bool_)):
        return f"{value!r} (a bool)"
    if isinstance(value, numbers.Real):
        return f"{value!r} (a float)" if not isinstance(value, numbers.Integral) else repr(value)
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape}"
    return f"a {type(value).__name__}"


def _refuse_ids(token_ids: object, ids: np.ndarray, vocab: int, allow_empty: bool) -> InputError:
    """Why `ids` (np.asarray of what the caller gave) is not a usable list of token ids."""
    if ids.ndim == 0:
        value = ids.item() if ids.dtype != object else token_ids
        if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
            return InputError(f"token ids must be a sequence of integers, got the single integer {value} "
                              f"(write [{value}] for one token)")
        return InputError(f"token ids must be a sequence of integers, got {_what(value)}")
    if ids.ndim > 1:
        return InputError(f"token ids must be one flat sequence of integers, got a {ids.ndim}-D array of shape "
                          f"{ids.shape}")
    if ids.size == 0:
        return InputError("no token ids: a call takes at least one token")
    # the caller's own items where it gave a list (NumPy turns [1, 2.5] into 1.0 and 2.5)
    items = list(token_ids) if isinstance(token_ids, (list, tuple)) else ids.tolist()
    for i, value in enumerate(items):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            return InputError(f"token ids must be integers: the one at index {i} is {_what(value)}")
        if not 0 <= int(value) < vocab:
            return InputError(f"token id {value} at index {i} is outside the vocabulary [0, {vocab})")
    return InputError(f"token ids must be integers, got values of type {ids.dtype}")  # not reached in practice


def check_tokens(token_ids, token_mask, vocab: int, allow_empty: bool = False) -> Tokens:
    """(ids int64 [T], mask bool [T] or None) as `Tokens`, or InputError naming what is wrong in the caller's
    terms: no ids, ids that are not integers (the first, by index), the first id outside the
    vocabulary and its index, a mask of the wrong kind or length."""
    try:
        ids = np.asarray(token_ids)
    except (ValueError, TypeError):  # a ragged list of lists
        raise InputError("token ids must be one flat sequence of integers, got a nested or ragged "
                         f"{type(token_ids).__name__}") from None
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or (ids.size == 0 and not allow_empty):
        if ids.ndim == 1 and ids.size == 0 and allow_empty:
            return Tokens(ids.astype(np.int64), _check_mask(token_mask, (0,)))
        raise _refuse_ids(token_ids, ids, vocab, allow_empty)
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        i = int(bad[0])
        raise InputError(f"token id {int(ids[i])} at index {i} is outside the vocabulary [0, {vocab})")
    return Tokens(ids.astype(np.int64), _check_mask(token_mask, ids.shape))


def _check_mask(token_mask, shape: tuple[int, ...]) -> np.ndarray | None:
    if token_mask is None:
        return None
    mask = np.asarray(token_mask)
    if mask.dtype != np.bool_ or mask.shape != shape:
        what = "bools" if mask.dtype == np.bool_ else f"values of type {mask.dtype}"
        raise InputError(f"token_mask must be one bool a token ({shape[0]} here), got {mask.size} {what}"
                         + (f" of shape {mask.shape}" if mask.ndim != 1 else ""))
    return mask


def one_token(token_id) -> np.ndarray:
    """A decode step's token id as the ids of a one-token call (check_tokens then checks it against
    the vocabulary, whatever its size); InputError for anything but one integer."""
    if not isinstance(token_id, (int, np.integer)) or isinstance(token_id, (bool, np.bool_)):
        raise InputError(f"decode takes one integer token id, got {_what(token_id)}")
    return np.array([token_id]) if abs(int(token_id)) < 2**63 else np.array([token_id], object)


PREFILL_OUTPUTS = ("all", "last")  # what a prefill returns: every token's highway, or the last one's


def check_output(output) -> str:
    """A prefill's `output` argument: "all" (h [T, hc, dim], every token's final highway) or "last"
    (h [1, hc, dim], the last token's: what a server needs before its logits, without bringing
    T x hc x dim floats to the host); InputError for anything else."""
    if not isinstance(output, str) or output not in PREFILL_OUTPUTS:
        raise InputError(f"prefill's output must be one of {', '.join(map(repr, PREFILL_OUTPUTS))}, got {output!r}")
    return output

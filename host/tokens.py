"""Validating the token ids (and the optional token mask) a caller hands in: one check for the
oracle, the engine and the engram hasher, so they refuse the same input with the same words.

What the check returns, `Tokens`, is the one form the ids take from there on: int64 [T] on the
host, which the engine uploads once (the embedding kernel reads that device copy) and the engram
hasher reads as it is. A hasher given `Tokens` does not check them again.
"""

from __future__ import annotations

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


def check_tokens(token_ids, token_mask, vocab: int, allow_empty: bool = False) -> Tokens:
    """(ids int64 [T], mask bool [T] or None) as `Tokens`, or InputError naming the first bad id
    and its index, or what is wrong with the mask's dtype or shape."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or (ids.size == 0 and not allow_empty):
        kind = "1-D integer array" if allow_empty else "non-empty 1-D integer array"
        raise InputError(f"token ids must be a {kind}, got shape {ids.shape} dtype {ids.dtype}")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        i = int(bad[0])
        raise InputError(f"token id {int(ids[i])} at index {i} is outside the vocabulary [0, {vocab})")
    mask = None
    if token_mask is not None:
        mask = np.asarray(token_mask)
        if mask.dtype != np.bool_ or mask.shape != ids.shape:
            raise InputError(f"token_mask must be a bool array of shape {ids.shape}, got {mask.dtype} {mask.shape}")
    return Tokens(ids.astype(np.int64), mask)

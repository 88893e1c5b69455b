"""Named parts of a stage's launches, for whoever times them from outside (the benchmarks).

A stage that derives from `Traced` calls `self._mark(part)` right after the launches of each part
of its work are queued. While `trace` is None (always, outside a profiler) a mark does nothing and
costs one attribute test; a profiler sets `trace` to a function that records a CUDA event on the
stage's stream, so the time between two marks is the device time of the part the second one
names. Marks never synchronise, so they leave the launches' order and overlap as they were. A
helper function that launches more than one part (kv_sources.publish, indexer.index_queries)
takes the stage's `_mark` as its `mark` argument and marks its own first parts.

The part names are the stage's own words (a product's matrix, "sparse_attention", ...); the
benchmarks map each to what it is (flashv41.bench.prefill_stack.CATEGORIES), and their tests
fail on a name that mapping does not know.
"""

from __future__ import annotations

from collections.abc import Callable

Mark = Callable[[str], None]  # what a stage's helper functions call after each part's launches


def unmarked(part: str) -> None:
    """The mark of a caller that times nothing."""


class Traced:
    """A stage whose work a profiler can split into named parts (see the module docstring)."""

    # called with a part's name after that part's launches are queued; None: nobody is timing
    trace: Mark | None = None

    def _mark(self, part: str) -> None:
        if self.trace is not None:
            self.trace(part)

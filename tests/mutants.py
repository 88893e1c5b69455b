"""Broken variants of the project's kernels, built on demand for the mutation tests.

A mutant is a stage module with a few of its globals swapped for deliberately wrong ones (a
device helper that truncates instead of rounding, a dot product that drops a term, a scale off by
1%): `with mutant(stages.linear, f32_to_bf16=truncating): ...` runs the block with every kernel of
`stages.linear` compiled afresh against the swapped names. The project's own checks must then
reject what the kernels compute; if one lets a mutant through, the check is what gets fixed.

How the kernels come to see the swap:
- on the CUDA simulator a kernel is Python that looks its globals up as it runs, so swapping
  the module's attributes is enough;
- on a GPU Numba resolves a kernel's globals when it compiles it, and keeps what it compiled. So
  inside the block every dispatcher the module defines (kernels and device functions) is
  replaced by a fresh, uncompiled one of the same Python function and options, and every kernel
  factory (`functools.cache`) by a fresh cache of the same function. Kernels built inside the
  block compile with the mutant; on leaving it the original dispatchers and factory caches come
  back untouched, so the correct kernels compiled before (and after) are never the mutant's.

Replacements are written with `stages.device.device` (a device function on a GPU, plain Python
on the simulator), like the helpers they stand in for.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from stages.device import SIM


def _fresh(value: Any) -> Any | None:
    """A new, empty copy of a kernel factory's cache or of a CUDA dispatcher; None for anything else."""
    if callable(value) and hasattr(value, "cache_clear") and hasattr(value, "__wrapped__"):
        return functools.cache(value.__wrapped__)
    if not SIM:
        from numba.cuda.dispatcher import CUDADispatcher

        if isinstance(value, CUDADispatcher):
            return CUDADispatcher(value.py_func, targetoptions=dict(value.targetoptions))
    return None


@contextmanager
def mutant(module: ModuleType, **replacements: Any) -> Iterator[None]:
    """Within the block, `module`'s globals named in `replacements` are swapped for the given values
    and every kernel the module builds is compiled against them (see the module docstring)."""
    missing = [name for name in replacements if not hasattr(module, name)]
    if missing:
        raise AttributeError(f"{module.__name__} has no {', '.join(missing)} to mutate")
    saved = dict(vars(module))
    swapped = {name: fresh for name, value in saved.items()
               if name not in replacements and (fresh := _fresh(value)) is not None}
    swapped.update(replacements)
    try:
        for name, value in swapped.items():
            setattr(module, name, value)
        yield
    finally:
        for name in swapped:
            setattr(module, name, saved[name])

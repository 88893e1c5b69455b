"""Broken variants of the project's kernels, built on demand for the mutation tests.

A mutant is a stage module with a few of its globals swapped for deliberately wrong ones (a
device helper that truncates instead of rounding, a dot product that drops a term, a scale off by
1%): `with mutant(stages.linear, f32_to_bf16=truncating): ...` runs the block with every kernel of
`stages.linear` compiled afresh against the swapped names. A replacement is either written by hand
with `stages.device.device` (a device function on a GPU, plain Python on the simulator), like the
helper it stands in for, or is the module's own function with one piece of its source edited
(`edited(module, name, old, new)`: a position off by one, a term left out). The project's own
checks must then reject what the kernels compute; if one lets a mutant through, the check is what
gets fixed.

How the kernels come to see the swap:
- on the CUDA simulator a kernel is Python that looks its globals up as it runs, so swapping
  the module's attributes is enough;
- on a GPU Numba resolves a kernel's globals when it compiles it, and keeps what it compiled. So
  inside the block every dispatcher the module defines (kernels and device functions) is
  replaced by a fresh, uncompiled one of the same Python function and options, and every kernel
  factory (`functools.cache`) by a fresh cache of the same function. Kernels built inside the
  block compile with the mutant; on leaving it the original dispatchers and factory caches come
  back untouched, so the correct kernels compiled before (and after) are never the mutant's.
  Kernels built inside the block are never saved to nor loaded from the kernels' disk cache.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import textwrap
import types
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from flashv41.stages import device as device_module
from flashv41.stages.device import SIM


class MutationError(LookupError):
    """The text a mutant edits is not (or more than once) in the kernel's source: the kernel changed,
    and the mutant must be rewritten for it. Not an AssertionError, so it can never pass as a rejection."""


def _python_function(obj: Any) -> types.FunctionType:
    """The Python function behind a kernel, a device function or a kernel factory."""
    for attr in ("py_func", "fn", "__wrapped__"):
        fn = getattr(obj, attr, None)
        if isinstance(fn, types.FunctionType):
            return fn
    if not isinstance(obj, types.FunctionType):
        raise MutationError(f"{obj!r} is not a Python function, kernel or kernel factory")
    return obj


def _decorated_as(original: Any, fn: types.FunctionType) -> Any:
    """`fn` made what `original` is: a fresh functools.cache kernel factory, a fresh CUDA kernel or
    device function with the original's options, or `fn` itself (a plain helper)."""
    if hasattr(original, "cache_clear"):
        return functools.cache(fn)
    if SIM:
        from numba import cuda
        from numba.cuda.simulator.kernel import FakeCUDAKernel

        if isinstance(original, FakeCUDAKernel):
            return cuda.jit(device=original._device)(fn)
        return fn
    from numba.cuda.dispatcher import CUDADispatcher

    if isinstance(original, CUDADispatcher):
        return CUDADispatcher(fn, targetoptions=dict(original.targetoptions))
    return fn


def _fresh(value: Any) -> Any | None:
    """A new, empty copy of a kernel factory's cache or (on a GPU) of a CUDA dispatcher; None for
    anything else, which needs no copy."""
    if callable(value) and hasattr(value, "cache_clear") and hasattr(value, "__wrapped__"):
        return functools.cache(value.__wrapped__)
    if not SIM:
        from numba.cuda.dispatcher import CUDADispatcher

        if isinstance(value, CUDADispatcher):
            return _decorated_as(value, value.py_func)
    return None


def edited(module: types.ModuleType, name: str, old: str, new: str) -> Any:
    """`module.<name>` rebuilt from its own source with the one occurrence of `old` replaced by `new`,
    decorated as the original is and reading the module's globals, so that it sees the other swaps of
    a `mutant(module, ...)` block. Pass it there as the replacement of `name`."""
    original = getattr(module, name)
    fn = _python_function(original)
    source = textwrap.dedent(inspect.getsource(fn))
    if source.count(old) != 1:
        raise MutationError(f"{module.__name__}.{name}: {old!r} occurs {source.count(old)} times in its source")
    lines = source.replace(old, new).splitlines(keepends=True)
    while lines[0].lstrip().startswith("@"):  # the decorators are applied below, as the original's
        lines.pop(0)
    text = "".join(lines)
    filename = f"<mutant of {module.__name__}.{name}: {old!r} -> {new!r}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    scratch: dict[str, Any] = {}
    exec(compile(text, filename, "exec"), dict(vars(module)), scratch)
    built = scratch[name]
    fresh = types.FunctionType(built.__code__, vars(module), name, built.__defaults__, built.__closure__)
    fresh.__kwdefaults__ = built.__kwdefaults__
    return _decorated_as(original, fresh)


@contextmanager
def mutant(module: types.ModuleType, **replacements: Any) -> Iterator[None]:
    """Within the block, `module`'s globals named in `replacements` are swapped for the given values
    and every kernel the module builds is compiled against them (see the module docstring)."""
    missing = [name for name in replacements if not hasattr(module, name)]
    if missing:
        raise AttributeError(f"{module.__name__} has no {', '.join(missing)} to mutate")
    saved = dict(vars(module))
    swapped = {name: fresh for name, value in saved.items()
               if name not in replacements and (fresh := _fresh(value)) is not None}
    swapped.update(replacements)
    # kernels built in the block stay off the disk cache (stages.device.kernel_cache_dir): a
    # factory's kernel keys its entry by its own code and closure, not by the globals swapped here,
    # so a cached mutant would be what a correct build of it loads, and the reverse
    cached, device_module.KERNEL_CACHE = device_module.KERNEL_CACHE, False
    try:
        for name, value in swapped.items():
            setattr(module, name, value)
        yield
    finally:
        for name in swapped:
            setattr(module, name, saved[name])
        device_module.KERNEL_CACHE = cached


@contextmanager
def mutant_across(modules: tuple[types.ModuleType, ...], **replacements: Any) -> Iterator[None]:
    """`mutant` for a stage whose kernels and helpers live in several modules: each replacement is
    swapped in every module of `modules` that holds the name (the one that defines it, those that
    import it), and every module's kernels are built afresh, so that a swap reaches each kernel or
    helper that calls the name, whichever module it is in (as one `mutant` of a one-module stage)."""
    unheld = [name for name in replacements if not any(hasattr(module, name) for module in modules)]
    if unheld:
        raise AttributeError(f"no module of {[m.__name__ for m in modules]} holds {', '.join(unheld)} to mutate")
    with ExitStack() as stack:
        for module in modules:
            stack.enter_context(mutant(module, **{k: v for k, v in replacements.items() if hasattr(module, k)}))
        yield

"""Two shorter paths through Numba's CUDA simulator, installed for the test suite beside
tests/simulator_threads.py's block manager.

A simulated kernel is Python, so what the simulator does around each line counts. Profiling the
threads of an engine test (tests/test_engine.py::test_deterministic, 2026-12-08, a tenth of the
threads under cProfile) put about half of their time in two places that do no work of the kernel:

- **Scalar casts.** A kernel's `uint32(v)` or `float32(v)` calls a Numba type, whose `__call__`
  imports `numba.core.typing.signature` on every call (the import statement runs each time) and
  asks `isinstance(v, Type)` through the ABC machinery, before the cast itself
  (`cast_python_value`, NumPy's scalar constructor). `fast_call` takes a plain Python or NumPy
  number straight to the cast `cast_python_value` makes (for Numba's integers and floats NumPy's
  scalar type of the same name, looked up once a type); anything else goes to the original.
- **Element reads and writes.** An array inside a simulated kernel is a
  `FakeWithinKernelCUDAArray` around a `FakeCUDAArray` around the NumPy array; a read goes through
  both wrappers' `__getitem__` and a private name-mangled helper. `getitem` / `setitem` index the
  NumPy array directly and wrap what is not a scalar exactly as the two wrappers do; a view made
  inside the kernel (`w.view(np.uint32)`) is a bare `FakeCUDAArray`, whose `__getitem__`
  (`inner_getitem`) no longer builds a list to test the element's type.

Together about a fifth off the engine tests' time (test_deterministic 19-23 s -> 14-16 s, this
2-core machine). What the kernels compute is untouched: the same casts and the same array
elements, reached with fewer Python calls. `install()` checks that the simulator's classes are
those these were written for (their attributes, and a kernel's results through both paths) and
otherwise leaves the simulator as it is.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda, float32, uint8, uint32  # (imported by tests/conftest.py after it chose the backend)

_PLAIN = (int, float, bool, np.integer, np.floating, np.bool_)  # what a kernel casts: never a Numba Type
_NDARRAY, _VOID = np.ndarray, np.void


_CASTS: dict = {}  # id of a Numba type -> the callable its cast_python_value amounts to
_KEPT: list = []  # the types _CASTS names


def _cast_of(numba_type: Any) -> Any:
    """What numba_type.cast_python_value(v) calls: NumPy's scalar type of that name for Numba's
    integers and floats (their cast_python_value is `getattr(np, self.name)(value)`), else the
    method itself."""
    from numba.core.types import scalars

    method = type(numba_type).cast_python_value
    if method in (scalars.Integer.cast_python_value, scalars.Float.cast_python_value):
        return getattr(np, numba_type.name)
    return numba_type.cast_python_value


def fast_call(self: Any, *args: Any) -> Any:
    """numba.core.types.Type.__call__ for one plain number: the cast the original makes for it
    (cast_python_value's); everything else (a signature, a Numba type argument) through the
    original."""
    if len(args) == 1 and isinstance(args[0], _PLAIN):
        cast = _CASTS.get(id(self))  # (by id: a Numba type's own __hash__ is Python code)
        if cast is None:
            _KEPT.append(self)  # (so that its id stays its own)
            cast = _CASTS[id(self)] = _cast_of(self)
        return cast(args[0])
    return _ORIGINAL["call"](self, *args)


def getitem(self: Any, idx: Any) -> Any:
    """FakeWithinKernelCUDAArray.__getitem__: the element, or the sub-array wrapped in both
    wrappers (with the outer array's stream), as the two wrappers' own __getitem__ give it."""
    item = self.__dict__["_item"]
    ret = item._ary[idx]
    kind = type(ret)
    if kind is _NDARRAY or kind is _VOID:
        return _WRAPPERS["outer"](_WRAPPERS["inner"](ret, stream=item.stream))
    return ret


def inner_getitem(self: Any, idx: Any) -> Any:
    """FakeCUDAArray.__getitem__ (a view made inside a kernel is one, unwrapped): the element, or
    the sub-array wrapped as the original wraps it."""
    ret = self._ary[idx]
    kind = type(ret)
    if kind is _NDARRAY or kind is _VOID:
        return _WRAPPERS["inner"](ret, stream=self.stream)
    return ret


def setitem(self: Any, idx: Any, val: Any) -> None:
    """FakeWithinKernelCUDAArray.__setitem__: the NumPy array's own assignment."""
    self.__dict__["_item"]._ary[idx] = val


_ORIGINAL: dict[str, Any] = {}
_WRAPPERS: dict[str, Any] = {}  # the simulator's two array wrapper classes, found at install


def _check(out, rows, words) -> None:
    """install's check: casts (wrapping, rounding, a signature), element and row reads and writes."""
    i = cuda.threadIdx.x
    row = rows[i]  # a sub-array
    out[i, 0] = uint32(row[1] + uint32(7))
    out[i, 1] = uint32(float32(words[i]) * float32(0.5))
    out[i, 2] = uint32(uint8(words[i] + 3))
    halves = words.view(np.uint16)  # a view made in the kernel: the inner wrapper alone
    out[i, 3] = uint32(len(row)) + uint32(halves[2 * i]) + uint32(len(rows.view(np.uint16)[i]))


def _results() -> np.ndarray:
    rows = np.arange(12, dtype=np.uint32).reshape(4, 3)
    words = np.array([1, 255, 1000, 7], np.uint32)
    out = np.zeros((4, 4), np.uint32)
    cuda.jit(_check)[1, 4](out, rows, words)
    return out


def _fits(inner: Any, outer: Any) -> bool:
    """Whether the simulator's array wrappers are laid out as getitem / setitem read them."""
    try:
        wrapped = outer(inner(np.zeros(2, np.uint32), stream=0))
        return isinstance(wrapped.__dict__["_item"]._ary, np.ndarray) and wrapped.__dict__["_item"].stream == 0
    except Exception:  # noqa: BLE001 (any failure: other wrappers)
        return False


def install() -> bool:
    """Use the short paths if this Numba's simulator is the one they were written for, and a kernel
    gives the same results through them as through the originals (a type's call with a type
    argument still a signature); whether they are installed."""
    from numba.core.types import abstract
    from numba.cuda.simulator.cudadrv import devicearray

    outer = devicearray.FakeWithinKernelCUDAArray
    if not _fits(devicearray.FakeCUDAArray, outer) or not hasattr(abstract.Type, "cast_python_value"):
        return False
    inner = devicearray.FakeCUDAArray
    _WRAPPERS.update(inner=inner, outer=outer)
    _ORIGINAL.update(call=abstract.Type.__call__, getitem=outer.__getitem__, setitem=outer.__setitem__,
                     inner_getitem=inner.__getitem__)
    try:
        want, signature = _results(), str(uint32(float32, uint32))
        abstract.Type.__call__ = fast_call
        outer.__getitem__, outer.__setitem__ = getitem, setitem
        inner.__getitem__ = inner_getitem
        if np.array_equal(_results(), want) and str(uint32(float32, uint32)) == signature:
            return True
    except Exception:  # noqa: BLE001 (any failure: this simulator is not the one these know)
        pass
    uninstall()
    return False


def uninstall() -> None:
    """The simulator's own paths back."""
    from numba.core.types import abstract
    from numba.cuda.simulator.cudadrv import devicearray

    if _ORIGINAL:
        abstract.Type.__call__ = _ORIGINAL["call"]
        outer = devicearray.FakeWithinKernelCUDAArray
        outer.__getitem__, outer.__setitem__ = _ORIGINAL["getitem"], _ORIGINAL["setitem"]
        devicearray.FakeCUDAArray.__getitem__ = _ORIGINAL["inner_getitem"]

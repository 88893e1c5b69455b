"""The FFN sublayer as a hook: the caller's MoE between the engine's layers.

flashv41 computes every V4.1 layer but its MoE. `Engine(model, ffn=fn)` calls, for every layer of
every call, in place of the zero output the FFN sublayer has without one:

    fn(layer, x, out, stream)

- `layer`: the layer's index (int);
- `x`: the FFN's input [T, dim], ffn_norm(hc_pre(h, pre)) with pre this layer's attention mixes'
  (the reference's Block.forward), bf16 bits (uint16) on the device;
- `out`: where the FFN's output goes, [T, dim] bf16 bits on the device; the engine then adds it into
  the highway (hc_post with the FFN mixes' post and comb). Write every element;
- `stream`: an `FfnStream`, the stream the engine launches on: `.stream` as the engine's stages use
  it (0 for the default stream, a numba stream, or while a decode step is being captured into a CUDA
  graph the graph's builder: numba kernels take any of them as their stream argument) and
  `.handle`, the CUDA stream handle as an int (`cupy.cuda.ExternalStream(handle)`,
  `torch.cuda.ExternalStream(handle)`).

`x` and `out` expose `__cuda_array_interface__` (numba device arrays), so CuPy
(`cupy.asarray(x).view(cupy.uint16)`), PyTorch (`torch.as_tensor(x, device="cuda").view(torch.bfloat16)`)
or JAX code wraps them without a copy. The arrays are the engine's workspaces: valid during the
call only. T is the call's token count (a prefill chunk, 1 for a decode step, B for decode_batch,
whose row b is sequence b's).

**Inside a captured decode step.** A one-token step is recorded once as a CUDA graph and replayed
(flashv41.graphs); the callback is then called once, while the graph is recorded, and what it
launches on `stream` is what every replay runs. So a callback that may be captured must: launch all
its device work on `stream` (nothing on another stream, no synchronisation, no copy to or from the
host, no allocation: cudaMalloc is not capturable), do the same work whatever the step (no Python
decision on data, which a replay does not re-run), and keep every buffer it reads alive as long as
the engine. A caller says so with `capturable(fn)` (sets `fn.capturable = True`). Any other callback
(`host_ffn`'s included) turns graphs off for that engine, which says so once (a UserWarning at
construction, where graphs would otherwise be used): each step then launches eagerly, with the
same results.

A callback that raises fails its call with a `CallbackError` naming it, the layer and the token
count (its own exception as the cause); the sequence of that call is marked failed (its state may
be half written), and the engine and its other sequences stay usable. `ffn=None` keeps the zero
FFN, launch for launch as before.

`host_ffn(f)` makes a callback of a host function `f(layer, x) -> y` on float32 NumPy arrays
[T, dim] (x the bf16 values; y rounded to bf16 on the way back): download, call, upload. For tests
and prototypes (flashv41.HostMoE is one such f), never capturable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from flashv41.host.errors import InputError
from flashv41.host.numerics import from_bits, to_bits

FfnCallback = Callable[[int, Any, Any, "FfnStream"], None]


@dataclass(frozen=True)
class FfnStream:
    """The stream an FFN callback launches on (module docstring): `stream` for numba launches,
    `handle` (int) for CuPy, PyTorch and the CUDA driver."""

    stream: Any
    handle: int


def stream_handle(stream: Any) -> int:
    """The CUDA stream handle of what a stage launches on, as an int: 0 for the default stream (and
    on the simulator), a numba stream's handle, a graph builder's own stream's."""
    if stream is None or isinstance(stream, int):
        return int(stream or 0)
    target = getattr(stream, "stream", stream)  # a cuda.core GraphBuilder holds its stream here
    handle = getattr(target, "handle", None)
    handle = getattr(handle, "value", handle)  # a ctypes pointer
    try:
        return int(handle or 0)
    except TypeError:
        return 0


def capturable(fn: FfnCallback) -> FfnCallback:
    """Mark an FFN callback as safe to record into a CUDA graph (module docstring: it launches only
    on the stream it is given, the same work every step); returns it."""
    fn.capturable = True  # type: ignore[attr-defined]
    return fn


def is_capturable(fn: Any) -> bool:
    return getattr(fn, "capturable", False) is True


def callback_name(fn: Any) -> str:
    """How an error names a callback: its qualified name, or its type's."""
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def host_ffn(f: Callable[[int, np.ndarray], np.ndarray]) -> FfnCallback:
    """An FFN callback of a host function `f(layer, x) -> y` (float32 NumPy [T, dim] both; x holds
    bf16 values, y is rounded to bf16 to nearest even): x downloaded, f called, y uploaded."""

    def callback(layer: int, x: Any, out: Any, stream: FfnStream) -> None:
        xs = from_bits(x.copy_to_host())
        y = np.asarray(f(layer, xs))
        if y.shape != xs.shape or not np.issubdtype(y.dtype, np.floating):
            raise InputError(f"host_ffn: {callback_name(f)} returned {y.dtype} {y.shape} for layer {layer}, "
                             f"expected float {xs.shape}")
        out.copy_to_device(to_bits(y.astype(np.float32)))

    callback.__qualname__ = f"host_ffn({callback_name(f)})"
    return callback

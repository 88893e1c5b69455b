"""CUDA graphs: a decode step's launches captured once and replayed with one launch.

numba-cuda launches kernels into a cuda.core GraphBuilder as into a stream (the builder's stream
is in capture mode), so a stage records into a graph when its `stream` is the builder. Capture
records launches without running them; what a launch reads from host memory (its scalar
arguments, the device pointers) is frozen into the graph, and whatever changes from step to step
must already be in device memory when the graph runs (flashv41.engine uploads it first, in
`Engine._upload`). What the engine records is its device part, `Engine._device`, run once as
written (flashv41.plan.DIRECT) with its stages' streams switched to the builder (`capture_stages`).

Not available on the CUDA simulator, which has no graphs: `graphs_available()` is False there and
the engine launches eagerly, with the same results.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def graphs_available() -> bool:
    """A CUDA driver to capture with (not the simulator, not a GPU-less compile check)."""
    from flashv41.stages.backend import using_simulator

    if using_simulator():
        return False
    from numba import cuda

    return bool(cuda.is_available())


class GraphRunner:
    """Captures graphs on the current device and launches them on a stream of its own
    (`numba_stream`, for numba's events and copies; `stream`, the same stream for cuda.core)."""

    def __init__(self) -> None:
        from cuda.core import Device, Stream
        from numba import cuda

        self.device = Device()
        self.device.set_current()
        self.numba_stream = cuda.stream()
        self.stream = Stream.from_handle(self.numba_stream.handle)  # type: ignore[attr-defined]

    def capture(self, record: Callable[[Any], None]) -> Any:
        """The graph of what `record(builder)` launches into `builder` (nothing runs)."""
        builder = self.device.create_graph_builder()
        builder.begin_building()
        try:
            record(builder)
        except BaseException:
            builder.end_building()
            builder.close()
            raise
        graph = builder.end_building().complete()
        builder.close()
        return graph

    def capture_stages(self, stages: list[Any], record: Callable[[], object]) -> Any:
        """The graph of what `record()` launches through `stages` (objects with a `stream`, and
        optionally a `capturing` flag), each switched to the builder meanwhile."""

        def switched(builder: Any) -> None:
            saved = [s.stream for s in stages]
            for s in stages:
                s.stream = builder
                if hasattr(s, "capturing"):
                    s.capturing = True
            try:
                record()
            finally:
                for s, stream in zip(stages, saved, strict=True):
                    s.stream = stream
                    if hasattr(s, "capturing"):
                        s.capturing = False

        return self.capture(switched)

    def launch(self, graph: Any, wait: bool = True) -> None:
        """Replay `graph`; wait for it unless told not to (the caller reads its results next)."""
        graph.launch(self.stream)
        if wait:
            self.stream.sync()

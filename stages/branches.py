"""Side branches: work that runs beside a stage's own stream while a decode graph is captured.

A captured step is a chain of launches, each waiting for the one before. Some of a layer's work
does not read what the chain writes just before it (a kv source's compressor reads only the layer
input, the indexer's queries only qr, the engram's projection only the gathered rows), and most of
those launches are short and latency-bound, so they leave the GPU's bandwidth and most of its SMs
idle. A `Branch` puts such work on a second stream: `fork` makes that stream wait for what the
stage's stream holds so far and returns it, the work is launched there, and `join` makes the
stage's stream wait for it again. Captured into a CUDA graph (flashv41.graphs), the branch becomes
a parallel path of the graph, which the GPU runs beside the chain.

Only a capture branches. Eagerly (prefill, a profiled or first step, the simulator) `fork` returns
the stage's own stream and `join` does nothing, so the same launches run one after another in the
order they were issued. Either way every launch reads what it would read in that order: the
callers fork only work whose inputs are complete at the fork and whose outputs nothing reads
before the join, and no branch writes a buffer that the chain reads or writes meanwhile.
"""

from __future__ import annotations

from typing import Any


class Branch:
    """One side stream of a stage, forked from and joined back to the stage's stream while a graph
    is captured (the stage's stream is then a cuda.core GraphBuilder)."""

    def __init__(self) -> None:
        self._side: Any = None  # a cuda.core Stream, made at the first capture that forks
        self._open = False

    def fork(self, stream: Any, capturing: bool) -> Any:
        """The stream to launch the side work on: while capturing, the side stream, waiting for
        everything `stream` holds so far; otherwise `stream` itself."""
        if not capturing:
            return stream
        if self._side is None:
            from cuda.core import Device

            self._side = Device().create_stream()
        self._side.wait(_capturing_stream(stream))
        self._open = True
        return self._side

    def join(self, stream: Any) -> None:
        """`stream` waits for the side work (nothing when the branch is not open)."""
        if self._open:
            _capturing_stream(stream).wait(self._side)
            self._open = False

    def wait_for(self, other: Branch) -> None:
        """This open branch also waits for what `other` (an open branch) holds so far."""
        if self._open and other._open:
            self._side.wait(other._side)


def _capturing_stream(stream: Any) -> Any:
    """The cuda.core Stream of a GraphBuilder (one with a stream of its own), else the stream."""
    return getattr(stream, "stream", stream)

"""`flashv41 bench`: the PERF.md measurements, side by side with their bounds, in one process.

A benchmark module (listed in BENCH_MODULES) exposes `cases(options) -> list[BenchCase]`; a case
has a name and a `run(ctx) -> list[BenchRow]`. The framework measures the copy bandwidth first
(the bound of every memory-bound row), runs the selected cases, prints one table and optionally
writes JSON. Adding a family of rows is adding a module to BENCH_MODULES.

Every row carries its median time, what it moved or computed (bytes or FLOPs), its bound and
the ratio time / bound (1.0 = at the bound; PERF.md's targets are ratios). Device times come from
CUDA events, after warm-up, as the median of >= 20 repetitions; a row that measures a host-side
step says so in its note and uses the host clock.

Timing helpers:
- `device_time(fn, ...)`: the GPU time of `fn`'s launches without the Python launch cost. The
  launches are queued behind a kernel that only sleeps, so the GPU reaches them after all of
  them were issued, and events around `n` back-to-back calls time the device alone.
- `pipelined_time(fn, ...)`: events around `n` back-to-back calls, as Python issues them (host
  work and launch cost overlap the GPU; where Python is slower it is what is measured).
- `host_time(fn, ...)`: the wall clock of whole calls, synchronised.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flashv41.errors import InputError, UnsupportedError
from flashv41.runtime import backend_name, select_backend

# the modules whose `cases(options)` make up the benchmark
BENCH_MODULES: tuple[str, ...] = (
    "flashv41.bench_gemv", "flashv41.bench_engram", "flashv41.bench_attention", "flashv41.bench_stack",
    "flashv41.bench_prefill",
)
COPY_BYTES = 512 << 20  # device-to-device copy for the bandwidth: well past the 50 MB L2
MIN_REPS = 20


@dataclass(frozen=True)
class BenchOptions:
    """What to run and how. rows: name patterns (fnmatch, e.g. 'engram.wkv*'), empty = all."""

    reps: int = MIN_REPS
    warmup: int = 3
    rows: tuple[str, ...] = ()
    weight_types: tuple[str, ...] = ("Q8_0", "Q2_K", "BF16")
    workdir: Path = Path(tempfile.gettempdir()) / "flashv41-bench"


@dataclass
class BenchRow:
    """One measured line: median seconds, bytes (or FLOPs) it moved (did), its bound in seconds."""

    name: str
    median_s: float
    bound_s: float
    bytes: int = 0
    flops: int = 0
    note: str = ""

    @property
    def ratio(self) -> float:
        """median / bound: 1.0 is at the bound, PERF.md's targets cap this."""
        return self.median_s / self.bound_s if self.bound_s > 0 else float("nan")

    def to_json(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


@dataclass(frozen=True)
class BenchCase:
    """A named measurement; `run` returns its rows (usually one)."""

    name: str
    run: Callable[[BenchContext], list[BenchRow]]


@dataclass
class BenchContext:
    """What every case gets: the options, the GPU's name and the copy bandwidth (bytes/s, read +
    written, of a device-to-device copy), measured at the start of the run."""

    options: BenchOptions
    gpu: str
    copy_bandwidth: float
    rows: list[BenchRow] = field(default_factory=list)

    def memory_bound(self, nbytes: int) -> float:
        """Seconds to stream `nbytes` once at the copy bandwidth."""
        return nbytes / self.copy_bandwidth


def require_gpu() -> None:
    """UnsupportedError on the CUDA simulator: timings there mean nothing."""
    if select_backend():
        raise UnsupportedError("flashv41 bench needs a CUDA GPU: kernels are running on the CUDA simulator "
                               "(NUMBA_ENABLE_CUDASIM is set, or no CUDA driver was found)")


def _events_time(fn: Callable[[], None], n: int, stream, before: Callable[[], None] | None = None) -> float:
    from numba import cuda

    start, end = cuda.event(), cuda.event()
    if before is not None:
        before()
    start.record(stream)
    for _ in range(n):
        fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def _sleep_kernel():
    from numba import cuda

    @cuda.jit
    def sleep(rounds):
        for _ in range(rounds):
            cuda.nanosleep(1000)

    return sleep


_SLEEP: list = []


def device_time(fn: Callable[[], None], reps: int, warmup: int, stream, n: int = 8,
                hold_s: float = 0.005) -> float:
    """Median GPU seconds per call of `fn` (which only enqueues work on `stream`), launch cost
    excluded: each repetition queues `n` calls behind a kernel that sleeps about `hold_s`."""
    if not _SLEEP:
        _SLEEP.append(_sleep_kernel())
    sleep = _SLEEP[0]
    rounds = max(1, int(hold_s * 1e6))

    def hold() -> None:
        sleep[1, 1, stream](rounds)

    for _ in range(warmup):
        fn()
    return statistics.median(_events_time(fn, n, stream, hold) for _ in range(reps))


def pipelined_time(fn: Callable[[], None], reps: int, warmup: int, stream, n: int = 8) -> float:
    """Median seconds per call of `n` back-to-back calls as Python issues them (events around)."""
    for _ in range(warmup):
        fn()
    return statistics.median(_events_time(fn, n, stream) for _ in range(reps))


def host_time(fn: Callable[[], object], reps: int, warmup: int) -> float:
    """Median wall-clock seconds of whole calls (fn must leave no work pending if that matters)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_copy_bandwidth(reps: int, warmup: int, nbytes: int = COPY_BYTES) -> BenchRow:
    """A device-to-device copy of `nbytes`; the bandwidth counts bytes read plus bytes written."""
    import numpy as np
    from numba import cuda

    stream = cuda.stream()
    src = cuda.device_array(nbytes, np.uint8, stream=stream)
    dst = cuda.device_array(nbytes, np.uint8, stream=stream)

    def copy() -> None:
        dst.copy_to_device(src, stream=stream)

    median = pipelined_time(copy, reps, warmup, stream, n=4)
    return BenchRow("copy", median, median, bytes=2 * nbytes,
                    note=f"device-to-device {nbytes >> 20} MiB: {2 * nbytes / median / 1e12:.2f} TB/s (read + write)")


def all_cases(options: BenchOptions) -> list[BenchCase]:
    cases: list[BenchCase] = []
    for name in BENCH_MODULES:
        cases += importlib.import_module(name).cases(options)
    return cases


def select_cases(cases: Sequence[BenchCase], patterns: Sequence[str]) -> list[BenchCase]:
    """The cases whose names match any pattern (all when none); InputError if a pattern matches none."""
    if not patterns:
        return list(cases)
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(c.name, pattern) for c in cases):
            known = ", ".join(c.name for c in cases)
            raise InputError(f"bench: no row matches {pattern!r} (rows: {known})")
    return [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]


def format_table(gpu: str, copy_bandwidth: float, rows: Sequence[BenchRow]) -> str:
    """The rows as a fixed-width table, with the GPU and the copy bandwidth on top."""
    lines = [f"{gpu}: copy bandwidth {copy_bandwidth / 1e12:.3f} TB/s (read + write)",
             f"{'row':<40} {'median':>11} {'bound':>11} {'ratio':>6} {'GB/s':>8}  note"]
    for r in rows:
        rate = f"{r.bytes / r.median_s / 1e9:8.1f}" if r.bytes and r.median_s > 0 else f"{'-':>8}"
        lines.append(f"{r.name:<40} {r.median_s * 1e6:9.1f}us {r.bound_s * 1e6:9.1f}us {r.ratio:6.2f} {rate}  "
                     f"{r.note}")
    return "\n".join(lines)


def run(options: BenchOptions, json_path: Path | None = None, print_fn: Callable[[str], None] = print) -> BenchContext:
    """Measure the copy bandwidth, run the selected cases, print the table, write JSON if asked."""
    require_gpu()
    if options.reps < MIN_REPS:
        raise InputError(f"bench: --reps must be at least {MIN_REPS}, got {options.reps}")
    cases = select_cases(all_cases(options), options.rows)
    copy = measure_copy_bandwidth(options.reps, options.warmup)
    ctx = BenchContext(options, backend_name(), copy.bytes / copy.median_s, [copy])
    for case in cases:
        rows = case.run(ctx)
        ctx.rows += rows
        for r in rows:
            print_fn(f"  {r.name}: {r.median_s * 1e6:.1f} us (bound {r.bound_s * 1e6:.1f} us, ratio {r.ratio:.2f})")
    print_fn(format_table(ctx.gpu, ctx.copy_bandwidth, ctx.rows))
    if json_path is not None:
        report = {"gpu": ctx.gpu, "copy_bandwidth_bytes_per_s": ctx.copy_bandwidth, "reps": options.reps,
                  "rows": [r.to_json() for r in ctx.rows]}
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    return ctx

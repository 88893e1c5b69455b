"""`flashv41 bench`: the measurements of docs/performance.md, side by side with their bounds, in one
process.

A benchmark module (listed in BENCH_MODULES) exposes `cases(options) -> list[BenchCase]`; a case
has a name and a `run(ctx) -> list[BenchRow]`. The framework measures the copy bandwidth first
(the bound of every memory-bound row), runs the selected cases, prints one table and optionally
writes JSON. Adding a family of rows is adding a module to BENCH_MODULES. A case that takes
minutes (`BenchCase.default` False: the prefill.stack rows) runs only when a --rows pattern
matches it, never in a plain `flashv41 bench`.

Every row carries its median time, what it moved or computed (bytes or FLOPs), its bound and
the ratio time / bound (1.0 = at the bound; the targets in docs/performance.md are ratios). Device
times come from CUDA events, after warm-up, as the median of >= 20 repetitions; a row that
measures a host-side step says so in its note and uses the host clock.

Progress goes to stderr (host.progress): the GPU first, before the copy probes, then a bar over
the rows, which steps aside for each row's line.

The copy bandwidth is measured three ways over buffers far past the L2 (COPY_BYTES each):
cudaMemcpy device-to-device, a read+write copy kernel and a read-only streaming kernel
(stages.bandwidth); the rows `copy.memcpy`, `copy.copy_kernel`, `copy.read_kernel` report each,
and every bound uses the best of the three (`BenchContext.copy_bandwidth`). Read + written bytes
count for the copies, read bytes for the read kernel.

The L2 (its size read from the device, L2_FALLBACK when the driver does not say): a row whose data
fits in it would be timed from cache against a main-memory bound. So every row whose data is
smaller than HBM_FACTOR x L2 does one of two things, and its `l2` (an L2Plan) says which:
- "rotate" (`BenchContext.rotated_time`): the row runs one product on a weight it owns; it makes
  enough copies of the weight (HBM_FACTOR x L2 in all) and consecutive calls read consecutive
  copies, so a copy comes back only after several L2s' worth of other data was read. Copies are
  freed when the row finishes.
- "evict" (`stage_time`, `python_time`, `wall_time`): the row runs a whole stage or step whose
  weights it cannot copy; before each repetition the read-only kernel reads a buffer of
  EVICT_FACTOR x L2 (reading leaves clean lines, so nothing of it is written back later), and
  each repetition is timed alone, with its own pair of events: evict, event, call, event, evict,
  ... The row's time is the median of the repetitions. (A lone call's events also time the
  GPU's gap of about a microsecond between an event and the next kernel, which back-to-back
  timing spreads over n calls: it shows on rows of a few microseconds.)
Rows whose data is >= HBM_FACTOR x L2 ("hbm") are timed back to back as they are: a repetition
cannot find much of its data left in the L2 by the previous one.

Timing helpers:
- `device_time(fn, ...)`: the GPU time of `fn`'s launches without the Python launch cost. The
  launches are queued behind a kernel that only sleeps, so the GPU reaches them after all of
  them were issued, and events around `n` back-to-back calls time the device alone. The sleep
  lasts at least twice what Python took to issue one group in warm-up.
- `evicted_time(fn, ..., evict)`: the same with an eviction before each call and events around
  each call (the eviction untimed); with hold_s = 0, as Python issues them.
- `pipelined_time(fn, ...)`: events around `n` back-to-back calls, as Python issues them (host
  work and launch cost overlap the GPU; where Python is slower it is what is measured).
- `host_time(fn, ...)`: the wall clock of whole calls, synchronised.
"""

from __future__ import annotations

import fnmatch
import gc
import importlib
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from flashv41.host.errors import FlashError, InputError, UnsupportedError
from flashv41.host.progress import Progress
from flashv41.memory import flush_device_frees
from flashv41.stages.backend import backend_name, select_backend

# the modules whose `cases(options)` make up the benchmark
BENCH_MODULES: tuple[str, ...] = (
    "flashv41.bench.gemv", "flashv41.bench.engram", "flashv41.bench.attention", "flashv41.bench.stack",
    "flashv41.bench.prefill", "flashv41.bench.prefill_stack", "flashv41.bench.head", "flashv41.bench.sparse",
)
COPY_BYTES = 512 << 20  # each buffer of the copy probes: ten times the H200's 50 MiB L2
COPY_ROUNDS = 2  # the three probes run this many times interleaved; each reports its best round
COPY_WARM_S = 0.3  # copying this long before the probes: the clocks leave their idle state
MIN_REPS = 20
L2_FALLBACK = 50 << 20  # an H200's L2, when the driver does not report one
HBM_FACTOR = 4  # data >= 4x L2 is read from HBM whatever the previous repetition left
EVICT_FACTOR = 3  # the evictor reads 3x L2: every line the previous repetition left is replaced
PEAK_TFLOPS = 790.0  # H200 dense bf16, as docs/performance.md gives it (the rows' compute bounds)

T = TypeVar("T")


@dataclass(frozen=True)
class BenchOptions:
    """What to run and how. rows: name patterns (fnmatch, e.g. 'engram.wkv*'), empty = all."""

    reps: int = MIN_REPS
    warmup: int = 3
    rows: tuple[str, ...] = ()
    weight_types: tuple[str, ...] = ("Q8_0", "Q2_K", "BF16")
    workdir: Path = Path(tempfile.gettempdir()) / "flashv41-bench"


@dataclass(frozen=True)
class L2Plan:
    """What a row did so that its repetitions read HBM, not the L2. mode: "rotate" (over `copies`
    copies of `data_bytes`), "evict" (L2 evicted between repetitions), "hbm" (data_bytes >=
    HBM_FACTOR x L2, timed as is), "host" (host clock, no device data)."""

    mode: str
    data_bytes: int
    l2_bytes: int
    copies: int = 1

    @property
    def l2_multiple(self) -> float:
        return self.data_bytes / self.l2_bytes

    def describe(self) -> str:
        """The JSON's `l2`: what was done, in words."""
        if self.mode == "rotate":
            total = self.copies * self.data_bytes
            return f"rotated over {self.copies} copies ({total / 1e6:.0f} MB, {total / self.l2_bytes:.1f}x L2)"
        if self.mode == "evict":
            return f"L2 evicted between repetitions (data {self.data_bytes / 1e6:.1f} MB, {self.l2_multiple:.2f}x L2)"
        if self.mode == "hbm":
            return f"data {self.l2_multiple:.1f}x L2: read from HBM"
        return "host clock: no device data"

    def short(self) -> str:
        """The table's reminder."""
        return {"rotate": f"L2: {self.copies} copies", "evict": "L2: evicted",
                "hbm": f"L2: data {self.l2_multiple:.1f}x"}.get(self.mode, "host")


HOST = L2Plan("host", 0, L2_FALLBACK)


def copies_needed(data_bytes: int, l2_bytes: int) -> int:
    """Copies of `data_bytes` that make HBM_FACTOR x L2 together (at least 2, so consecutive calls
    read different copies)."""
    return max(2, math.ceil(HBM_FACTOR * l2_bytes / max(1, data_bytes)))


def plan_l2(data_bytes: int, l2_bytes: int, rotate: bool) -> L2Plan:
    """The L2 policy of a row whose repetitions read `data_bytes`: data >= HBM_FACTOR x L2 is
    timed as is; under that, copies are rotated where the row can make them, else the L2 is
    evicted between repetitions."""
    if data_bytes >= HBM_FACTOR * l2_bytes:
        return L2Plan("hbm", data_bytes, l2_bytes)
    if rotate:
        return L2Plan("rotate", data_bytes, l2_bytes, copies_needed(data_bytes, l2_bytes))
    return L2Plan("evict", data_bytes, l2_bytes)


@dataclass
class BenchRow:
    """One measured line: median seconds, bytes (or FLOPs) it moved (did), its bound in seconds,
    and what was done about the L2 (None: not a timing)."""

    name: str
    median_s: float
    bound_s: float
    bytes: int = 0
    flops: int = 0
    note: str = ""
    l2: L2Plan | None = None
    split: dict[str, float] = field(default_factory=dict)  # seconds by category (prefill.stack); {}: none

    @property
    def ratio(self) -> float:
        """median / bound: 1.0 is at the bound, the targets in docs/performance.md cap this."""
        return self.median_s / self.bound_s if self.bound_s > 0 else float("nan")

    def to_json(self) -> dict:
        """The row as the JSON report holds it; `split` only where the row has one."""
        out = {**asdict(self), "ratio": self.ratio}
        out["l2"] = self.l2.describe() if self.l2 is not None else None
        out["l2_mode"] = self.l2.mode if self.l2 is not None else None
        if not self.split:
            del out["split"]
        return out


@dataclass(frozen=True)
class BenchCase:
    """A named measurement; `run` returns its rows (usually one). default: whether a run without
    --rows patterns includes it (False for cases that take minutes: a pattern must name them)."""

    name: str
    run: Callable[[BenchContext], list[BenchRow]]
    default: bool = True


@dataclass
class BenchContext:
    """What every case gets: the options, the GPU's name, the copy bandwidth (bytes/s, the best of
    `copy_bandwidths`, measured at the start of the run), the L2 size (and where it came from) and
    the evictor (stages.bandwidth.L2Evictor over EVICT_FACTOR x L2) of the L2-honest timings."""

    options: BenchOptions
    gpu: str
    copy_bandwidth: float
    rows: list[BenchRow] = field(default_factory=list)
    copy_bandwidths: dict[str, float] = field(default_factory=dict)  # probe name -> bytes/s
    l2_bytes: int = L2_FALLBACK
    l2_source: str = "assumed"
    evictor: Any = None
    failed: list[tuple[str, str]] = field(default_factory=list)  # (case, its error) of the cases that raised

    def memory_bound(self, nbytes: int) -> float:
        """Seconds to stream `nbytes` once at the copy bandwidth."""
        return nbytes / self.copy_bandwidth

    def plan(self, data_bytes: int, rotate: bool = False) -> L2Plan:
        return plan_l2(data_bytes, self.l2_bytes, rotate)

    def stage_time(self, fn: Callable[[], None], data_bytes: int, stream, n: int = 8,
                   hold_s: float = 0.005) -> tuple[float, L2Plan]:
        """device_time of `fn` (a stage, a step, a graph replay: anything queued on `stream`),
        with the L2 evicted before each call when its data fits (see the module docstring)."""
        plan = self.plan(data_bytes)
        o = self.options
        if plan.mode == "hbm":
            return device_time(fn, o.reps, o.warmup, stream, n, hold_s), plan
        return evicted_time(fn, o.reps, o.warmup, stream, self.evictor.evict, n, hold_s), plan

    def parts_time(self, fn: Callable[[Callable[[str], None]], None], data_bytes: int, stream
                   ) -> tuple[dict[str, float], L2Plan]:
        """part_times of `fn`, the L2 evicted before each call when its data fits."""
        plan = self.plan(data_bytes)
        evict = None if plan.mode == "hbm" else self.evictor.evict
        return part_times(fn, self.options.reps, self.options.warmup, stream, evict), plan

    def python_time(self, fn: Callable[[], None], data_bytes: int, stream, n: int = 8) -> tuple[float, L2Plan]:
        """pipelined_time of `fn` (launch cost included), the L2 evicted before each call when its
        data fits."""
        plan = self.plan(data_bytes)
        o = self.options
        if plan.mode == "hbm":
            return pipelined_time(fn, o.reps, o.warmup, stream, n), plan
        return evicted_time(fn, o.reps, o.warmup, stream, self.evictor.evict, n, hold_s=0.0), plan

    def wall_time(self, fn: Callable[[], object], data_bytes: int) -> tuple[float, L2Plan]:
        """host_time of `fn` (whole synchronised calls), the L2 evicted (and the GPU synchronised)
        before each call when its data fits."""
        plan = self.plan(data_bytes)
        o = self.options
        if plan.mode == "hbm":
            return host_time(fn, o.reps, o.warmup), plan

        def evict() -> None:
            from numba import cuda

            self.evictor.evict(0)
            cuda.synchronize()

        return host_time(fn, o.reps, o.warmup, before=evict), plan

    def rotated_time(self, first: T, copy: Callable[[T], T], call: Callable[[T], None], data_bytes: int, stream,
                     n: int = 8, hold_s: float = 0.005, prepare: Callable[[T], None] | None = None
                     ) -> tuple[float, L2Plan]:
        """device_time of `call(item)`, each call on the next of `plan.copies` items: `first` and
        copies of it made by `copy` (data_bytes each), freed before returning. `prepare(item)` runs
        once on every item before the timing (what a kernel sets up at its first call on a weight,
        such as stages.linear_imma's workspace, stays out of the timed calls)."""
        plan = self.plan(data_bytes, rotate=True)
        items = [first] + [copy(first) for _ in range(plan.copies - 1)]
        if prepare is not None:
            for item in items:
                prepare(item)
        turn = [0]

        def rotating() -> None:
            i = turn[0]
            turn[0] = (i + 1) % len(items)
            call(items[i])

        o = self.options
        try:
            median = device_time(rotating, o.reps, o.warmup, stream, n, hold_s)
        finally:
            items.clear()
            release_device_memory()
        return median, plan


def require_gpu() -> None:
    """UnsupportedError on the CUDA simulator: timings there mean nothing."""
    if select_backend():
        raise UnsupportedError("flashv41 bench needs a CUDA GPU: kernels are running on the CUDA simulator "
                               "(NUMBA_ENABLE_CUDASIM is set, or no CUDA driver was found)")


def release_device_memory() -> None:
    """Free what the finished row dropped now (numba defers frees): no growth across rows."""
    gc.collect()
    flush_device_frees()


def _sleep_kernel():
    from numba import cuda

    @cuda.jit
    def sleep(rounds):
        for _ in range(rounds):
            cuda.nanosleep(1000)

    return sleep


_SLEEP: list = []


def _hold(stream, seconds: float) -> None:
    """Queue a kernel on `stream` that sleeps about `seconds` (nothing for 0)."""
    if seconds <= 0:
        return
    if not _SLEEP:
        _SLEEP.append(_sleep_kernel())
    _SLEEP[0][1, 1, stream](max(1, int(seconds * 1e6)))


def _warm_and_hold(group: Callable[[], None], warmup: int, single: Callable[[], None], hold_s: float) -> float:
    """Run `single` `warmup` times, then time how long Python takes to issue one `group` (the
    faster of two: the first may still compile a kernel); the hold to use: at least twice that,
    so that the GPU reaches the group's first call after its last was issued. 0 stays 0."""
    for _ in range(warmup):
        single()
    issued = math.inf
    for _ in range(2):
        start = time.perf_counter()
        group()
        issued = min(issued, time.perf_counter() - start)
    return max(hold_s, 2 * issued) if hold_s > 0 else 0.0


def _events_time(fn: Callable[[], None], n: int, stream, hold_s: float = 0.0) -> float:
    from numba import cuda

    start, end = cuda.event(), cuda.event()
    _hold(stream, hold_s)
    start.record(stream)
    for _ in range(n):
        fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def device_time(fn: Callable[[], None], reps: int, warmup: int, stream, n: int = 8,
                hold_s: float = 0.005) -> float:
    """Median GPU seconds per call of `fn` (which only enqueues work on `stream`), launch cost
    excluded: each repetition queues `n` calls behind a kernel that sleeps at least `hold_s`
    (and at least twice the time Python took to issue `n` calls in warm-up)."""
    from numba import cuda

    def group() -> None:
        for _ in range(n):
            fn()

    hold_s = _warm_and_hold(group, warmup, fn, hold_s)
    cuda.synchronize()
    return statistics.median(_events_time(fn, n, stream, hold_s) for _ in range(reps))


def evicted_time(fn: Callable[[], None], reps: int, warmup: int, stream, evict: Callable[[Any], None], n: int = 8,
                 hold_s: float = 0.005) -> float:
    """Median GPU seconds of one call of `fn`, the L2 evicted before each: a repetition queues
    (behind a kernel that sleeps at least `hold_s`, as in device_time; none for hold_s = 0)
    `n` times `evict(stream)`, an event, `fn()`, an event; each call's time is its own pair's.
    The median is over reps * n calls."""
    from numba import cuda

    starts = [cuda.event() for _ in range(n)]
    ends = [cuda.event() for _ in range(n)]

    def group() -> None:
        for start, end in zip(starts, ends, strict=True):
            evict(stream)
            start.record(stream)
            fn()
            end.record(stream)

    hold_s = _warm_and_hold(group, warmup, fn, hold_s)
    cuda.synchronize()
    times: list[float] = []
    for _ in range(reps):
        _hold(stream, hold_s)
        group()
        ends[-1].synchronize()
        times += [start.elapsed_time(end) / 1e3 for start, end in zip(starts, ends, strict=True)]
    return statistics.median(times)


def part_times(fn: Callable[[Callable[[str], None]], None], reps: int, warmup: int, stream,
               evict: Callable[[Any], None] | None, n: int = 4, hold_s: float = 0.02) -> dict[str, float]:
    """Median GPU seconds of each named part of one call: `fn(mark)` queues its launches on `stream`
    and calls mark(part) after each part's; an event recorded there times the part against the
    previous mark (the first against the call's start). Each repetition queues, behind a kernel
    that sleeps at least `hold_s`, `n` times evict(stream) (when given) and one call, so a part
    is timed from HBM and without launch gaps. Parts keep their first-seen order; a part marked
    more than once a call adds up."""
    from numba import cuda

    def one_call(marks: list) -> None:
        if evict is not None:
            evict(stream)
        start = cuda.event()
        start.record(stream)
        marks.append(("", start))

        def mark(part: str) -> None:
            ev = cuda.event()
            ev.record(stream)
            marks.append((part, ev))

        fn(mark)

    def group(marks: list) -> None:
        for _ in range(n):
            one_call(marks)

    hold_s = _warm_and_hold(lambda: group([]), warmup, lambda: fn(lambda part: None), hold_s)
    cuda.synchronize()
    samples: dict[str, list[float]] = {}
    for _ in range(reps):
        marks: list = []
        _hold(stream, hold_s)
        group(marks)
        marks[-1][1].synchronize()
        call: dict[str, float] = {}
        for (_, before), (part, after) in zip(marks, marks[1:], strict=False):
            if part:
                call[part] = call.get(part, 0.0) + before.elapsed_time(after) / 1e3
            else:
                for name, seconds in call.items():
                    samples.setdefault(name, []).append(seconds)
                call = {}
        for name, seconds in call.items():
            samples.setdefault(name, []).append(seconds)
    return {name: statistics.median(times) for name, times in samples.items()}


def pipelined_time(fn: Callable[[], None], reps: int, warmup: int, stream, n: int = 8) -> float:
    """Median seconds per call of `n` back-to-back calls as Python issues them (events around)."""
    for _ in range(warmup):
        fn()
    return statistics.median(_events_time(fn, n, stream) for _ in range(reps))


def host_time(fn: Callable[[], object], reps: int, warmup: int, before: Callable[[], None] | None = None) -> float:
    """Median wall-clock seconds of whole calls (fn must leave no work pending if that matters);
    `before`, if given, runs untimed before each timed call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_copy(a, stream):
    """A new device array with the contents of device array `a` (a device-to-device copy)."""
    from numba import cuda

    out = cuda.device_array(a.shape, a.dtype, stream=stream)
    out.copy_to_device(a, stream=stream)
    return out


def device_l2_bytes() -> tuple[int, str]:
    """The L2 size the driver reports for the current device, and "driver"; or L2_FALLBACK and a
    note saying it was assumed."""
    from numba import cuda

    try:
        size = int(cuda.get_current_device().L2_CACHE_SIZE)
    except Exception as exc:  # an old binding without the attribute, a stand-in device, a driver error
        return L2_FALLBACK, f"not reported ({type(exc).__name__}): {L2_FALLBACK >> 20} MiB assumed"
    if size <= 0:
        return L2_FALLBACK, f"reported as {size}: {L2_FALLBACK >> 20} MiB assumed"
    return size, "driver"


def measure_copy_bandwidths(reps: int, warmup: int, l2_bytes: int, nbytes: int = COPY_BYTES) -> list[BenchRow]:
    """The three copy probes over two buffers of `nbytes` (see the module docstring), best of
    COPY_ROUNDS interleaved rounds each; rows copy.memcpy, copy.copy_kernel, copy.read_kernel
    with their bound at the best of the three (ratio = best / this one). The buffers are freed
    before it returns."""
    rows = _copy_probes(reps, warmup, l2_bytes, nbytes)
    release_device_memory()
    return rows


def _copy_probes(reps: int, warmup: int, l2_bytes: int, nbytes: int) -> list[BenchRow]:
    from numba import cuda

    from flashv41.stages.bandwidth import copy_words, read_words, words_buffer

    stream = cuda.stream()
    src = words_buffer(nbytes, stream)
    dst = words_buffer(nbytes, stream)
    sink = cuda.device_array(1, src.dtype, stream=stream)
    moved = int(src.shape[1]) * 4
    probes: dict[str, tuple[Callable[[], None], int, str]] = {
        "memcpy": (lambda: dst.copy_to_device(src, stream=stream), 2 * moved, "cudaMemcpy device-to-device"),
        "copy_kernel": (lambda: copy_words(src, dst, stream), 2 * moved,
                        "copy kernel, 16-byte loads and stores, grid-stride"),
        "read_kernel": (lambda: read_words(src, sink, stream), moved,
                        "read-only kernel, 16-byte loads, xor in registers"),
    }
    start = time.perf_counter()
    while time.perf_counter() - start < COPY_WARM_S:
        for _ in range(8):
            copy_words(src, dst, stream)
        stream.synchronize()
    best: dict[str, float] = {}
    for _ in range(COPY_ROUNDS):
        for name, (fn, _, _) in probes.items():
            median = device_time(fn, reps, warmup, stream, n=4)
            best[name] = min(best.get(name, math.inf), median)
    top = max(probes[name][1] / best[name] for name in probes)
    rows = []
    for name, (_, nb, what) in probes.items():
        rate = nb / best[name]
        rows.append(BenchRow(f"copy.{name}", best[name], nb / top, bytes=nb,
                             note=f"{what}, {moved >> 20} MiB: {rate / 1e12:.3f} TB/s "
                                  f"({'read only' if nb == moved else 'read + write'})",
                             l2=plan_l2(nb, l2_bytes, rotate=False)))
    return rows


def all_cases(options: BenchOptions) -> list[BenchCase]:
    cases: list[BenchCase] = []
    for name in BENCH_MODULES:
        cases += importlib.import_module(name).cases(options)
    return cases


def select_cases(cases: Sequence[BenchCase], patterns: Sequence[str]) -> list[BenchCase]:
    """The cases whose names match any pattern (without patterns, every `default` case); InputError
    if a pattern matches none."""
    if not patterns:
        return [c for c in cases if c.default]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(c.name, pattern) for c in cases):
            known = ", ".join(c.name for c in cases)
            raise InputError(f"bench: no row matches {pattern!r} (rows: {known})")
    return [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]


def format_table(gpu: str, copy_bandwidth: float, rows: Sequence[BenchRow],
                 copy_bandwidths: dict[str, float] | None = None, l2_bytes: int = 0) -> str:
    """The rows as a fixed-width table, with the GPU, the copy bandwidth (and its three probes)
    and the L2 on top; each note ends with the row's L2 plan."""
    head = f"{gpu}: copy bandwidth {copy_bandwidth / 1e12:.3f} TB/s (read + write)"
    if copy_bandwidths:
        head += " = best of " + ", ".join(f"{k} {v / 1e12:.3f}" for k, v in copy_bandwidths.items())
    if l2_bytes:
        head += f"; L2 {l2_bytes / 2**20:.0f} MiB"
    lines = [head, f"{'row':<40} {'median':>11} {'bound':>11} {'ratio':>6} {'GB/s':>8}  note"]
    for r in rows:
        rate = f"{r.bytes / r.median_s / 1e9:8.1f}" if r.bytes and r.median_s > 0 else f"{'-':>8}"
        plan = f" [{r.l2.short()}]" if r.l2 is not None else ""
        lines.append(f"{r.name:<40} {r.median_s * 1e6:9.1f}us {r.bound_s * 1e6:9.1f}us {r.ratio:6.2f} {rate}  "
                     f"{r.note}{plan}")
    return "\n".join(lines)


def report(ctx: BenchContext, interrupted: str | None = None) -> dict:
    """The JSON report of a run: finished, or interrupted (Ctrl-C, a time limit's SIGINT) while it
    ran the case named `interrupted`, with the rows before it."""
    return {"gpu": ctx.gpu, "complete": interrupted is None, "interrupted_at": interrupted,
            "failed": [{"case": name, "error": error} for name, error in ctx.failed],
            "copy_bandwidth_bytes_per_s": ctx.copy_bandwidth,
            "copy_bandwidths": dict(ctx.copy_bandwidths), "l2_bytes": ctx.l2_bytes, "l2_source": ctx.l2_source,
            "l2_policy": f"data under {HBM_FACTOR}x L2: weight copies rotated (single products) or the L2 evicted "
                         f"by reading {EVICT_FACTOR}x L2 between repetitions (stages, steps, graphs)",
            "reps": ctx.options.reps, "rows": [r.to_json() for r in ctx.rows]}


def run(options: BenchOptions, json_path: Path | None = None, print_fn: Callable[[str], None] = print) -> BenchContext:
    """Measure the copy bandwidths and the L2, run the selected cases, print the table, write JSON
    if asked. The rows' progress goes to stderr (host.progress), each row's line through `print_fn`.
    Interrupted (KeyboardInterrupt: Ctrl-C, or `timeout --signal=INT`), it still prints the table and
    writes the JSON of the rows it finished, the JSON saying where it stopped, then re-raises. A case
    that raises loses its own rows, not the run's: its error is printed at once, the run goes on, the
    JSON lists it under "failed", and at the end a FlashError names every failed case."""
    require_gpu()
    if options.reps < MIN_REPS:
        raise InputError(f"bench: --reps must be at least {MIN_REPS}, got {options.reps}")
    cases = select_cases(all_cases(options), options.rows)
    # the rows write their synthetic models into the work directory, which is the benchmark's own
    options.workdir.mkdir(parents=True, exist_ok=True)
    from flashv41.stages.bandwidth import L2Evictor

    gpu = backend_name()
    print(f"bench on {gpu}: the copy bandwidth and the L2 first, then {len(cases)} row"
          f"{'s' if len(cases) != 1 else ''}", file=sys.stderr, flush=True)
    l2_bytes, l2_source = device_l2_bytes()
    copies = measure_copy_bandwidths(options.reps, options.warmup, l2_bytes)
    bandwidths = {r.name.removeprefix("copy."): r.bytes / r.median_s for r in copies}
    ctx = BenchContext(options, gpu, max(bandwidths.values()), list(copies), bandwidths, l2_bytes,
                       l2_source, L2Evictor(EVICT_FACTOR * l2_bytes))
    print_fn(f"  L2 {l2_bytes / 2**20:.0f} MiB ({l2_source}); copy bandwidth "
             + ", ".join(f"{k} {v / 1e12:.3f} TB/s" for k, v in bandwidths.items()))
    interrupted: str | None = None
    try:
        with Progress(f"bench on {ctx.gpu}", len(cases), "row", "rows") as progress:
            for case in cases:
                interrupted = case.name
                try:
                    rows = case.run(ctx)
                except Exception as e:  # one case's failure (a bug, the device's limits): the others still run
                    rows = []
                    error = f"{type(e).__name__}: {e}"
                    ctx.failed.append((case.name, error))
                    with progress.paused():
                        print(f"bench: {case.name} failed ({error}); going on with the rest", file=sys.stderr,
                              flush=True)
                release_device_memory()
                ctx.rows += rows
                progress.update()
                with progress.paused():
                    for r in rows:
                        print_fn(f"  {r.name}: {r.median_s * 1e6:.1f} us (bound {r.bound_s * 1e6:.1f} us, "
                                 f"ratio {r.ratio:.2f}; "
                                 f"{r.l2.describe() if r.l2 is not None else 'not a timing'})")
        interrupted = None
    except KeyboardInterrupt:
        interrupted = interrupted or "the first row"
        print(f"bench: interrupted in {interrupted}; the rows before it follow", file=sys.stderr, flush=True)
    finally:
        ctx.evictor.free()
    print_fn(format_table(ctx.gpu, ctx.copy_bandwidth, ctx.rows, ctx.copy_bandwidths, ctx.l2_bytes))
    if json_path is not None:
        json_path.write_text(json.dumps(report(ctx, interrupted), indent=2) + "\n")
    if interrupted is not None:
        raise KeyboardInterrupt
    if ctx.failed:
        raise FlashError(f"bench: {len(ctx.failed)} of {len(cases)} rows failed: "
                         + "; ".join(f"{name} ({error})" for name, error in ctx.failed))
    return ctx

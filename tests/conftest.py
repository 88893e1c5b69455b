"""Shared test setup: the kernel backend, the `gpu` marker, and synthetic models written once per
test run (pytest-xdist's workers share them).

The backend (a real GPU, or Numba's CUDA simulator on the CPU) must be chosen before anything
imports numba.cuda, so `select_backend()` runs here, when pytest imports this file, before any
test module. Compile-check mode comes first: importing flashv41.stages picks the backend itself
(the simulator, without a GPU), so it is installed before that import.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import compile_check

if compile_check.enabled():
    compile_check.install()

from flashv41.host.synth import write_synthetic  # noqa: E402  (after compile-check mode)
from flashv41.stages.backend import select_backend, using_simulator  # noqa: E402

select_backend()
if using_simulator() and not compile_check.enabled():
    from tests import simulator_fast_paths, simulator_threads

    SIMULATOR_THREADS = simulator_threads.install()  # the simulator's manager waits without spinning
    SIMULATOR_FAST_PATHS = simulator_fast_paths.install()  # casts and element access in fewer calls

GPU_SKIP_REASON = "needs a real CUDA GPU (running on the CUDA simulator)"


def pytest_report_header(config: pytest.Config) -> str:
    if compile_check.enabled():
        return "flashv41 kernels: compile-check mode (compiled for sm_90, not run)"
    return "flashv41 kernels: " + ("CUDA simulator (CPU)" if using_simulator() else "CUDA GPU")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """In compile-check mode only compile errors count: any other failure becomes a skip."""
    outcome = yield
    if not compile_check.enabled() or call.excinfo is None:
        return
    report = outcome.get_result()
    if report.failed and not compile_check.is_compile_error(call.excinfo.value):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0,
                           f"compile-check mode: results not computed ({call.excinfo.typename})")


TIMELINE_ENV = "FLASHV41_TEST_TIMELINE"
_timeline: dict[str, Any] = {}


def pytest_configure(config: pytest.Config) -> None:
    # a pytest-xdist controller reports its workers' tests through the same hooks: only the
    # process that runs a test writes its line
    _timeline["writes"] = bool(os.environ.get(TIMELINE_ENV)) and (
        bool(os.environ.get("PYTEST_XDIST_WORKER")) or not getattr(config.option, "numprocesses", None))


def timeline_line(event: str, nodeid: str) -> None:
    """With FLASHV41_TEST_TIMELINE naming a file (tools/gpu_suite.sh sets it): one line a test's
    start and end, `unix seconds<TAB>worker<TAB>start|end<TAB>test id`, appended by every worker, so
    a run a limit cuts short still says which tests were running, since when, and where the
    workers waited (tools/test_durations.py reads it)."""
    if not _timeline.get("writes"):
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.environ[TIMELINE_ENV], "a") as out:
        out.write(f"{time.time():.3f}\t{worker}\t{event}\t{nodeid.split('@')[0]}\n")


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    timeline_line("start", nodeid)


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    timeline_line("end", nodeid)


DURATIONS_ENV = "FLASHV41_TEST_DURATIONS"
UNMEASURED_S = 30.0  # a test the durations file does not name: new, or cut short where it was measured


def longest_first(items: list[pytest.Item], path: str) -> None:
    """Order items by their seconds in the JSON file at `path` (tools/test_durations.py), longest
    first, the tests of an xdist_group (which share an expensive module fixture, and go to one
    worker together) as one scope of their summed seconds, in collection order within it; ties in
    collection order. Every pytest-xdist worker collects the same order, and `--dist loadgroup
    --no-loadscope-reorder` hands the scopes out in it. (With the reorder, pytest-xdist's default,
    the groups went first, whatever their seconds: on an H100, 2026-12-07, the longest test
    started 53 s in, a 154-s one queued behind it, and fourteen workers idled the last 173 s.)"""
    durations = json.loads(Path(path).read_text())
    scope_of: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for item in items:
        group = item.get_closest_marker("xdist_group")
        scope = f"@{group.args[0] if group.args else group.kwargs.get('name')}" if group else item.nodeid
        scope_of[item.nodeid] = scope
        # (under --dist loadgroup a grouped test's id ends in @group)
        seconds[scope] = seconds.get(scope, 0.0) + durations.get(item.nodeid.split("@")[0], UNMEASURED_S)
    items.sort(key=lambda item: -seconds[scope_of[item.nodeid]])


# the flash-shape product tests that share one random weight over their token counts (made once in a
# row: test_linear_tc.weight's cache of one): on pytest-xdist with `--dist loadgroup` (the GPU
# suite) the counts of a weight go to one worker together, where the durations' order would have
# scattered them and made the weight once a test (about 300 s of the suite's work)
WEIGHT_SHARING = {("test_linear_tc.py", "test_flash_shapes"), ("test_linear_tc.py", "test_flash_grouped_wo_a"),
                  ("test_linear_imma.py", "test_flash_shapes"), ("test_linear_narrow.py", "test_flash_shapes")}


def group_by_weight(items: list[pytest.Item]) -> None:
    for item in items:
        if (item.path.name, getattr(item, "originalname", "")) not in WEIGHT_SHARING:
            continue
        params = item.callspec.params  # type: ignore[attr-defined]
        weight = f"{item.path.stem}-{params['gtype'].name}-{params.get('name', 'wo_a')}"
        item.add_marker(pytest.mark.xdist_group(weight))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which names each grouped test by its group
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    group_by_weight(items)
    if os.environ.get(DURATIONS_ENV):
        longest_first(items, os.environ[DURATIONS_ENV])
    if not using_simulator() or compile_check.enabled():
        return
    skip_gpu = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


SynthModel = Callable[..., Path]


def shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder of this test run that every pytest-xdist worker shares (the run's base temporary
    folder, above each worker's own), or this session's without xdist."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    root.mkdir(parents=True, exist_ok=True)
    return root


def written_once(root: Path, name: str, write: Callable[[Path], Path]) -> Path:
    """The file `write(folder)` makes in a folder of its own under root, made by one process of the
    run: the others wait for it (a lock file), then use it. It is written into a partial folder and
    renamed into place, so a folder that exists is whole."""
    done = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_dir():
            partial = root / f"{name}.partial-{os.getpid()}"
            partial.mkdir()
            (partial / "path").write_text(write(partial).name)
            partial.rename(done)
    return done / (done / "path").read_text()


@pytest.fixture(scope="session")
def synth_model(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    """`synth_model(preset, **kwargs) -> Path`: a synthetic model written by host.synth.write_synthetic
    with those arguments, once per test run for each distinct set of arguments: pytest-xdist's
    workers share it (a flash-sized file takes 10-20 s to write)."""
    root = shared_dir(tmp_path_factory, "models")
    written: dict[tuple[str, tuple[tuple[str, str], ...]], Path] = {}

    def make(preset: str = "tiny", **kwargs: Any) -> Path:
        key = (preset, tuple(sorted((name, repr(value)) for name, value in kwargs.items())))
        if key not in written:
            name = "_".join([preset] + [f"{k}-{v}" for k, v in key[1]])
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
            written[key] = written_once(root, safe, lambda folder: write_synthetic(folder / f"{safe}.gguf",
                                                                                   preset, **kwargs))
        return written[key]

    return make


@pytest.fixture(scope="session")
def tiny_path(synth_model: SynthModel) -> Path:
    """The tiny preset with default types (Q8_0 weights, Q2_K engram tables)."""
    return synth_model("tiny")


@pytest.fixture(scope="session")
def small_path(synth_model: SynthModel) -> Path:
    """The small preset with default types (Q8_0 weights, Q8_0 engram tables)."""
    return synth_model("small")

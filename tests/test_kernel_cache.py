"""The kernels' disk cache (stages.device.kernel_cache_dir): off unless FLASHV41_KERNEL_CACHE names
a folder, never on the simulator, and its folder named by the sources it compiles from.

Its use (a kernel saved with its cubin by one process, loaded by the next) needs numba-cuda's
compiler: run compile-check mode twice with the variable set (tests/compile_check.py goes through
the cache then); on 2026-12-07 tests/test_attention_kernels.py and test_batch_kernels.py took 106 s
the first time and 26 s the second.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flashv41.stages import device


def test_off_by_default_and_on_the_simulator(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(device.KERNEL_CACHE_ENV, raising=False)
    monkeypatch.setattr(device, "SIM", False)
    assert device.kernel_cache_dir() is None
    monkeypatch.setenv(device.KERNEL_CACHE_ENV, "")
    assert device.kernel_cache_dir() is None
    monkeypatch.setenv(device.KERNEL_CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(device, "SIM", True)
    assert device.kernel_cache_dir() is None


def test_named_by_the_sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A folder under the variable's, the same for the same sources; another source's bytes (here
    a file of stages/ read as other bytes) give another folder."""
    monkeypatch.setenv(device.KERNEL_CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(device, "SIM", False)
    first = device.kernel_cache_dir()
    assert first is not None and first.parent == tmp_path and first.name.startswith("kernels-")
    assert device.kernel_cache_dir() == first
    read = Path.read_bytes

    def edited(path: Path) -> bytes:
        return read(path) + (b"# edited\n" if path.name == "sparse_split.py" else b"")

    monkeypatch.setattr(Path, "read_bytes", edited)
    assert device.kernel_cache_dir() not in (None, first)

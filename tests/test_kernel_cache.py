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


KEY_SCRIPT = """
from flashv41.host.quants import GGMLType
from flashv41.stages import device
from flashv41.stages.linear import DEVICE_TYPES, stream_kernel

class Codegen:
    def magic_tuple(self):
        return ("nvptx64-nvidia-cuda", "sm_90", "")

for gtype in (GGMLType.Q8_0, GGMLType.Q4_K):
    kernel = stream_kernel(DEVICE_TYPES[gtype], False, False, 1, 1, 0, 32, 32)
    print(device._locked_cache()(kernel.py_func)._index_key(("sig",), Codegen())[3][1])
"""


def test_a_factory_kernel_has_one_key_in_every_process(tmp_path: Path) -> None:
    """The key a kernel's cache entry is found by is the same in two processes, and another type's
    kernel of the same factory has another. A Q8_0 stream kernel's closure reaches intrinsics (its
    device functions' globals), which numba's own key pickled with the id each process drew: every
    process saved a new entry and loaded none (an H100, 2026-12-07: the probe compiled it again)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", **{device.KERNEL_CACHE_ENV: str(tmp_path)})
    env.pop("FLASHV41_COMPILE_CHECK", None)

    def keys() -> list[str]:
        done = subprocess.run([sys.executable, "-c", KEY_SCRIPT], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split()

    first, second = keys(), keys()
    assert len(first) == 2 and first[0] != first[1]
    assert first == second

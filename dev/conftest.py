"""dev/'s tests choose the backend as tests/ does (the GPU where a driver works, else the
simulator), before any of them imports numba.cuda; and share one writer of synthetic models."""

from collections.abc import Callable
from pathlib import Path

import pytest

from flashv41.stages.backend import select_backend

select_backend()


@pytest.fixture(scope="session")
def synth_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`synth_model(preset, **kwargs) -> Path`: host.synth.write_synthetic into this session's
    folder, a file a call (tests/conftest.py's fixture of that name also shares files between
    pytest-xdist workers; dev/'s tests run in one process)."""
    from flashv41.host.synth import write_synthetic

    root = tmp_path_factory.mktemp("models")
    written = iter(range(1 << 30))

    def make(preset: str, **kwargs) -> Path:
        return write_synthetic(root / f"{preset}-{next(written)}.gguf", preset, **kwargs)

    return make

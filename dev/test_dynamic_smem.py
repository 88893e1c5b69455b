"""dev/dynamic_smem.py's probe: `python -m pytest dev/test_dynamic_smem.py` (outside the suite's
testpaths: a dev/ module is not the package's until it has run on a GPU and won)."""

from __future__ import annotations

import numpy as np
import pytest

from dev import dynamic_smem as ds
from flashv41.stages.device import SIM

SIZES = [16 << 10, 96 << 10, 200 << 10]


@pytest.mark.parametrize("nbytes", SIZES[:1] if SIM else SIZES)
def test_probe_sums_exactly(nbytes: int) -> None:
    assert np.array_equal(ds.probe(nbytes), ds.expected(nbytes))


@pytest.mark.skipif(SIM, reason="the simulator gives any dynamic size")
def test_past_48k_needs_the_attribute() -> None:
    """Without the attribute the driver refuses a launch past 48 KiB (so the attribute is what
    makes the 96 KiB probe above run)."""
    with pytest.raises(Exception, match="(?i)invalid|resources|shared"):
        ds.probe(64 << 10, allow=False)


def test_refuses_more_than_sm90_has() -> None:
    with pytest.raises(ValueError, match="at most 232448"):
        ds.allow_dynamic_shared(ds._probe_kernel, (), ds.SM90_LIMIT + 4)

"""The GPU suite's bookkeeping scripts (tools/test_durations.py, tools/suite_timeline.py) on made-up
runs: a timeline with a test a limit cut short, a JUnit file with a grouped test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def tool(name: str) -> ModuleType:
    """tools/<name>.py as a module, tools/ on the path as when it runs as a script."""
    if str(TOOLS) not in sys.path:
        sys.path.append(str(TOOLS))
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timeline(path: Path) -> Path:
    """Four workers from t = 1000 (their first tests a millisecond apart, as on the GPU machine): gw0
    runs t0 for 100 s, gw1 and gw2 10 s each, gw3's t3 never ends; gw1 starts `late` at 120 s (the
    last line)."""
    lines = []
    for w, seconds in enumerate((100, 10, 10, None)):
        lines.append(f"{1000 + w / 1000:.3f}\tgw{w}\tstart\ttests/test_a.py::t{w}")
        if seconds is not None:
            lines.append(f"{1000 + seconds:.3f}\tgw{w}\tend\ttests/test_a.py::t{w}")
    lines.append("1120.000\tgw1\tstart\ttests/test_a.py::late")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_durations_count_a_test_cut_short(tmp_path: Path) -> None:
    durations = tool("test_durations")
    line = timeline(tmp_path / "timeline.tsv")
    assert durations.unfinished(line) == {"tests/test_a.py::t3": 120.0, "tests/test_a.py::late": 0.0}
    earlier = tmp_path / "earlier.json"
    earlier.write_text('{"tests/test_a.py::t3": 30.0, "tests/test_a.py::t0": 95.0}')
    merged = durations.merge([earlier, line])
    assert merged["tests/test_a.py::t3"] == 120.0 and merged["tests/test_a.py::t0"] == 95.0


def test_durations_name_grouped_tests_as_conftest_looks_them_up(tmp_path: Path) -> None:
    xml = tmp_path / "run.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.test_b" name="test_c[x]@grp" time="12.5"/>'
                   '<testcase time="0.001"/><testcase classname="tests.test_b" name="test_d" time="1">'
                   '<skipped/></testcase></testsuite></testsuites>')
    assert tool("test_durations").xml_durations(xml) == {"tests/test_b.py::test_c[x]": 12.5}


def test_timeline_summary_names_the_tail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tool("suite_timeline").main([str(timeline(tmp_path / "timeline.tsv"))]) == 0
    out = capsys.readouterr().out
    assert "5 tests over 4 workers in 120 s" in out
    assert "unfinished on gw3 after 120 s: tests/test_a.py::t3" in out
    # from 100 s only gw3 (and gw1's late start at 120) had work: fewer than half of four (at 0 s,
    # too, before the later workers' first tests had started: not the tail)
    assert "from 100 s on fewer than 2 workers had work (20 s)" in out
    assert "gw0       1 tests, busy    100 s, idle     20 s" in out



class FakeItem:
    """What longest_first reads of a pytest item: its id and its xdist_group marker."""

    def __init__(self, nodeid: str, group: str = "") -> None:
        self.nodeid = nodeid
        self.group = pytest.mark.xdist_group(group).mark if group else None

    def get_closest_marker(self, name: str):
        return self.group if name == "xdist_group" else None


def test_longest_first_ranks_a_group_by_its_sum(tmp_path: Path) -> None:
    """A group of two 20-s tests (40 s) before a 30-s test, its tests together in collection order;
    an unnamed test counts UNMEASURED_S (30 s), after a 30-s one collected before it."""
    from tests.conftest import longest_first

    durations = tmp_path / "durations.json"
    durations.write_text('{"t::a": 20, "t::b": 30, "t::c": 20, "t::d": 1}')
    items = [FakeItem("t::a", "g"), FakeItem("t::b"), FakeItem("t::d"), FakeItem("t::c", "g"), FakeItem("t::new")]
    longest_first(items, str(durations))  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == ["t::a", "t::c", "t::b", "t::new", "t::d"]

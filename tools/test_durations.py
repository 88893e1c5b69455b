"""The GPU suite's test durations, for scheduling the longest tests first.

    python tools/test_durations.py OUT.json [IN.json ...] [RUN.xml ...] [TIMELINE.tsv ...]

Reads JUnit XML files of pytest runs (tools/gpu_suite.sh writes them) and earlier duration files,
and writes OUT.json: {test id: seconds}, a test's figure from the last file that has it (so a new
run's figures replace older ones; list the XML files after the JSON ones). A timeline
(FLASHV41_TEST_TIMELINE, tests/conftest.py) adds the tests a limit cut short: each counts at least
the seconds it had run by the timeline's last line, and is printed with them, so a test that never
finished is not scheduled as an unmeasured one (30 s) in the next run. tests/conftest.py
orders the collected tests longest first by such a file when FLASHV41_TEST_DURATIONS names it:
with pytest-xdist's `--dist load`, which hands the tests out in that order, the few tests that
take minutes start first instead of holding a worker at the end of the run.

tools/gpu_durations.json is the file the GPU suite reads; each GPU run leaves an updated one in its
log folder (gpu_durations.json) to copy back.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from suite_timeline import read as read_timeline  # (tools/, on the path of a script run from it)


def xml_durations(path: Path) -> dict[str, float]:
    """{test id: seconds} of a JUnit XML file: classname tests.test_x and name test_y[p] give
    tests/test_x.py::test_y[p] (setup and teardown included, as pytest-xdist's worker spends them);
    skipped tests are left out."""
    found: dict[str, float] = {}
    for case in ET.parse(path).iter("testcase"):
        if case.find("skipped") is not None:  # (the simulator's skips of every gpu test too)
            continue
        # (a test of an xdist_group is named test_y[p]@group there; conftest looks it up without)
        classname, name = case.get("classname", ""), case.get("name", "").split("@")[0]
        if not name:
            continue
        parts = classname.split(".")
        # a test in a class: tests.test_x.TestY -> tests/test_x.py::TestY::name
        module = [p for p in parts if not p[:1].isupper()]
        classes = [p for p in parts if p[:1].isupper()]
        node = "/".join(module) + ".py::" + "::".join([*classes, name])
        found[node] = round(float(case.get("time", "0")), 2)
    return found


def unfinished(path: Path) -> dict[str, float]:
    """{test id: seconds run} of the tests a timeline shows started and not ended, counted to its
    last line (tools/suite_timeline.py reads it)."""
    runs, _, last = read_timeline(path)
    return {node: round(last - start, 2) for _, node, start, end in runs if end is None}


def merge(paths: list[Path]) -> dict[str, float]:
    merged: dict[str, float] = {}
    for path in paths:
        if path.suffix == ".tsv":
            for node, seconds in unfinished(path).items():
                print(f"{path.name}: {node} unfinished after {seconds:.0f} s")
                merged[node] = max(merged.get(node, 0.0), seconds)
        else:
            merged.update(json.loads(path.read_text()) if path.suffix == ".json" else xml_durations(path))
    return dict(sorted(merged.items(), key=lambda kv: -kv[1]))


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    out, inputs = Path(argv[0]), [Path(a) for a in argv[1:] if Path(a).exists()]
    durations = merge(inputs)
    out.write_text(json.dumps(durations, indent=1) + "\n")
    print(f"{out}: {len(durations)} tests, {sum(durations.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Where a GPU suite run's wall time went, from its timeline (tests/conftest.py writes it where
FLASHV41_TEST_TIMELINE says; tools/gpu_suite.sh: LOG_DIR/timeline.tsv).

    python tools/suite_timeline.py LOG_DIR/timeline.tsv

Prints each worker's busy and idle seconds within the run, the tests that never ended (a limit
cut them), the moment fewer than half the workers still had work and the tests that ran from
there on (the tail a longest-first order should have started earlier), and the longest tests.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path


def read(path: Path) -> tuple[list[tuple[str, str, float, float | None]], float, float]:
    """(worker, test, start, end or None) for every test started, and the first and last stamps."""
    runs: list[tuple[str, str, float, float | None]] = []
    open_at: dict[tuple[str, str], int] = {}
    first, last = float("inf"), 0.0
    for line in path.read_text().splitlines():
        stamp_s, worker, event, node = line.split("\t")
        stamp = float(stamp_s)
        first, last = min(first, stamp), max(last, stamp)
        if event == "start":
            open_at[(worker, node)] = len(runs)
            runs.append((worker, node, stamp, None))
        elif (worker, node) in open_at:
            i = open_at.pop((worker, node))
            runs[i] = (worker, node, runs[i][2], stamp)
    return runs, first, last


def busy_workers_at(runs: list[tuple[str, str, float, float | None]], t: float, last: float) -> int:
    return len({w for w, _, s, e in runs if s <= t < (e if e is not None else last)})


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    if not Path(argv[0]).exists():
        print(f"no timeline at {argv[0]} (no test started)")
        return 1
    runs, first, last = read(Path(argv[0]))
    if not runs:
        print("no tests in the timeline")
        return 1
    span = last - first
    workers = sorted({w for w, *_ in runs})
    print(f"{len(runs)} tests over {len(workers)} workers in {span:.0f} s (first start to last line)")
    busy: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for w, _, s, e in runs:
        busy[w] += (e if e is not None else last) - s
        count[w] += 1
    for w in workers:
        print(f"  {w:6s} {count[w]:4d} tests, busy {busy[w]:6.0f} s, idle {span - busy[w]:6.0f} s")
    cut = [(w, n, last - s) for w, n, s, e in runs if e is None]
    for w, n, seconds in cut:
        print(f"unfinished on {w} after {seconds:.0f} s: {n}")
    # the tail: on a 1-s grid, from the moment after the last one at which half the workers or more
    # were busy (not the first one with fewer: the workers' first tests start a few ms apart)
    half = len(workers) / 2
    full = [i for i in range(int(span) + 1) if busy_workers_at(runs, first + i, last) >= half]
    tail = first + (full[-1] + 1 if full else 0)
    if tail < last - 1:
        late = sorted(((e if e is not None else last) - max(s, tail), n) for _, n, s, e in runs
                      if (e if e is not None else last) > tail)
        print(f"from {tail - first:.0f} s on fewer than {half:.0f} workers had work ({last - tail:.0f} s); "
              f"running then:")
        for seconds, n in late[::-1][:10]:
            print(f"  {seconds:6.0f} s  {n}")
    print("longest tests:")
    for seconds, n in sorted(((e if e is not None else last) - s, n) for _, n, s, e in runs)[::-1][:10]:
        print(f"  {seconds:6.0f} s  {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

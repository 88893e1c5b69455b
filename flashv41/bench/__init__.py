"""`flashv41 bench`: the rows of docs/performance.md timed at V4.1-Flash dimensions against their bounds.

`core` holds the method (copy probes, L2 plans, timers, the table); one module per group of rows
(`gemv` P1, `attention` P2, `engram` P3 and P6, `stack` P4 and M1, `prefill` P5, `prefill_stack`
P5L, `head` H1) supplies `cases(options)`.
"""

from flashv41.bench.core import MIN_REPS, BenchOptions, run

__all__ = ["MIN_REPS", "BenchOptions", "run"]

"""Progress of long work (writing a model, prefill chunks, decode steps, the oracle check, the
benchmark rows), on stderr, shared by every floor.

On a terminal it is a tqdm bar, cleared when the work ends, so the results printed after it stand
alone. Anywhere else (a pipe, a CI log, a test's captured stderr) a bar would be a stream of
carriage returns, so instead the work is named in one line when it starts and, if it runs long,
one line every LOG_EVERY_S seconds says how far it got, how fast and how much is left: a log shows
the run is alive without a line per step, and a short run (a test) adds only its opening line.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TextIO

from tqdm import tqdm

LOG_EVERY_S = 10.0
# the bar and the log line show the same figures after the counts: elapsed < remaining, the rate
_TIMES = "[{elapsed}<{remaining}, {rate_fmt}]"


def is_terminal(stream: TextIO) -> bool:
    """True when `stream` is an interactive terminal (a closed or replaced stream is not)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """`total` units of work named `desc`; `update(amount)` after each piece. `unit` names one
    unit in the rate (step -> 2.36 s/step), `units` the count (12/200 steps); `scale` is how many
    of `update`'s amounts make one shown unit (2**20 bytes a MiB), shown with `decimals` digits.
    A context manager: leaving it (an interrupt included) clears the bar."""

    def __init__(self, desc: str, total: float, unit: str, units: str, scale: float = 1.0, decimals: int = 0,
                 stream: TextIO | None = None, log_every_s: float = LOG_EVERY_S):
        self.desc = desc
        self.total = total / scale
        self.scale = scale
        self.stream = stream if stream is not None else sys.stderr
        self.log_every_s = log_every_s
        counts = f"{{n:.{decimals}f}}/{{total:.{decimals}f}} {units} {_TIMES}"
        self._line_format = "{desc}: " + counts
        self.unit = unit
        self.bar: tqdm | None = None
        self.done = 0.0
        self.start = time.monotonic()
        self.last_line = self.start
        if is_terminal(self.stream):
            self.bar = tqdm(total=self.total, desc=desc, unit=unit, file=self.stream, leave=False,
                            dynamic_ncols=True, mininterval=0.5,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| " + counts)
        else:
            named = unit if self.total == 1 else units
            print(f"{desc}: {self.total:.{decimals}f} {named}", file=self.stream, flush=True)

    def update(self, amount: float = 1.0) -> None:
        shown = amount / self.scale
        self.done += shown
        if self.bar is not None:
            self.bar.update(shown)
            return
        now = time.monotonic()
        if now - self.last_line >= self.log_every_s:
            self.last_line = now
            line = tqdm.format_meter(self.done, self.total, now - self.start, prefix=self.desc, unit=self.unit,
                                     bar_format=self._line_format)
            print(line, file=self.stream, flush=True)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Print other lines while the bar is up: the bar steps aside and comes back below them."""
        if self.bar is None:
            yield
            return
        with tqdm.external_write_mode(file=self.stream):
            yield

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

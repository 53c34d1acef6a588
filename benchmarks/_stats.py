"""Summaries the micro-benchmarks share: a median with its spread, and the machine's load.

A median alone hides a noisy machine; every timed table quotes the median with the
interquartile range (25th-75th percentile) and the number of repeats, and every result
file records the load average before and after the run, so a figure taken under load
can be told from one taken on a quiet machine.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Spread:
    """Summary of repeated timings, in the unit they were given in."""

    n: int
    median: float
    q1: float
    q3: float
    lo: float
    hi: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def cell(self, scale: float = 1.0, digits: int = 2) -> str:
        """``median (q1–q3)`` scaled (e.g. 1e3 for seconds to ms), for a markdown table."""
        f = f"{{:,.{digits}f}}"
        return f"{f.format(self.median * scale)} ({f.format(self.q1 * scale)}–{f.format(self.q3 * scale)})"


def spread(values: list[float]) -> Spread:
    """Median, quartiles and extremes (lo, hi) of ``values`` (at least one)."""
    if not values:
        raise ValueError("spread() needs at least one value")
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return Spread(len(values), statistics.median(values), q1, q3, min(values), max(values))


def load_average() -> float:
    """The 1-minute load average (what ``uptime`` shows first)."""
    return os.getloadavg()[0]

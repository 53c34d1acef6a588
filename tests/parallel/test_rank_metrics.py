"""CpuClock: the CPU seconds and run-queue wait a trainer step logs (perf/train_cpu_s, perf/train_runq_s)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from realscale.parallel.rank_metrics import CpuClock


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_cpu_seconds_count_work_not_sleep() -> None:
    clock = CpuClock()
    _spin(0.2)
    busy = clock.seconds()
    time.sleep(0.2)
    idle = clock.seconds()
    assert busy["cpu_s"] >= 0.19
    assert idle["cpu_s"] < 0.1  # sleeping costs no CPU, whatever the machine's load


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="run-queue wait is read from /proc (Linux)")
def test_runq_seconds_are_reported_and_never_negative() -> None:
    """With threads of this process spinning beside the calling one (they compete for the
    cores): the figure exists and is a non-negative duration, at most the wall time."""
    clock = CpuClock()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=_spin, args=(0.1,)) for _ in range(2)]
    for t in threads:
        t.start()
    _spin(0.1)
    for t in threads:
        t.join()
    out = clock.seconds()
    wall = time.perf_counter() - t0
    assert "runq_s" in out and 0.0 <= out["runq_s"] <= wall

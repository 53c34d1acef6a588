"""Module-level functions for WatchdogPool tests (spawned children import them by name)."""

from __future__ import annotations

import os
import signal
import time


def square_or_misbehave(item: tuple[str, int]) -> int:
    """("ok", n) -> n*n; ("hang", s) blocks every signal and sleeps s seconds, the way a
    check stuck in C code ignores timers; ("die", code) exits the process at once."""
    kind, n = item
    if kind == "hang":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGINT, signal.SIGTERM})
        time.sleep(n)
        return -1
    if kind == "die":
        os._exit(n)
    return n * n

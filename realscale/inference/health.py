"""Is a generation server up? ``GET /health`` answering 200, asked of one URL or waited for
on several (every backend: the embedded server, vLLM and SGLang all serve ``/health`` once
they can generate).

Used before anything else talks to a server: by the launchers while a server starts
(:mod:`realscale.launcher.local`, :mod:`realscale.launcher.slurm`), and by the rollouts of
a fresh run, which start while the servers may still be loading (the supervisor starts
the trainer ranks beside the servers so that the two start-ups overlap). Never during a
weight update: SGLang's ``/health`` generates a token and waits behind a pause
(:mod:`realscale.inference.client`).
"""

from __future__ import annotations

import time
import urllib.request


def answers_health(url: str, timeout: float = 2.0) -> bool:
    """Whether ``url`` answers ``GET /health`` with 200 within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as resp:
            return resp.status == 200
    except OSError:  # refused (nobody listens yet), reset, timed out, or an HTTP error status
        return False


def wait_until_serving(urls: list[str], timeout: float, poll_s: float = 0.25) -> None:
    """Return once every one of ``urls`` answers ``/health``; TimeoutError naming the ones
    that did not after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    waiting = list(urls)
    while True:
        waiting = [u for u in waiting if not answers_health(u)]
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"generation server(s) {', '.join(waiting)} did not answer /health within "
                               f"{timeout:.0f} s (launch.health_timeout); see the run's logs/server<i>.log")
        time.sleep(poll_s)

"""Waiting on a running embedded server from a test (its /get_server_info counters)."""

from __future__ import annotations

import asyncio
import time


async def wait_running(session, url: str, n: int, timeout: float = 30.0) -> None:
    """Until the server at ``url`` has ``n`` requests running (decoding), at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        async with session.get(url + "/get_server_info") as r:
            if (await r.json())["num_running_reqs"] >= n:
                return
        assert time.monotonic() < deadline, f"{url} never ran {n} requests at once"
        await asyncio.sleep(0.002)

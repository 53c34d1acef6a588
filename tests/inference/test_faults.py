"""A server SIGKILLed mid-run: the client finishes every request on the others."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from realscale.inference.client import InferenceClient
from realscale.parallel.net import free_port

pytestmark = pytest.mark.multiproc


def _start(port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "realscale", "serve", "--model", "tiny-qwen2", "--port", str(port),
           "--threads", "1", "--context-length", "512"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server {url} exited with {proc.returncode}"
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server {url} not healthy within {timeout} s")


def test_client_survives_server_kill() -> None:
    from realscale.models.tiny import resolve_model_path

    resolve_model_path("tiny-qwen2")  # build once before two processes race to
    ports = [free_port(), free_port()]
    procs = [_start(p) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url, proc in zip(urls, procs):
            _wait_healthy(url, proc)

        async def main():
            async with InferenceClient(urls, request_timeout=60, backoff=0.05) as client:
                tasks = [asyncio.create_task(client.generate([i % 50 + 1, 3], {"max_new_tokens": 150,
                                                                              "ignore_eos": True}))
                         for i in range(16)]
                # wait (bounded) until both servers hold requests: on a loaded machine the
                # first requests can take a while to reach them
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and not all(s.in_flight for s in client.servers):
                    await asyncio.sleep(0.05)
                busy = [s.in_flight for s in client.servers]
                os.kill(procs[0].pid, signal.SIGKILL)  # mid-run: both servers hold requests
                results = await asyncio.gather(*tasks)
                return busy, results, [s.healthy for s in client.servers]

        busy, results, healthy = asyncio.run(main())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
    assert all(b > 0 for b in busy), f"least-load routing should use both servers, got {busy}"
    assert healthy == [False, True]
    assert all(len(r.output_ids) == 150 and r.finish_reason["type"] == "length" for r in results)
    assert sum(r.num_resends for r in results) >= 1

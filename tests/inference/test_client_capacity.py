"""The client puts no cap of its own on how many requests run at once (issue 30 item 1).

A 36-server cluster has 9,216 decode slots; a fixed pool of 256 connections held it at 3%.
Here a loopback server speaking SGLang's ``/generate`` reply holds every request for a
moment and counts how many it holds at once: the client must reach it with all of them,
and with a per-server cap (``generate.max_running_requests`` x 2, the rollouts' setting)
with no more than the cap.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from realscale.config import load_config
from realscale.inference.client import InferenceClient
from realscale.rollout.controller import client_kwargs


async def _counting_server(hold_until: int, hold_s: float) -> tuple[web.AppRunner, str, dict[str, int]]:
    """Each request is held until ``hold_until`` are held at once (or ``hold_s`` passed)."""
    seen = {"now": 0, "peak": 0, "total": 0}
    full = asyncio.Event()

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        seen["now"] += 1
        seen["total"] += 1
        seen["peak"] = max(seen["peak"], seen["now"])
        if seen["now"] >= hold_until:
            full.set()
        try:
            await asyncio.wait_for(full.wait(), hold_s)
        except asyncio.TimeoutError:
            pass
        finally:
            seen["now"] -= 1
        n = int(body["sampling_params"]["max_new_tokens"])
        return web.json_response({"text": "", "output_ids": [7] * n, "meta_info": {
            "finish_reason": {"type": "length", "length": n}, "weight_version": "0",
            "output_token_logprobs": [[-0.5, 7, None]] * n}})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/model_info", lambda r: web.json_response({"model_path": "m"}))
    app.router.add_get("/health", lambda r: web.Response(status=200))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the OS-picked port
    return runner, f"http://127.0.0.1:{port}", seen


async def _drive(n: int, hold_s: float, **client_options: object) -> dict[str, int]:
    runner, url, seen = await _counting_server(hold_until=n, hold_s=hold_s)
    try:
        async with InferenceClient([url], **client_options) as client:
            results = await asyncio.gather(*(client.generate([1, 2, 3], {"max_new_tokens": 2}) for _ in range(n)))
            seen["client_peaks"] = client.take_peaks()  # what the step log reports (rollout/inflight)
            assert client.take_peaks() == (0, 0) and client.occupancy() == {url: 0}
        assert all(len(r.output_ids) == 2 for r in results)
    finally:
        await runner.cleanup()
    return seen


def test_the_client_holds_more_than_256_requests_at_once() -> None:
    seen = asyncio.run(_drive(400, hold_s=30.0))  # released once all 400 are held (a cap would wait 30 s)
    assert seen["total"] == 400
    assert seen["peak"] == 400, f"the client let only {seen['peak']} of 400 requests run at once"
    assert seen["client_peaks"] == (400, 400)


def test_a_per_server_cap_follows_the_servers_capacity() -> None:
    cfg = load_config(None, ["generate.max_running_requests=8"])
    options = client_kwargs(cfg)
    assert options["per_server"] == 16  # twice the decode slots: the second half waits in the server's queue
    seen = asyncio.run(_drive(50, hold_s=0.5, per_server=options["per_server"]))
    assert seen["total"] == 50 and seen["peak"] == 16
    assert seen["client_peaks"][1] == 50  # requests waiting for a connection count as in flight here

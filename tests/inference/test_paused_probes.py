"""Weight updates reach paused servers without a generation-health probe (issue 28, defect 1).

In the pinned SGLang (0.5.23) ``/health`` is the ``/health_generate`` handler
(sglang/srt/entrypoints/http_server.py:721-723; ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``
defaults to true, sglang/srt/environ.py:344): a one-token generation that waits behind a
pause (sglang/srt/managers/tokenizer_manager.py:938-939) and answers 503 after
``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds (http_server.py:218, 779-799). The embedded server
now does the same (here with a 0.5 s timeout), so a client that probes ``/health`` on the
servers it paused for a weight update retires every one of them, as it would on SGLang.
The client asks ``/model_info`` (http_server.py:812-813: no generation) instead, and its
background health check leaves paused servers alone.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import requests
from http_record import record_requests

from realscale.config import PAUSE_MODES
from realscale.inference import sglang_reference as ref
from realscale.inference.client import InferenceClient
from realscale.publish.transport import flush_after_update

TIMEOUT_S = 0.5  # SGLANG_HEALTH_CHECK_TIMEOUT of this module's server (SGLang's default: 20)


@pytest.fixture(scope="module")
def paused_server():
    """A tiny embedded server with SGLang's health check at 0.5 s; yields (url, server, seen)."""
    from realscale.serve.server import EmbeddedServer, start_in_thread

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", str(TIMEOUT_S))
        server = EmbeddedServer("tiny-qwen2", max_running=4, context_length=128)
    seen = record_requests(server)
    url, stop = start_in_thread(server)
    yield url, server, seen
    stop()


def _get(url: str, path: str) -> tuple[int, float]:
    start = time.monotonic()
    status = requests.get(url + path, timeout=30).status_code
    return status, time.monotonic() - start


def test_embedded_health_waits_behind_a_pause_like_sglang(paused_server) -> None:
    url, server, _ = paused_server
    assert server.health_check_timeout == TIMEOUT_S and server.health_generates
    assert _get(url, "/health")[0] == 200
    for mode in PAUSE_MODES:
        assert requests.post(url + "/pause_generation", json={"mode": mode}, timeout=30).status_code == 200
        try:
            for path in ("/health", "/health_generate"):
                status, took = _get(url, path)
                assert status == 503 and took >= TIMEOUT_S, (mode, path, status, took)
            assert _get(url, "/model_info")[0] == 200  # the liveness route: no generation
            server.health_generates = False  # SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false: a flag check
            try:
                assert _get(url, "/health")[0] == 200 and _get(url, "/health_generate")[0] == 503
            finally:
                server.health_generates = True
        finally:
            assert requests.post(url + "/continue_generation", json={}, timeout=30).status_code == 200
    assert _get(url, "/health")[0] == 200


@pytest.mark.parametrize("mode", PAUSE_MODES)
def test_weight_update_on_servers_paused_in_every_mode(paused_server, mode: str) -> None:
    """A generation in flight, pause(mode), a disk update, the reshard path's probe, resume:
    the server is never retired, the update lands and the generation finishes on it."""
    url, server, seen = paused_server
    version = f"v-{mode}"

    async def run() -> tuple:
        async with InferenceClient([url]) as client:
            task = asyncio.create_task(client.generate([5, 6], {"max_new_tokens": 40, "ignore_eos": True}))
            deadline = time.monotonic() + 60
            while not server.engine.stats()["num_running_reqs"] and not task.done():
                assert time.monotonic() < deadline, "the generation never started"
                await asyncio.sleep(0.01)
            await client.pause(mode)
            mark = len(seen)
            await client.update_weights_from_disk(server.model_path, weight_version=version,
                                                  flush_cache=flush_after_update(mode))
            targets = await client.weight_targets()  # what ReshardTransport asks before a weight world
            probed = [p for _, p, _ in seen[mark:]]
            await client.resume()
            return await task, targets, probed, [s.retired for s in client.servers]

    result, targets, probed, retired = asyncio.run(run())
    assert targets == [url] and retired == [False]
    assert "/health" not in probed and "/health_generate" not in probed and "/model_info" in probed
    assert server.engine.weight_version == version
    assert len(result.output_ids) == 40 and version in result.output_versions


def test_background_health_check_leaves_paused_servers_alone(paused_server) -> None:
    url, _, seen = paused_server

    async def run() -> tuple:
        async with InferenceClient([url], health_interval=0.05) as client:
            await client.pause("abort")
            client.servers[0].healthy = False  # a request failed during the pause
            mark = len(seen)
            await asyncio.sleep(1.0)  # many health intervals
            during = [p for _, p, _ in seen[mark:]]
            await client.resume()
            deadline = time.monotonic() + 30
            while not client.servers[0].healthy:  # back in rotation by its next good /health
                assert time.monotonic() < deadline, "the server never came back"
                await asyncio.sleep(0.05)
            return during

    assert asyncio.run(run()) == []


SRC = ref.ensure_source()


@pytest.mark.skipif(SRC is None, reason=ref.missing_reason())
def test_the_cited_sglang_source() -> None:
    """What the client relies on, read from the pinned SGLang's http_server.py."""
    import ast

    http = os.path.join(SRC, "sglang/srt/entrypoints/http_server.py")
    routes = ref.routes(http)
    assert "GET" in routes["/model_info"] and "GET" in routes["/health"]
    health = ref.function(http, "health_generate")
    decorated = {ast.literal_eval(d.args[0]) for d in health.decorator_list if isinstance(d, ast.Call) and d.args}
    assert {"/health", "/health_generate"} <= decorated  # one handler: /health generates
    assert "generate_request" in ast.unparse(health)
    assert "generate_request" not in ast.unparse(ref.function(http, "model_info"))
    with open(http, encoding="utf-8") as fh:
        assert 'HEALTH_CHECK_TIMEOUT = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))' in fh.read()

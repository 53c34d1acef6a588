"""Fidelity table: each SGLang behaviour the project relies on, probed the same way on the
real SGLang server (0.5.23 on CPU) and on the embedded server that stands in for it in the
default tests; the outcomes must be equal.

Each probe drives one server over HTTP only and reduces what it saw to an outcome (status
codes, finish reasons, whether a call waited); the test runs it on both servers and
compares. None differs now (the one difference the table showed at first was the probe's:
a fixed wait found the embedded server's answer already finished); a behaviour the client
does not depend on is not probed. The table (probe, SGLang's outcome,
the embedded server's) is printed with ``-s``. The SGLang source that decides each
behaviour is cited at the probe.

Runs in the ``sglang`` tier (needs SGLang-on-CPU: ``bash scripts/sglang_cpu/install.sh``,
then ``$VENV/bin/python -m pytest -m sglang``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time
from typing import Any

import pytest

import real_engines as cases

pytestmark = [pytest.mark.sglang, pytest.mark.multiproc, pytest.mark.timeout(900)]

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed here: bash scripts/sglang_cpu/install.sh, then run pytest from its venv",
                allow_module_level=True)

HEALTH_TIMEOUT_S = "3"  # SGLANG_HEALTH_CHECK_TIMEOUT for both servers (SGLang's default 20 s)
LONG = 480  # tokens: a request still running a moment after it starts (context 512)
PROMPT = [10, 11, 12, 13]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{"sglang": url, "embedded": url}, both serving the same tiny model."""
    from realscale.config import GenerateConfig
    from realscale.launcher.local import spawn_engine_server, start_servers, stop_servers, wait_healthy

    root = tmp_path_factory.mktemp("fidelity")
    model = cases.tiny_model(str(root / "model"), 0)
    saved = os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT")
    os.environ["SGLANG_HEALTH_CHECK_TIMEOUT"] = HEALTH_TIMEOUT_S  # both read it at start
    started = []
    try:
        gen = GenerateConfig(backend="sglang", max_running_requests=8, context_length=512, pause_mode="retract")
        started.append(spawn_engine_server(model, gen, str(root / "sglang.log"), seed=0))
        started += start_servers(model, 1, str(root), max_running=8, context_length=512)
        wait_healthy(started[0], 900, what="SGLang server")
        yield {"sglang": started[0].url, "embedded": started[1].url}
    finally:
        stop_servers(started, grace=15)
        if saved is None:
            os.environ.pop("SGLANG_HEALTH_CHECK_TIMEOUT", None)
        else:
            os.environ["SGLANG_HEALTH_CHECK_TIMEOUT"] = saved


def _body(n: int, **extra: Any) -> dict[str, Any]:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True},
            "return_logprob": True, **extra}


async def _call(session, method: str, url: str, body: Any = None) -> tuple[int, Any]:
    async with session.request(method, url, json=body) as resp:
        try:
            return resp.status, await resp.json(content_type=None)
        except ValueError:
            return resp.status, await resp.text()


async def _wait_running(session, url: str, n: int) -> None:
    """Until the server runs ``n`` requests (both decode a 480-token answer in about half a
    second here, so a fixed sleep may find it finished): SGLang's ``/v1/loads``, the
    embedded server's ``/get_server_info`` (which has no /v1/loads)."""
    for _ in range(3000):
        status, reply = await _call(session, "GET", url + "/v1/loads")
        if status == 200:
            running = sum(int(load["num_running_reqs"]) for load in reply["loads"])
        else:
            running = int((await _call(session, "GET", url + "/get_server_info"))[1]["num_running_reqs"])
        if running >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{url}: {n} requests never ran together")


def _finish(reply: Any) -> str | None:
    return ((reply.get("meta_info") or {}).get("finish_reason") or {}).get("type") if isinstance(reply, dict) else None


async def probe_generate(session, url: str) -> dict[str, Any]:
    """``/generate`` with token ids, ``return_logprob`` and a null field clients send
    (AReaL: ``"image_data": null``): 200, one log-prob per token, the finish reason, the
    weight version (``GenerateReqInput``, io_struct.py; tokenizer_manager
    ``convert_logprob_style``)."""
    status, reply = await _call(session, "POST", url + "/generate", _body(8, image_data=None))
    meta = reply["meta_info"]
    return {"status": status, "tokens": len(reply["output_ids"]), "logprobs": len(meta["output_token_logprobs"]),
            "finish": _finish(reply), "has_version": "weight_version" in meta}


async def probe_abort_request(session, url: str) -> dict[str, Any]:
    """``/abort_request`` by rid: the request answers 200 with its partial output and
    ``finish_reason.type == "abort"`` (tokenizer_manager ``_handle_abort_finish_reason``)."""
    task = asyncio.create_task(_call(session, "POST", url + "/generate", _body(LONG, rid="fidelity-abort")))
    await _wait_running(session, url, 1)
    abort_status, _ = await _call(session, "POST", url + "/abort_request", {"rid": "fidelity-abort"})
    status, reply = await task
    return {"abort_status": abort_status, "status": status, "finish": _finish(reply),
            "partial": 0 < len(reply["output_ids"]) < LONG}


async def probe_pause_abort(session, url: str) -> dict[str, Any]:
    """``/pause_generation {"mode": "abort"}``: running requests answer 200 at once with
    their partial output (finish ``abort``); a request sent while paused waits
    (``is_pause_cond``, tokenizer_manager); ``/health`` generates, so while paused it waits
    ``SGLANG_HEALTH_CHECK_TIMEOUT`` and answers 503 (http_server.py ``health_generate``);
    ``/model_info`` answers at once; after ``/continue_generation`` the waiting request runs."""
    running = [asyncio.create_task(_call(session, "POST", url + "/generate", _body(LONG))) for _ in range(2)]
    await _wait_running(session, url, 2)
    pause_status, _ = await _call(session, "POST", url + "/pause_generation", {"mode": "abort"})
    try:
        aborted = await asyncio.gather(*running)
        late = asyncio.create_task(_call(session, "POST", url + "/generate", _body(8)))
        await asyncio.sleep(1.5)
        waited = not late.done()
        t = time.monotonic()
        info_status, _ = await _call(session, "GET", url + "/model_info")
        info_s = time.monotonic() - t
        t = time.monotonic()
        health_status, _ = await _call(session, "GET", url + "/health")
        health_s = time.monotonic() - t
    finally:
        continue_status, _ = await _call(session, "POST", url + "/continue_generation", {})
    late_status, late_reply = await late
    return {"pause": pause_status, "aborted": [(s, _finish(r), 0 < len(r["output_ids"]) < LONG) for s, r in aborted],
            "new_request_waits": waited, "model_info_while_paused": (info_status, info_s < 1.0),
            "health_while_paused": (health_status, health_s >= float(HEALTH_TIMEOUT_S) - 0.5),
            "continue": continue_status, "late": (late_status, _finish(late_reply))}


async def probe_update_outside_session(session, url: str) -> dict[str, Any]:
    """``/update_weights_from_distributed`` outside ``/begin_weight_update`` …
    ``/end_weight_update`` is refused (0.5.21+: scheduler_components/weight_updater.py),
    before any broadcast is awaited."""
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}
    status, reply = await asyncio.wait_for(_call(session, "POST", url + "/update_weights_from_distributed", body), 60)
    return {"status": status, "success": reply.get("success") if isinstance(reply, dict) else None}


async def probe_keep_pause_flush(session, url: str, model: str, mode: str) -> dict[str, Any]:
    """Under a ``retract`` or ``in_place`` pause the request stays on the server (retracted
    to the waiting queue, or running with its KV), so the cache flush an update asks for by
    default is refused (400, weight_updater.py:120 and scheduler.py ``flush_cache``), and
    ``flush_cache: false`` succeeds; the request then finishes, never interrupted."""
    task = asyncio.create_task(_call(session, "POST", url + "/generate", _body(LONG)))
    await _wait_running(session, url, 1)
    pause_status, _ = await _call(session, "POST", url + "/pause_generation", {"mode": mode})
    try:
        flush, _ = await _call(session, "POST", url + "/update_weights_from_disk", {"model_path": model})
        no_flush, _ = await _call(session, "POST", url + "/update_weights_from_disk",
                                  {"model_path": model, "flush_cache": False})
    finally:
        await _call(session, "POST", url + "/continue_generation", {})
    status, reply = await task
    return {"pause": pause_status, "flush_cache_default": flush, "flush_cache_false": no_flush,
            "request": (status, _finish(reply), len(reply["output_ids"]))}


PROBES = ["generate", "abort_request", "pause_abort", "update_outside_session", "retract_flush", "in_place_flush"]


@pytest.mark.parametrize("probe", PROBES)
def test_embedded_server_behaves_as_sglang(servers, probe: str) -> None:
    import aiohttp

    async def run(url: str) -> dict[str, Any]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            if probe.endswith("_flush"):
                _, info = await _call(session, "GET", url + "/model_info")
                return await probe_keep_pause_flush(session, url, info["model_path"], probe.removesuffix("_flush"))
            return await globals()[f"probe_{probe}"](session, url)

    seen = {name: asyncio.run(run(url)) for name, url in servers.items()}
    print(f"\n{probe:<24} SGLang: {seen['sglang']}\n{'':<24} embedded: {seen['embedded']}")
    assert seen["sglang"] == seen["embedded"]

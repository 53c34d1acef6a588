"""AReaL 1.0.4's SGLang client against the embedded server, request bodies byte for byte.

AReaL (``pip download --no-deps areal==1.0.4``; not a dependency, nothing of it is
committed) talks to SGLang from ``areal/engine/sglang_remote.py``: ``SGLangBackend``
builds each request (``build_generation_request``, ``get_pause_request``,
``get_resume_request``, ``build_disk_weight_update_requests``,
``build_init_weights_group_request``, ``build_distributed_weight_update_requests``) and
``areal/infra/utils/http.py: arequest_with_retry`` sends it with aiohttp's
``session.post(url, json=payload)``, i.e. ``json.dumps(payload)`` with aiohttp's default
serializer. The bodies below are written from that source (the values are AReaL's
``GenerationHyperparameters`` defaults) and sent the same way, so the bytes on the wire are
AReaL's; replies are read the way ``SGLangBackend.parse_generation_response`` reads them.

AReaL 1.0.4 pins SGLang 0.5.10.post1, which had no weight-update session: its
``/update_weights_from_distributed`` without ``/begin_weight_update`` is refused here
exactly as SGLang 0.5.23 refuses it (the test checks that refusal, and the same body
inside a session).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp

import aiohttp
import pytest
import torch

from realscale.parallel.net import free_port


def generation_body(input_ids: list[int], max_new_tokens: int, eos: int) -> dict:
    """``SGLangBackend.build_generation_request`` for a text prompt with AReaL's defaults
    (top_p 1.0, top_k int(1e8), temperature 1.0, no stop strings, eos in stop_token_ids)."""
    return {
        "input_ids": list(input_ids),
        "image_data": None,
        "sampling_params": {"top_p": 1.0, "top_k": int(1e8), "max_new_tokens": max_new_tokens,
                            "temperature": 1.0, "stop_token_ids": [eos], "ignore_eos": False,
                            "skip_special_tokens": True, "frequency_penalty": 0.0},
        "return_logprob": True,
        "stream": False,
    }


def parse_generation(reply: dict) -> tuple[list[int], list[float], str]:
    """``SGLangBackend.parse_generation_response``."""
    meta = reply["meta_info"]
    stop_reason = meta["finish_reason"]["type"]
    if stop_reason == "abort" and meta["finish_reason"].get("message", "").startswith("Abort before prefill"):
        return [], [], stop_reason
    return ([x[1] for x in meta["output_token_logprobs"]], [x[0] for x in meta["output_token_logprobs"]],
            stop_reason)


async def _post(session: aiohttp.ClientSession, url: str, path: str, payload: dict) -> tuple[int, object]:
    async with session.post(url + path, json=payload) as resp:  # arequest_with_retry's call
        raw = await resp.read()
        return resp.status, (json.loads(raw) if resp.content_type == "application/json" else raw.decode())


def test_areal_generation_with_interruption(tiny_server) -> None:
    """AReaL's generate loop: pause mid-answer, resume, resubmit prompt + output; every
    reply parses, and the stitched answer has one log-prob per token."""
    url, server = tiny_server
    eos = int(server.tokenizer.eos_token_id)
    prompt, budget = [7, 8, 9], 200

    async def areal() -> tuple[list[int], list[float], list[str]]:
        async with aiohttp.ClientSession() as session:
            tokens: list[int] = []
            logprobs: list[float] = []
            reasons: list[str] = []
            first = asyncio.create_task(_post(session, url, "/generate", generation_body(prompt, budget, eos)))
            while not first.done() and server.engine.stats()["num_running_reqs"] < 1:  # pause mid-answer
                await asyncio.sleep(0.002)
            assert (await _post(session, url, "/pause_generation", {}))[0] == 200  # get_pause_request
            status, reply = await first
            assert status == 200
            while True:
                out, lps, reason = parse_generation(reply)
                tokens, logprobs, reasons = tokens + out, logprobs + lps, reasons + [reason]
                if reason in ("stop", "tool_calls", "length") or len(tokens) >= budget:
                    break
                if len(reasons) == 1:
                    assert (await _post(session, url, "/continue_generation", {}))[0] == 200  # get_resume_request
                status, reply = await _post(session, url, "/generate",
                                            generation_body(prompt + tokens, budget - len(tokens), eos))
                assert status == 200, reply
            return tokens, logprobs, reasons

    tokens, logprobs, reasons = asyncio.run(areal())
    assert reasons[0] == "abort" and reasons[-1] in ("stop", "length")
    assert len(tokens) == len(logprobs) and all(lp <= 0.0 for lp in logprobs)
    assert 0 < len(tokens) <= budget


def test_areal_disk_update(tiny_server) -> None:
    """``build_disk_weight_update_requests``: model_path + abort_all_requests."""
    url, server = tiny_server

    async def areal() -> tuple[int, object]:
        async with aiohttp.ClientSession() as session:
            return await _post(session, url, "/update_weights_from_disk",
                               {"model_path": str(server.model_path), "abort_all_requests": True})

    status, reply = asyncio.run(areal())
    assert status == 200 and reply["success"] is True


def _trainer(port: int, shape: list[int], conn) -> None:
    """The trainer side of AReaL's weight group (rank 0 of 2), our sender."""
    try:
        from realscale.inference.weight_sync import WeightSender

        torch.set_num_threads(1)
        sender = WeightSender("127.0.0.1", port, world_size=2, group_name="update_weight_group", backend="gloo")
        sender.connect(timeout_s=60)
        sent = sender.broadcast_bucket([("model.norm.weight", torch.full(shape, 0.25))])
        sender.close()
        conn.send(("ok", sent))
    except BaseException as exc:  # noqa: BLE001 - report to the test
        conn.send(("error", repr(exc)))


@pytest.mark.multiproc
def test_areal_weight_group_bodies(tiny_server) -> None:
    """``build_init_weights_group_request`` (its ``master_port`` is a string) joins the group;
    ``build_distributed_weight_update_requests``' body is refused outside a session, as the
    pinned SGLang refuses it, and loads the broadcast inside one."""
    url, server = tiny_server
    norm = server.ranks.worker.weights.tensors()["decoder.final_layernorm.weight"]  # a view of the flat buffer
    before = norm.detach().clone()
    shape = list(before.shape)
    port = free_port()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_trainer, args=(port, shape, child))
    proc.start()
    update = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [shape],
              "group_name": "update_weight_group", "abort_all_requests": True}

    async def areal() -> list[tuple[int, object]]:
        async with aiohttp.ClientSession() as session:
            joined = await _post(session, url, "/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": str(port), "rank_offset": 1, "world_size": 2,
                "backend": "gloo", "group_name": "update_weight_group"})
            return [joined, await _post(session, url, "/update_weights_from_distributed", update),
                    await _post(session, url, "/begin_weight_update", {}),
                    await _post(session, url, "/update_weights_from_distributed", update),
                    await _post(session, url, "/end_weight_update", {}),
                    await _post(session, url, "/destroy_weights_update_group", {"group_name": "update_weight_group"})]

    try:
        replies = asyncio.run(areal())
        assert parent.poll(120), "trainer process did not finish"
        status, sent = parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    assert status == "ok", sent
    joined, outside, begun, inside, ended, destroyed = replies
    assert joined[0] == 200 and joined[1]["success"] is True
    assert outside[0] == 400 and "begin_weight_update()" in outside[1]["message"]
    assert begun[0] == inside[0] == ended[0] == destroyed[0] == 200, replies
    assert torch.equal(norm, torch.full(shape, 0.25))
    server.engine.call(lambda: norm.copy_(before)).result(60)  # tiny_server is shared

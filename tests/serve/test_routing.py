"""Routed experts for routing replay: the embedded server reports, per fed position, the
experts every layer of a Qwen3-MoE routed it to, in SGLang's wire format
(``meta_info["routed_experts"]``: base64 int32 ``(positions, layers, top_k)`` over positions
``[routed_experts_start_len, seqlen - 1)``; pinned SGLang 0.5.23
``srt/managers/io_struct.py:264-268``, ``srt/managers/tokenizer_manager.py:2602-2609``), and
the client stitches them across interruptions, each position's routing from the forward
that first computed it. The reference is transformers' own ``Qwen3MoeForCausalLM``
(``output_router_logits``), under the weights of each position's version."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest
import torch

from server_waits import wait_running
from realscale.inference.client import InferenceClient
from realscale.inference.dialect import decode_routed_experts
from realscale.models.tiny import build_tiny_model, resolve_model_path
from realscale.serve.server import EmbeddedServer, start_in_thread

LAYERS, TOPK = 2, 2  # the tiny Qwen3-MoE (realscale/models/tiny.py: TINY_MOE)


@pytest.fixture()
def server(tmp_path):
    srv = EmbeddedServer("tiny-qwen3-moe", max_running=8, context_length=512)
    url, stop = start_in_thread(srv)
    yield url, srv, build_tiny_model(str(tmp_path / "v1"), family="qwen3_moe", seed=1)
    stop()


def hf_routing(model_dir: str, ids: list[int]) -> np.ndarray:
    """``[positions, layers, top_k]``: the experts transformers' Qwen3-MoE routes each position to."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    return torch.stack([logits.view(len(ids), -1).topk(TOPK, dim=-1).indices for logits in out.router_logits],
                       dim=1).numpy()


def _same_experts(got: np.ndarray, want: np.ndarray) -> bool:
    return np.array_equal(np.sort(got, axis=-1), np.sort(want, axis=-1))


async def _post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
        return r.status, await r.json(content_type=None)


def test_the_server_reports_every_fed_position_as_transformers_routes_it(server) -> None:
    url, srv, _ = server
    prompt = [5, 9, 11, 40, 2, 77, 13]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True},
            "return_routed_experts": True}
    status, reply = asyncio.run(_post(url, body))
    assert status == 200, reply
    out = reply["output_ids"]
    rows = decode_routed_experts(reply["meta_info"]["routed_experts"]).reshape(-1, LAYERS, TOPK)
    assert rows.shape[0] == len(prompt) + len(out) - 1  # the last sampled token is never fed
    assert _same_experts(rows, hf_routing(srv.model_path, prompt + out[:-1]))
    status, tail = asyncio.run(_post(url, {**body, "routed_experts_start_len": 4, "sampling_params": {
        "max_new_tokens": 5, "temperature": 0.0}}))
    assert status == 200
    tail_rows = decode_routed_experts(tail["meta_info"]["routed_experts"]).reshape(-1, LAYERS, TOPK)
    full = hf_routing(srv.model_path, prompt + tail["output_ids"][:-1])
    assert tail_rows.shape[0] == len(prompt) + 5 - 1 - 4 and _same_experts(tail_rows, full[4:])
    for bad, why in (({"routed_experts_start_len": len(prompt) + 1}, "past the prompt"),
                     ({"routed_experts_start_len": -1}, "integer >= 0"),
                     ({"return_routed_experts": "yes"}, "return_routed_experts")):
        status, reply = asyncio.run(_post(url, {**body, **bad}))
        assert status == 400 and why in str(reply), reply
    plain = asyncio.run(_post(url, {k: v for k, v in body.items() if k != "return_routed_experts"}))[1]
    assert "routed_experts" not in plain["meta_info"]


def test_a_dense_server_refuses_to_report_routing() -> None:
    srv = EmbeddedServer(resolve_model_path("tiny-qwen2"), max_running=2, context_length=64)
    url, stop = start_in_thread(srv)
    try:
        status, reply = asyncio.run(_post(url, {"input_ids": [3, 4], "return_routed_experts": True}))
    finally:
        stop()
    assert status == 400 and "no experts" in str(reply)


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_routing_is_stitched_across_a_weight_update(server, mode: str) -> None:
    """Positions computed before the update keep the old weights' routing, the rest the new
    weights' (abort: the client's continuation asks from the first position it lacks;
    retract: the server's re-prefill keeps the positions it holds)."""
    url, srv, new_dir = server
    prompts = [[i + 3, 7, 9, 30 + i] for i in range(4)]

    async def main():
        async with InferenceClient([url], routed_experts=True) as client, aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(client.generate(p, {"max_new_tokens": 200, "temperature": 0.9,
                                                             "ignore_eos": True})) for p in prompts]
            await wait_running(s, url, len(prompts))
            await asyncio.sleep(0.05)
            await client.pause(mode)
            await client.update_weights_from_disk(new_dir, weight_version=1)
            await client.resume()
            return await asyncio.gather(*tasks)

    for prompt, res in zip(prompts, asyncio.run(main())):
        seq = prompt + res.output_ids
        rows = res.routed_experts.reshape(-1, LAYERS, TOPK)
        assert rows.shape[0] == len(seq) - 1
        switch = res.output_versions.index(1)  # the first token sampled under the new weights
        first_new = len(prompt) + switch - 1  # the position whose forward sampled it
        old, new = hf_routing(srv.model_path, seq[:-1]), hf_routing(new_dir, seq[:-1])
        assert _same_experts(rows[:first_new], old[:first_new]), mode
        assert _same_experts(rows[first_new:], new[first_new:]), mode
        assert not _same_experts(old[first_new:], new[first_new:])  # the update changed the routing

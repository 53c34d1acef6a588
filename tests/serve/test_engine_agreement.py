"""Behaviour log-probs from the embedded server equal the Megatron trainer's log-probs on
the same tokens and weights (fp32): decoupled PPO compares exactly these two."""

from __future__ import annotations

import concurrent.futures

import pytest
import requests

import engine_agreement_cases as cases
from realscale.parallel.spawn import run_distributed

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_server_and_engine_logprobs_agree(tiny_server, temperature: float) -> None:
    url, server = tiny_server
    prompts = [[3, 4, 5], list(range(10, 40)), [7, 8]]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # concurrent: batched decode
        replies = list(pool.map(lambda p: requests.post(url + "/generate", json={
            "input_ids": p, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 20, "temperature": temperature, "ignore_eos": True}},
            timeout=120).json(), prompts))
    seqs = [p + r["output_ids"] for p, r in zip(prompts, replies)]
    got = run_distributed(cases.engine_logprobs, 1, server.model_path, seqs, temperature, timeout=300)[0]
    for prompt, reply, lp in zip(prompts, replies, got):
        served = [e[0] for e in reply["meta_info"]["output_token_logprobs"]]
        trained = lp[len(prompt):].tolist()
        assert len(served) == len(trained) == 20
        assert max(abs(a - b) for a, b in zip(served, trained)) < 1e-4

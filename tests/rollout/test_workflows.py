"""Workflows against a real embedded server; reward calls; the calculator environment."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from realscale.config import RewardConfig
from realscale.data.dataset import PromptDataset, PromptSample
from realscale.inference.client import InferenceClient
from realscale.reward.result import RewardResult
from realscale.rollout.rewards import call_reward, close_reward_pools, gym_answer, reward_fn_for
from realscale.rollout.workflows import CalculatorEnv, MultiTurnWorkflow, SingleTurnWorkflow, safe_eval
from realscale.data.tokens import prompt_ids

SAMPLE = PromptSample(prompt="What is 2 + 3?", answer="5", uid="t:1")
PARAMS = {"max_new_tokens": 8, "temperature": 1.0}


def _episode(url: str, workflow, sample: PromptSample = SAMPLE):
    async def main():
        async with InferenceClient([url]) as client:
            return await workflow.run_episode(client, sample)

    return asyncio.run(main())


# --------------------------------------------------------------------------- rewards


def _sleep_3s(prompt: str, completion: str, sample: PromptSample) -> float:
    time.sleep(3.0)
    return 1.0


async def _sleep_forever(prompt: str, completion: str, sample: PromptSample) -> float:
    await asyncio.sleep(3600)
    return 1.0


def _boom(prompt: str, completion: str, sample: PromptSample) -> float:
    raise RuntimeError("checker crashed")


@pytest.mark.parametrize("fn", [_sleep_3s, _sleep_forever])
def test_hanging_reward_times_out(fn) -> None:
    t0 = time.monotonic()
    result = asyncio.run(call_reward(fn, "p", "c", SAMPLE, timeout=0.3))
    assert result == RewardResult(0.0, "timeout", result.detail)
    assert time.monotonic() - t0 < 1.5  # never waits for the hung call


def test_reward_errors_and_values() -> None:
    assert asyncio.run(call_reward(_boom, "p", "c", SAMPLE, timeout=5)).reason == "error"
    assert asyncio.run(call_reward(lambda p, c, s: 0.5, "p", "c", SAMPLE, timeout=5)) == RewardResult(0.5)
    bad = asyncio.run(call_reward(lambda p, c, s: "yes", "p", "c", SAMPLE, timeout=5))
    assert bad.reason == "error" and "float or RewardResult" in bad.detail


def test_reward_fn_for_math_and_gym() -> None:
    cfg = RewardConfig(workers=1, timeout=5.0)
    try:
        math = reward_fn_for(cfg, SAMPLE)
        assert asyncio.run(call_reward(math, "", "so the answer is \\boxed{5}", SAMPLE, timeout=30)).value == 1.0
        assert asyncio.run(call_reward(math, "", "\\boxed{6}", SAMPLE, timeout=30)).value == 0.0
    finally:
        close_reward_pools()
    gym = PromptDataset("gym:basic_arithmetic", size=2, seed=0).samples[0]
    fn = reward_fn_for(cfg, gym)
    right = asyncio.run(call_reward(fn, "", f"<answer>{gym.answer}</answer>", gym, timeout=30))
    wrong = asyncio.run(call_reward(fn, "", "<answer>not a number</answer>", gym, timeout=30))
    assert (right.value, wrong.value) == (1.0, 0.0)
    assert gym_answer("x <answer>1</answer> y <answer> 2 </answer>") == "2"
    with pytest.raises(ValueError, match="neither an answer nor tests"):
        reward_fn_for(cfg, PromptSample(prompt="p", uid="x"))


# --------------------------------------------------------------------------- single turn


def test_single_turn_group(server, tokenizer) -> None:
    url, _ = server
    seen: list[str] = []

    def reward(prompt: str, completion: str, sample: PromptSample) -> float:
        seen.append(completion)
        return float(len(completion) % 2)

    wf = SingleTurnWorkflow(tokenizer, 3, PARAMS, reward)
    group = _episode(url, wf)
    ids = prompt_ids(tokenizer, SAMPLE.prompt)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    assert len(group) == 3 and sorted(seen) == sorted(t.completion_text for t in group)
    for t in group:
        assert t.prompt_ids == ids and t.group_id == "t:1"
        assert 1 <= len(t.output_ids) <= 8 and t.loss_mask == [1] * len(t.output_ids)
        assert all(lp <= 0 for lp in t.output_logprobs) and set(t.output_versions) == {0}
        assert t.completion_text == tokenizer.decode(t.output_ids, skip_special_tokens=True)
        assert t.reward == float(len(t.completion_text) % 2) and t.reward_reason == "ok"


def test_single_turn_hanging_reward_scores_zero(server, tokenizer) -> None:
    url, _ = server
    wf = SingleTurnWorkflow(tokenizer, 2, PARAMS, _sleep_3s, reward_timeout=0.3)
    t0 = time.monotonic()
    group = _episode(url, wf)
    assert time.monotonic() - t0 < 2.5
    assert [(t.reward, t.reward_reason) for t in group] == [(0.0, "timeout")] * 2


# --------------------------------------------------------------------------- multi turn


def test_calculator_env() -> None:
    env = CalculatorEnv(SAMPLE)
    step = env.step("let me compute <calc>(2 + 3) * 4 - 2**3</calc>")
    assert (step.observation, step.done) == ("<result>12</result>", False)
    assert env.step("<calc>1/0</calc>").observation.startswith("<error>ZeroDivisionError")
    assert env.step("<calc>__import__('os')</calc>").observation.startswith("<error>ValueError")
    assert env.step("hmm").observation == CalculatorEnv.REMINDER
    assert env.reward().reason == "no_answer"
    assert env.step("<answer>5.0</answer>").done
    assert env.reward() == RewardResult(1.0)
    assert safe_eval("7 // 2 + -1") == 2
    with pytest.raises(ValueError, match="exponent"):
        safe_eval("9 ** 999999")


def test_multi_turn_loss_mask_and_context(server, tokenizer) -> None:
    """Observation tokens are masked out with log-prob 0; model tokens carry the log-probs of
    the model given the *whole* context, observations included (so they really were there)."""
    url, srv = server
    wf = MultiTurnWorkflow(tokenizer, 2, PARAMS, CalculatorEnv, max_turns=3)
    group = _episode(url, wf)
    obs = wf.observation_ids(CalculatorEnv.REMINDER)
    from transformers import AutoModelForCausalLM

    from realscale.algo.sampling import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(srv.model_path).eval()
    for t in group:
        # the random tiny model never writes <answer>: three turns, two reminders between them
        assert t.num_turns == 3 and t.reward_reason == "no_answer"
        mask = t.loss_mask
        runs = _runs(mask)
        assert [m for m, _, _ in runs] == [1, 0, 1, 0, 1]
        for m, start, end in runs:
            if m == 0:
                assert t.output_ids[start:end] == obs
                assert t.output_logprobs[start:end] == [0.0] * (end - start)
            else:
                assert 1 <= end - start <= 8
        seq = torch.tensor([t.prompt_ids + t.output_ids])
        with torch.no_grad():
            logits = model(seq).logits[0, len(t.prompt_ids) - 1:-1]
        ref = token_logprobs(logits, torch.tensor(t.output_ids), 1.0)
        idx = [i for i, m in enumerate(mask) if m]
        assert (ref[idx] - torch.tensor(t.output_logprobs)[idx]).abs().max().item() < 1e-4
        assert set(t.output_versions) == {0}


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out

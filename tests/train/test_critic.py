"""The critic of PPO with GAE: token rewards, value loss that falls on a task with
per-token structure, and one trainer rank equal to two (DP=2, TP=2, PP=2; shares delivered
by the batch scatter) for the critic and for the actor trained on its advantages
(normalised over the global batch)."""

from __future__ import annotations

import pytest
import torch

import trainer_cases as cases
from realscale.models.tiny import resolve_model_path
from realscale.parallel.spawn import run_distributed
from realscale.train.critic import token_rewards


def test_token_rewards_sit_on_the_last_trained_token() -> None:
    mask = torch.tensor([0, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0])  # seq 2 ends with a tool output; seq 3 trains nothing
    cu = torch.tensor([0, 3, 9, 11])
    assert token_rewards(mask, cu, [1.0, 0.5, 2.0]).tolist() == [0, 0, 1.0, 0, 0, 0, 0, 0.5, 0, 0, 0]


@pytest.mark.multiproc
@pytest.mark.e2e  # heavy (~30 s): CI runs it in the e2e tier, keeping the default tier under 15 minutes
@pytest.mark.timeout(900)  # four spawned runs of actor + critic
def test_value_loss_falls_and_two_ranks_match_one() -> None:
    model = resolve_model_path("tiny-qwen2")
    one = run_distributed(cases.critic_steps, 1, model, 1, 1, 6, timeout=600)[0]
    losses = one["losses"]
    # the reward is decided by one token, so values after it can be exact: the loss falls
    assert losses[-1] < 0.75 * losses[0], losses
    # GAE with lambda = gamma = 1 and a zero-initialised head: the return of every trained
    # token is the answer's reward, and advantage = return - value = the reward at first
    cu, mask = one["cu_seqlens"].tolist(), one["loss_mask"].bool()
    for i in range(len(cu) - 1):
        r = float(one["rewards"][cu[i]:cu[i + 1]].sum())
        seg = slice(cu[i], cu[i + 1])
        assert torch.allclose(one["returns"][seg][mask[seg]], torch.tensor(r))
        assert torch.allclose(one["advantages"][seg][mask[seg]], torch.tensor(r))
    # each rank fed by the batch scatter; pp=2: every stage gets the token rewards (GAE runs
    # on every rank), no stage gets the placeholder advantages
    for tp, dp, pp in ((1, 2, 1), (2, 1, 1), (1, 1, 2)):
        two = run_distributed(cases.critic_steps, 2, model, tp, dp, 1, 1.0, 1e-3, pp, timeout=600)[0]
        assert abs(two["losses"][0] - losses[0]) <= 1e-4 * abs(losses[0]), (tp, dp, pp)
        assert torch.allclose(one["values"][0], two["values"][0], atol=1e-4, rtol=0), (tp, dp, pp)
        # the actor trained on the same advantages (normalised over the global batch: an
        # all-reduce across DP ranks): the same policy
        assert torch.allclose(one["policy"][0], two["policy"][0], atol=1e-4, rtol=0), (tp, dp, pp)

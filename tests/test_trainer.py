"""The RL loop's step: one trainer rank vs two (DP=2, TP=2, PP=2) on the same rollout
batch, each rank fed by the batch scatter, and the loop's batch building."""

from __future__ import annotations

import pytest
import torch

import trainer_cases as cases
from realscale.models.tiny import resolve_model_path
from realscale.parallel.spawn import run_distributed


@pytest.mark.multiproc
@pytest.mark.e2e  # heavy (~26 s, four spawned runs): CI's e2e tier, keeping the default tier under 15 minutes
def test_rl_step_on_two_ranks_matches_one() -> None:
    model = resolve_model_path("tiny-qwen2")
    one = run_distributed(cases.one_rl_step, 1, model, 1, 1, timeout=300)[0]
    assert one["stats"]["train/grad_norm"] > 0
    # the update moves the policy the right way: answers with positive advantage become
    # more likely, those with negative advantage less likely
    cu, mask = one["cu_seqlens"].tolist(), one["loss_mask"]
    delta = (one["after"] - one["before"]) * mask
    ups = [float(delta[cu[i]:cu[i + 1]].sum()) for i in range(len(cu) - 1)]
    adv = [float(one["advantages"][cu[i]]) for i in range(len(cu) - 1)]
    assert sum(u for u, a in zip(ups, adv) if a > 0) > 0
    assert sum(u for u, a in zip(ups, adv) if a < 0) < 0
    # pp=2: the first stage gets no loss fields, the last every one (trainer.stage_needs)
    for tp, dp, pp in ((1, 2, 1), (2, 1, 1), (1, 1, 2)):
        two = run_distributed(cases.one_rl_step, 2, model, tp, dp, pp, timeout=300)[0]
        for key in ("train/loss", "train/grad_norm"):
            # the reported step is the second mini-batch, after one Adam update: Adam's
            # per-element normalisation turns fp32 reduction-order noise of the first
            # step into ~1e-5 relative differences (a wrong share or scale is O(1))
            a, b = one["stats"][key], two["stats"][key]
            assert abs(a - b) <= 1e-4 * abs(a), (tp, dp, pp, key, a, b)
        assert torch.allclose(one["after"], two["after"], atol=1e-4, rtol=0), (tp, dp, pp)


def test_groups_to_batch_masks_prompts_and_broadcasts_advantages() -> None:
    from realscale.config import AlgoConfig
    from realscale.data.groups import Group, Trajectory
    from realscale.train.actor import groups_to_batch

    def traj(reward: float, out: list[int], mask: list[int]) -> Trajectory:
        return Trajectory(prompt_ids=[1, 2], output_ids=out, output_logprobs=[-0.5] * len(out),
                          output_versions=[3] * len(out), loss_mask=mask, reward=reward, group_id="g")

    groups = [Group([traj(1.0, [5, 6], [1, 1]), traj(0.0, [7], [1])], uid="g"),
              Group([traj(1.0, [8, 9, 4], [1, 0, 1]), traj(1.0, [3], [1])], uid="h")]
    batch, stats = groups_to_batch(groups, AlgoConfig(group_std_norm=False))
    assert batch.cu_seqlens.tolist() == [0, 4, 7, 12, 15]
    assert batch.fields["loss_mask"].tolist() == [0, 0, 1, 1, 0, 0, 1, 0, 0, 1, 0, 1, 0, 0, 1]
    # GRPO without std: reward minus the group mean, on every token of the sequence
    assert batch.fields["advantages"][:4].tolist() == [0.5] * 4
    assert batch.fields["advantages"][4:7].tolist() == [-0.5] * 3
    assert batch.fields["advantages"][7:].abs().sum() == 0  # equal rewards: no signal
    assert batch.fields["behav_logprobs"][:2].tolist() == [0.0, 0.0]
    assert stats["reward/mean"] == 0.75 and stats["rollout/response_len"] == 1.75


def test_recipe_takes_the_trainer_layout_from_a_plan(tmp_path) -> None:
    import subprocess
    import sys

    from realscale.config import ConfigError, load_config
    from realscale.planner.apply import apply_plan

    out = tmp_path / "plan.yaml"
    res = subprocess.run([sys.executable, "-m", "realscale", "plan", "--model", "qwen2-7b", "--nodes", "2",
                          "--gpus-per-node", "8", "--gpu", "H100", "--mode", "disaggregated", "--no-ref",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    from realscale.planner.plan import Plan

    roles = Plan.load(str(out)).roles
    want, gen = roles["actor_train"].strategy, roles["actor_gen"].strategy
    cfg = apply_plan(load_config(None, [f"parallel.plan={out}", "model.path=models/not-downloaded",
                                        "launch.model_size=qwen2-7b"]))
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp) == (want.dp, want.tp, want.pp)
    assert (cfg.generate.num_servers, cfg.generate.tp) == (gen.dp, gen.tp)
    with pytest.raises(ConfigError, match="file not found"):
        apply_plan(load_config(None, ["parallel.plan=/no/plan.yaml"]))


@pytest.mark.multiproc
@pytest.mark.parametrize("mini_batches", [1, 2])
def test_first_mini_batch_takes_its_proximal_logprobs_from_its_training_forward(mini_batches: int) -> None:
    """No forward pass of its own for the first mini-batch's proximal log-probs (the weights
    that train it are the proximal policy): the update, its statistics and the proximal
    log-probs left on the shares equal the long way's, and one forward fewer ran."""
    out = run_distributed(cases.first_share_shortcut, 1, resolve_model_path("tiny-qwen2"), mini_batches,
                          timeout=300)[0]
    assert out["shares"] == mini_batches
    assert len(out["forwards"]) == mini_batches - 1  # the long way: one per mini-batch
    for mine, theirs in zip(out["prox"], out["ref_prox"]):
        assert torch.allclose(mine, theirs, atol=1e-6, rtol=0)
    assert torch.allclose(out["after"], out["ref_after"], atol=1e-5, rtol=0)
    assert out["stats"]["train/grad_norm"] > 0
    for key in ("train/loss", "train/grad_norm", "train/pg_loss", "actor/behav_prox_gap", "actor/behav_prox_gap_max"):
        a, b = out["stats"][key], out["ref_stats"][key]
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (key, a, b)

"""The torch-free packing (realscale/data/raw_batch.py) and rank 0's conversion
(realscale/train/actor.py: raw_to_batch): together they give, bit for bit, the batch and
statistics the one-process ``groups_to_batch`` gave before the split (written out below
as it was, per sequence in torch), for every advantage estimator and routing replay."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from realscale.config import AlgoConfig
from realscale.data.groups import Group, Trajectory
from realscale.data.raw_batch import pack_raw
from realscale.rollout.process import pack_groups, pack_groups_raw
from realscale.train.actor import group_advantages, groups_to_batch, raw_to_batch
from realscale.train.critic import token_rewards

WIDTH = 6  # layers * top_k of the routed experts


DYADIC = (0.0, 1.0, 0.5, 0.25)  # binary fractions: every float32 sum of a few of them is exact
ODD = (0.0, 1.0, 0.3, 0.7, 0.55)


def _groups(seed: int = 0, routed: bool = False, rewards: tuple[float, ...] = ODD) -> list[Group]:
    """Groups of unequal sizes and lengths: multi-turn masks, logprobs that round to
    float32, rewards drawn from ``rewards``, interruptions and turns; with ``routed`` the
    experts of every fed position, int32 (positions, layers, top_k) or a flat int64 array."""
    rng = random.Random(seed)
    groups = []
    for g, size in enumerate((4, 3, 4, 1)):
        trajs = []
        for j in range(size):
            n_p, n_o = rng.randint(2, 6), rng.randint(0 if j else 1, 9)
            mask = [int(rng.random() < 0.8) for _ in range(n_o)]
            t = Trajectory(prompt_ids=[rng.randrange(1000) for _ in range(n_p)],
                           output_ids=[rng.randrange(1000) for _ in range(n_o)],
                           output_logprobs=[-rng.random() * 3 if m else 0.0 for m in mask],
                           output_versions=[rng.randint(0, 3) for _ in range(n_o)], loss_mask=mask,
                           reward=rng.choice(rewards), group_id=f"p{g}",
                           num_turns=rng.randint(1, 3), num_interruptions=rng.randint(0, 2))
            if routed:
                experts = np.array([rng.randrange(64) for _ in range((n_p + n_o - 1) * WIDTH)])
                t.routed_experts = experts.astype(np.int32).reshape(-1, 2, 3) if j % 2 else experts  # int64, flat
            trajs.append(t)
        groups.append(Group(trajs, uid=f"p{g}", submit_version=g % 2))
    return groups


# ---------------------------------------------------------------------- before the split, as it was


def _old_routing_fields(trajs: list[Trajectory]) -> list[torch.Tensor]:
    widths = {t.routed_experts.size // (len(t.prompt_ids) + len(t.output_ids) - 1)
              for t in trajs if t.routed_experts is not None and t.routed_experts.size}
    assert len(widths) == 1
    width = widths.pop()
    out = []
    for t in trajs:
        rows = torch.as_tensor(t.routed_experts, dtype=torch.int32).view(-1, width)
        assert rows.shape[0] == len(t.prompt_ids) + len(t.output_ids) - 1
        out.append(torch.cat([rows, rows[-1:]]))
    return out


def _old_groups_to_batch(groups: list[Group], algo: AlgoConfig) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """groups_to_batch at fa7215c, per sequence in torch: (input_ids, cu_seqlens and the
    fields by name, in the batch's order), stats."""
    trajs = [t for g in groups for t in g]
    sizes = torch.tensor([len(g) for g in groups])
    cu_groups = torch.zeros(len(groups) + 1, dtype=torch.long)
    cu_groups[1:] = torch.cumsum(sizes, 0)
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    adv = group_advantages(rewards, cu_groups, algo)
    seqs, mask, behav, advs, versions = [], [], [], [], []
    for t, a in zip(trajs, adv.tolist()):
        n_p, n_o = len(t.prompt_ids), len(t.output_ids)
        seqs.append(torch.tensor(t.prompt_ids + t.output_ids, dtype=torch.long))
        mask.append(torch.tensor([0.0] * n_p + [float(m) for m in t.loss_mask]))
        behav.append(torch.tensor([0.0] * n_p + list(t.output_logprobs), dtype=torch.float32))
        advs.append(torch.full((n_p + n_o,), a, dtype=torch.float32))
        versions.append(torch.tensor([-1] * n_p + list(t.output_versions), dtype=torch.float32))
    fields = {"loss_mask": mask, "behav_logprobs": behav, "advantages": advs, "versions": versions}
    if algo.routing_replay:
        fields["routed_experts"] = _old_routing_fields(trajs)
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lens, 0)
    out = {"input_ids": torch.cat(seqs), "cu_seqlens": cu, **{k: torch.cat(v) for k, v in fields.items()}}
    if algo.adv_estimator == "gae":
        out["rewards"] = token_rewards(out["loss_mask"], cu, rewards.tolist())
    out_lens = torch.tensor([float(len(t.output_ids)) for t in trajs])
    stats = {"reward/mean": float(rewards.mean()), "reward/accuracy": float((rewards > 0.5).float().mean()),
             "rollout/response_len": float(out_lens.mean()), "rollout/response_len_max": float(out_lens.max()),
             "rollout/groups": float(len(groups)), "rollout/trajectories": float(len(trajs)),
             "rollout/interruptions": float(sum(t.num_interruptions for t in trajs)),
             "rollout/turns": sum(t.num_turns for t in trajs) / len(trajs)}
    return out, stats


def _assert_same(batch, want: dict[str, torch.Tensor]) -> None:
    got = {"input_ids": batch.input_ids, "cu_seqlens": batch.cu_seqlens, **batch.fields}
    assert list(got) == list(want)  # the fields, in the same order
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert torch.equal(got[key], value), key


ALGOS = {"grpo": AlgoConfig(), "grpo_no_std": AlgoConfig(group_std_norm=False),
         "loo": AlgoConfig(adv_estimator="loo"), "reinforce": AlgoConfig(adv_estimator="reinforce"),
         "gae": AlgoConfig(adv_estimator="gae"), "routing_replay": AlgoConfig(routing_replay=True),
         "gae_routing_replay": AlgoConfig(adv_estimator="gae", routing_replay=True)}


def _assert_stats(got: dict[str, float], want: dict[str, float], exact: bool) -> None:
    """Equal; with rewards whose float32 sum is inexact, ``reward/mean`` to one float32 step:
    torch summed in float32 (in an order that depends on the CPU's vector width), the
    numpy packing sums in float64 and rounds once."""
    if not exact:
        assert got["reward/mean"] == pytest.approx(want["reward/mean"], rel=1.2e-7, abs=0)
        got, want = {**got, "reward/mean": 0.0}, {**want, "reward/mean": 0.0}
    assert got == want


@pytest.mark.parametrize("name", list(ALGOS))
def test_the_two_steps_give_the_batch_groups_to_batch_gave(name: str) -> None:
    algo = ALGOS[name]
    for seed, rewards in [(s, r) for s in range(3) for r in (DYADIC, ODD)]:
        groups = _groups(seed, routed=algo.routing_replay, rewards=rewards)
        if algo.adv_estimator == "loo":  # leave-one-out needs two samples in every group
            groups = [g for g in groups if len(g) > 1]
        want, want_stats = _old_groups_to_batch(groups, algo)
        batch, stats = groups_to_batch(groups, algo)
        _assert_same(batch, want)
        _assert_stats(stats, want_stats, exact=rewards is DYADIC)
        rb = pack_groups(groups, algo, version=3)  # what LocalRollouts hands the trainer
        _assert_same(rb.batch, want)
        lags = [3 - g.min_version for g in groups]
        _assert_stats(rb.stats, {**want_stats, "staleness/mean": sum(lags) / len(lags),
                                 "staleness/max": float(max(lags)),
                                 "perf/trained_tokens": float(want["loss_mask"].sum())}, exact=rewards is DYADIC)
        assert rb.uids == [g.uid for g in groups]


def test_raw_arrays_and_hand_checked_advantages() -> None:
    def traj(reward: float, out: list[int], mask: list[int]) -> Trajectory:
        return Trajectory(prompt_ids=[1, 2], output_ids=out, output_logprobs=[-0.5] * len(out),
                          output_versions=[3] * len(out), loss_mask=mask, reward=reward, group_id="g")

    groups = [Group([traj(1.0, [5, 6], [1, 1]), traj(0.0, [7], [1]), traj(0.0, [4], [1])], uid="g"),
              Group([traj(1.0, [8, 9, 4], [1, 0, 1]), traj(1.0, [3], [1])], uid="h")]
    raw, _ = pack_raw(groups, AlgoConfig())
    assert {k: v.dtype for k, v in raw.arrays().items()} == {
        "input_ids": np.int64, "cu_seqlens": np.int64, "loss_mask": np.float32, "behav_logprobs": np.float32,
        "versions": np.float32, "rewards": np.float32, "cu_groups": np.int64}
    assert raw.routed_experts is None and raw.cu_groups.tolist() == [0, 3, 5]
    assert raw.cu_seqlens.tolist() == [0, 4, 7, 10, 15, 18]
    assert raw.input_ids[:10].tolist() == [1, 2, 5, 6, 1, 2, 7, 1, 2, 4]
    assert raw.versions[:4].tolist() == [-1, -1, 3, 3] and raw.behav_logprobs[:4].tolist() == [0, 0, -0.5, -0.5]
    assert raw.loss_mask[10:15].tolist() == [0, 0, 1, 0, 1]
    per_seq = {"loo": [1.0, -0.5, -0.5, 0.0, 0.0], "reinforce": [1.0, 0.0, 0.0, 1.0, 1.0],
               "gae": [0.0] * 5}
    for estimator, want in per_seq.items():
        batch = raw_to_batch(raw, AlgoConfig(adv_estimator=estimator))
        assert batch.fields["advantages"].tolist() == [a for a, n in zip(want, [4, 3, 3, 5, 3]) for _ in range(n)]
    gae = raw_to_batch(raw, AlgoConfig(adv_estimator="gae"))
    # the reward on each sequence's last trained token
    assert gae.fields["rewards"].nonzero().flatten().tolist() == [3, 14, 17]
    assert torch.from_numpy(raw.input_ids).data_ptr() == gae.input_ids.data_ptr()  # no copy


def test_routing_replay_refuses_what_it_did() -> None:
    algo = AlgoConfig(routing_replay=True)

    def traj(positions: int | None, width: int = WIDTH) -> Trajectory:  # 10 tokens: 9 positions fed
        t = Trajectory(prompt_ids=[1, 2, 3, 4], output_ids=[5] * 6, output_logprobs=[-0.5] * 6,
                       output_versions=[0] * 6, loss_mask=[1] * 6, group_id="p")
        t.routed_experts = None if positions is None else np.zeros(positions * width, dtype=np.int32)
        return t

    assert pack_raw([Group([traj(9), traj(9)])], algo)[0].routed_experts.shape == (20, WIDTH)
    with pytest.raises(ValueError, match=r"trajectory 'p' \(6 output tokens\) has no routed experts"):
        pack_raw([Group([traj(9), traj(None)])], algo)
    with pytest.raises(ValueError, match=r"trajectory 'p' has routing for 10 positions, expected 9 \(prompt"):
        pack_raw([Group([traj(9), traj(10)])], algo)
    with pytest.raises(ValueError, match=r"routings of different widths \(\[4, 6\] experts per position\)"):
        pack_raw([Group([traj(9), traj(9, width=4)])], algo)
    with pytest.raises(ValueError, match="the rollouts carry no routed experts"):
        pack_raw([Group([traj(None)])], algo)
    with pytest.raises(ValueError, match="cannot pack an empty list"):
        pack_raw([], algo)
    # not asked for: not packed, whatever the trajectories carry
    assert pack_groups_raw(_groups(1, routed=True), dataclasses.replace(algo, routing_replay=False),
                           0).raw.routed_experts is None

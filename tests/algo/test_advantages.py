"""GRPO / leave-one-out advantages and DAPO dynamic-sampling filtering, by hand."""

from __future__ import annotations

import pytest
import torch

from realscale.algo.advantages import broadcast_to_tokens, grpo_advantages, loo_advantages
from realscale.algo.filtering import dynamic_sampling_filter

# Two groups of four: [1, 0, 0, 0] (mean .25, unbiased std .5) and [2, 2, 2, 2].
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])


def test_grpo_mean_and_std():
    adv = grpo_advantages(REWARDS, 4, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]))


def test_grpo_mean_only():
    adv = grpo_advantages(REWARDS, 4, std_norm=False)
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]))


def test_grpo_uneven_groups_via_offsets():
    # Groups [3, 1] (mean 2, std sqrt(2)) and [5] (alone: advantage 0).
    r = torch.tensor([3.0, 1.0, 5.0], dtype=torch.float64)
    adv = grpo_advantages(r, cu_groups=torch.tensor([0, 2, 3]), eps=0.0)
    s = 2 ** 0.5
    torch.testing.assert_close(adv, torch.tensor([1 / s, -1 / s, 0.0], dtype=torch.float64))


def test_leave_one_out():
    adv = loo_advantages(REWARDS, 4)
    # 1 - mean(0,0,0) = 1; 0 - mean(1,0,0) = -1/3; equal rewards -> 0.
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0, 0.0]))


def test_leave_one_out_matches_its_definition_on_random_groups():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(30, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, 2, 9, 10 + 2, 30])
    adv = loo_advantages(r, cu_groups=cu)
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for i in range(lo, hi):
            others = torch.cat([r[lo:i], r[i + 1:hi]])
            assert adv[i].item() == pytest.approx(r[i].item() - others.mean().item())


def test_bad_groups_are_named():
    with pytest.raises(ValueError, match="exactly one of group_size"):
        grpo_advantages(REWARDS)
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        grpo_advantages(REWARDS, 3)
    with pytest.raises(ValueError, match="group_size: expected a positive int"):
        grpo_advantages(REWARDS, 0)
    with pytest.raises(ValueError, match="cu_groups: last offset"):
        grpo_advantages(REWARDS, cu_groups=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="group 1 has one sample"):
        loo_advantages(torch.tensor([1.0, 2.0, 3.0]), cu_groups=torch.tensor([0, 2, 3]))
    with pytest.raises(TypeError, match="rewards: expected a floating-point"):
        grpo_advantages(torch.tensor([1, 0]), 2)


def test_broadcast_to_tokens():
    out = broadcast_to_tokens(torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0, 2, 2, 5]),
                              mask=torch.tensor([1, 1, 0, 1, 1], dtype=torch.bool))
    torch.testing.assert_close(out, torch.tensor([1.0, 1.0, 0.0, 3.0, 3.0]))
    with pytest.raises(ValueError, match="per_seq: 2 values for 3 sequences"):
        broadcast_to_tokens(torch.tensor([1.0, 2.0]), torch.tensor([0, 2, 2, 5]))


# Four groups of four: all 1, all 0, success rate .25, success rate .75.
FILTER_REWARDS = torch.tensor([1.0] * 4 + [0.0] * 4 + [1.0, 0.0, 0.0, 0.0] + [1.0, 1.0, 1.0, 0.0])


def test_filter_all_equal():
    res = dynamic_sampling_filter(FILTER_REWARDS, 4)
    assert res.keep_groups.tolist() == [False, False, True, True]
    assert res.keep_seqs.tolist() == [False] * 8 + [True] * 8
    assert (res.n_groups, res.n_kept, res.n_all_equal, res.n_out_of_range) == (4, 2, 2, 0)
    assert res.stats()["filter/kept_frac"] == 0.5


def test_filter_success_window():
    res = dynamic_sampling_filter(FILTER_REWARDS, 4, success_lb=0.3, success_ub=1.0)
    assert res.keep_groups.tolist() == [False, False, False, True]
    assert (res.n_kept, res.n_all_equal, res.n_out_of_range) == (1, 2, 1)
    # Without the all-equal rule, the window alone keeps the all-1 group (rate 1.0).
    res = dynamic_sampling_filter(FILTER_REWARDS, 4, drop_all_equal=False, success_lb=0.3)
    assert res.keep_groups.tolist() == [True, False, False, True]
    assert (res.n_kept, res.n_all_equal, res.n_out_of_range) == (2, 0, 2)


def test_filter_tolerance_and_bad_window():
    r = torch.tensor([0.5, 0.5 + 1e-9, 0.2, 0.9], dtype=torch.float64)
    assert dynamic_sampling_filter(r, 2).keep_groups.tolist() == [True, True]
    assert dynamic_sampling_filter(r, 2, atol=1e-6).keep_groups.tolist() == [False, True]
    with pytest.raises(ValueError, match="success window"):
        dynamic_sampling_filter(r, 2, success_lb=0.8, success_ub=0.2)


def test_batch_normalized_advantages_by_hand() -> None:
    """AReaL's global-batch normalisation: mean 0 and unbiased std 1 over trained tokens."""
    from realscale.algo.advantages import batch_normalized_advantages, masked_moments, normalize_by_moments

    adv = torch.tensor([1.0, 2.0, 3.0, 100.0, 2.0])
    mask = torch.tensor([1, 1, 1, 0, 1])
    # trained tokens 1, 2, 3, 2: mean 2, unbiased variance (1 + 0 + 1 + 0) / 3
    std = (2 / 3) ** 0.5
    out = batch_normalized_advantages(adv, mask, eps=0.0)
    assert out.tolist() == pytest.approx([-1 / std, 0.0, 1 / std, 0.0, 0.0])
    # moments add up over pieces of the batch (micro-batches, data-parallel ranks)
    parts = masked_moments(adv[:2], mask[:2]) + masked_moments(adv[2:], mask[2:])
    assert parts.tolist() == masked_moments(adv, mask).tolist() == [4.0, 8.0, 18.0]
    assert normalize_by_moments(adv[2:], mask[2:], parts, eps=0.0).tolist() == pytest.approx(out[2:].tolist())
    # one trained token: centred only; none: all zero
    assert batch_normalized_advantages(adv, torch.tensor([0, 0, 1, 0, 0])).tolist() == [0.0] * 5
    assert batch_normalized_advantages(adv, torch.zeros(5)).tolist() == [0.0] * 5

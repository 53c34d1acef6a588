"""Micro-batch packing: invariants, hand-checked cases, bad input, kernel == Python twin."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from realscale import kernels
from realscale.data.packing import balanced_partition, micro_batches_lower_bound, pack_micro_batches, pack_stats


def _lognormal(n: int, seed: int, budget: int = 32768) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(budget / 16), 1.0, n)), 32, budget).astype(np.int64)


def _check(lens: np.ndarray, plan: list, budget: int, **kw: int) -> None:
    stats = pack_stats(lens, plan, budget, **kw)  # raises on a missing/duplicated sequence
    assert stats.max_load <= budget
    assert stats.micro_batches_per_rank % kw.get("multiple_of", 1) == 0
    assert stats.micro_batches_per_rank >= kw.get("min_micro_batches", 1)
    for rank in plan:
        for mb in rank:
            assert mb == sorted(mb)


def test_hand_checked_cases() -> None:
    assert pack_micro_batches([5, 5, 5, 5], 10) == [[[0, 1], [2, 3]]]
    # 9 tokens fit a budget of 10 only as 6+3 / 5+4 style splits: lower bound 2 reached
    plan = pack_micro_batches([6, 5, 4, 3], 9)
    assert sorted(sum(int(np.array([6, 5, 4, 3])[mb].sum()) for mb in rank) for rank in plan) == [18]
    assert len(plan[0]) == 2 and all(sum([6, 5, 4, 3][i] for i in mb) == 9 for mb in plan[0])
    # dp=2: both ranks get the same count and equal totals
    plan = pack_micro_batches([4, 4, 4, 4, 2, 2], 6, dp=2)
    assert [len(r) for r in plan] == [2, 2]
    assert [sum(sum([4, 4, 4, 4, 2, 2][i] for i in mb) for mb in r) for r in plan] == [10, 10]


def test_balanced_partition_without_budget() -> None:
    assign = balanced_partition([8, 7, 6, 5, 4], 2)
    loads = np.bincount(assign, weights=[8, 7, 6, 5, 4])
    assert sorted(loads.tolist()) == [15.0, 15.0]


@pytest.mark.parametrize("n,seed", [(512, 0), (4096, 1), (4096, 2)])
def test_lognormal_reaches_bound_and_balance(n: int, seed: int) -> None:
    lens = _lognormal(n, seed)
    plan = pack_micro_batches(lens, 32768)
    _check(lens, plan, 32768)
    stats = pack_stats(lens, plan, 32768)
    # the bound or one more (indivisible sequences can make the bound unreachable)
    assert stats.micro_batches_per_rank - stats.lower_bound_per_rank in (0, 1)
    assert stats.balance <= 1.01


@pytest.mark.parametrize("dp,multiple_of,min_mb", [(2, 1, 1), (4, 2, 1), (3, 4, 8), (1, 3, 1)])
def test_dp_pipeline_constraints(dp: int, multiple_of: int, min_mb: int) -> None:
    lens = _lognormal(1500, dp * 10 + multiple_of, budget=8192)
    plan = pack_micro_batches(lens, 8192, dp=dp, multiple_of=multiple_of, min_micro_batches=min_mb)
    assert len(plan) == dp
    _check(lens, plan, 8192, multiple_of=multiple_of, min_micro_batches=min_mb)
    stats = pack_stats(lens, plan, 8192, multiple_of=multiple_of, min_micro_batches=min_mb)
    assert stats.micro_batches_per_rank - stats.lower_bound_per_rank <= multiple_of
    assert stats.rank_balance <= 1.01


def test_more_micro_batches_than_sequences_leaves_empty_ones() -> None:
    plan = pack_micro_batches([3, 2], 10, min_micro_batches=4)
    assert len(plan[0]) == 4
    assert sorted(i for mb in plan[0] for i in mb) == [0, 1]
    assert sum(1 for mb in plan[0] if not mb) == 2


def test_oversize_sequences() -> None:
    with pytest.raises(ValueError, match=r"sequence 1 has 20 tokens, more than max_tokens=10"):
        pack_micro_batches([5, 20, 3], 10)
    plan = pack_micro_batches([5, 20, 3, 12], 10, allow_oversize=True)
    mbs = plan[0]
    assert [1] in mbs and [3] in mbs and len(mbs) == 3
    assert micro_batches_lower_bound([5, 20, 3, 12], 10) == 3
    assert pack_micro_batches([20, 30], 10, allow_oversize=True, dp=2) in ([[[0]], [[1]]], [[[1]], [[0]]])


@pytest.mark.parametrize("bad,match", [
    ([3, -1], r"seqlens\[1\] = -1"),
    ([3, 0], r"seqlens\[1\] = 0"),
    ([3, 2.5], r"seqlens\[1\] = 2.5 is not an integer"),
    ([[1, 2]], r"1-D"),
    (["a"], r"seqlens\[0\]"),
])
def test_bad_lengths(bad: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pack_micro_batches(bad, 10)


@pytest.mark.parametrize("kw,match", [
    ({"max_tokens": 0}, "max_tokens must be a positive integer"),
    ({"max_tokens": 10, "dp": 0}, "dp must be"),
    ({"max_tokens": 10, "multiple_of": -2}, "multiple_of must be"),
    ({"max_tokens": 10, "min_micro_batches": 1.5}, "min_micro_batches must be"),
])
def test_bad_arguments(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pack_micro_batches([1, 2, 3], **kw)


def test_accepts_torch_and_numpy() -> None:
    lens = [7, 3, 9, 1, 4]
    want = pack_micro_batches(lens, 10)
    assert pack_micro_batches(torch.tensor(lens), 10) == want
    assert pack_micro_batches(np.array(lens, dtype=np.int32), 10) == want
    assert pack_micro_batches([], 10) == [[[]]]


def test_kernel_matches_python_twin() -> None:
    if kernels.load("packing") is None:
        pytest.skip("packing kernel not built (python setup.py build_ext --inplace)")
    rng = np.random.default_rng(7)
    for _ in range(25):
        n = int(rng.integers(1, 700))
        lens = np.clip(np.round(rng.lognormal(5, 1.3, n)), 1, 4096).astype(np.int64)
        kw = dict(dp=int(rng.integers(1, 4)), multiple_of=int(rng.integers(1, 3)),
                  min_micro_batches=int(rng.integers(1, 5)))
        assert pack_micro_batches(lens, 4096, **kw) == pack_micro_batches(lens, 4096, use_kernel=False, **kw)
        k = int(rng.integers(1, 40))
        np.testing.assert_array_equal(balanced_partition(lens, k), balanced_partition(lens, k, use_kernel=False))

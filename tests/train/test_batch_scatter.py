"""Batch scatter on gloo: every rank's shares (and the engine's micro-batches of them)
equal what today's path computes (the whole batch broadcast, then the rank's token-
balanced share of each mini-batch), and the tensor bytes moved equal the lower bound."""

from __future__ import annotations

import pytest
from batch_scatter_cases import republish_orders, scatter_vs_broadcast, synthetic_batch

from realscale.train.batch_scatter import StageNeeds
from realscale.parallel.spawn import run_distributed


LAYOUTS = [(2, 1), (1, 2), (1, 4)]  # (tp, pp) on 4 ranks: dp2 x tp2, pp2 x dp2, pp4 (two middle stages)


@pytest.mark.multiproc
def test_scatter_matches_broadcast_and_moves_the_lower_bound() -> None:
    by_rank = run_distributed(scatter_vs_broadcast, 4, LAYOUTS, 2, 24, timeout=600)
    for i, layout in enumerate(LAYOUTS):
        results = [per_layout[i] for per_layout in by_rank]
        for res in results:
            assert res["problems"] == [], (layout, res["where"], res["problems"])
            assert res["count"] == 2
        moved = sum(r["bytes"] for r in results)
        assert moved == sum(r["need"] for r in results) == results[0]["bound"] > 0, layout
        assert all(r["header_bytes"] < 1000 * r["count"] for r in results)
        # each rank gets part of the batch, never all of it
        assert all(r["bytes"] < r["batch_bytes"] for r in results), layout


@pytest.mark.multiproc
def test_waiting_ranks_republish_when_the_driver_orders_it() -> None:
    """Step 0 carries the driver's order: "republish" (no server in rotation: every rank
    joins the weight update, realscale/publish/outage.py), then "here is the batch"."""
    by_rank = run_distributed(republish_orders, 2, 2, timeout=120)
    assert [r["republished"] for r in by_rank] == [[3, 3], [3, 3]]
    assert sum(r["seqs"] for r in by_rank) == 8 and all(r["seqs"] > 0 for r in by_rank)


def test_stage_needs_give_middle_stages_no_tokens() -> None:
    from realscale.config import AlgoConfig
    from realscale.train.actor import LOSS_FIELDS, stage_needs

    needs = stage_needs(AlgoConfig())
    assert needs.keys(1, 3) == ("cu_seqlens", "loss_mask")
    assert needs.keys(0, 3)[:2] == ("input_ids", "cu_seqlens") and "advantages" not in needs.keys(0, 3)
    assert set(LOSS_FIELDS) <= set(needs.keys(2, 3)) and "versions" not in needs.keys(2, 3)
    assert needs.keys(0, 1) == needs.keys(2, 3)  # one stage reads what first and last read
    # advantages normalised over the batch: every stage joins the moments' all-reduce
    assert "advantages" in stage_needs(AlgoConfig(normalize_adv_over_batch=True)).keys(1, 3)
    # GAE: every rank computes advantages from the critic's values and the token rewards
    gae = stage_needs(AlgoConfig(adv_estimator="gae", normalize_adv_over_batch=True))
    assert gae.keys(1, 3) == ("cu_seqlens", "loss_mask", "rewards")
    assert "advantages" not in gae.keys(2, 3) and {"rewards", "behav_logprobs"} <= set(gae.keys(2, 3))


def test_split_for_dp_refuses_a_mini_batch_smaller_than_dp() -> None:
    from realscale.train.actor import split_for_dp

    with pytest.raises(ValueError, match="fewer sequences than dp=4"):
        split_for_dp(synthetic_batch(6), 2, 4)
    assert StageNeeds((), (), ()).keys(0, 1) == ("cu_seqlens",)


def test_whole_group_mini_batches_keep_a_groups_samples_together() -> None:
    """``train.whole_groups``: 4 groups of 4 samples in 2 mini-batches: each mini-batch
    holds two whole groups; without it, every other sequence (half of every group)."""
    import torch

    from realscale.train.actor import mini_batches
    from realscale.train.batch import PackedBatch

    seqs = [torch.tensor([g, g, g, s]) for g in range(4) for s in range(4)]
    batch = PackedBatch.from_sequences(seqs)
    groups_of = lambda part: [sorted({int(part.sequence(i)[0]) for i in range(part.num_seqs)})]  # noqa: E731
    whole = mini_batches(batch, 2, whole_groups=True)
    assert [groups_of(p) for p in whole] == [[[0, 1]], [[2, 3]]]
    assert [groups_of(p) for p in mini_batches(batch, 2)] == [[[0, 1, 2, 3]], [[0, 1, 2, 3]]]
    assert sum(p.num_seqs for p in mini_batches(PackedBatch.from_sequences(seqs[:7]), 3, whole_groups=True)) == 7

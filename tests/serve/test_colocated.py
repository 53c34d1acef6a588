"""Colocated generation: the trainer ranks reshard their weights into a generation layout
on the same ranks, in place, bit-identical to the trainer's, at the lower bound."""

from __future__ import annotations

import pytest
from colocated_cases import publish_cases

from realscale.parallel.spawn import run_distributed

# (training layout, generation layout, release the generation memory between phases) on 2 ranks
CASES = [("d1t2p1", "d2t1p1", True), ("d2t1p1", "d1t2p1", True), ("d1t1p2", "d2t1p1", True),
         ("d1t1p2", "d1t2p1", False)]


@pytest.mark.multiproc
def test_generation_weights_are_the_trainers_bit_for_bit_after_an_in_place_reshard() -> None:
    from realscale.models.tiny import resolve_model_path

    results = run_distributed(publish_cases, 2, resolve_model_path("tiny-qwen2"), CASES, timeout=900)[0]
    assert len(results) == 2 * len(CASES)
    for r in results:
        where = f"{r['case']} step {r['step']}"
        for rank, (got, want) in enumerate(zip(r["hashes"], r["expected"].values())):
            assert got == want, f"{where} rank {rank}: tensors differ: {sorted(n for n in want if got[n] != want[n])[:4]}"
        st = r["stats"]
        assert st["perf/weight_sync_bytes"] == st["perf/weight_sync_bytes_lower_bound"], where
        train, gen, release = r["case"]
        # a rank keeps what it holds in both layouts: from tp2 to two tp1 replicas each rank
        # receives the half it lacks; from two tp1 replicas to tp2 nothing crosses ranks
        if (train, gen) == ("d2t1p1", "d1t2p1"):
            assert st["perf/weight_sync_bytes"] == 0 and st["perf/weight_sync_local_bytes"] > 0
        else:
            assert st["perf/weight_sync_bytes"] > 0
        assert r["resident_after_init"] is not release, where
        assert len(r["urls"]) == int(gen[1]), where  # one server per generation replica

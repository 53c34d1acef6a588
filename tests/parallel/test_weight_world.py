"""The weight world: real Megatron trainer ranks (tp2, pp2, tp2xpp2) send their shards
shard-to-shard into destination ranks laid out as (a) two 1-rank servers and (b) one
2-rank server; after every step each destination rank's tensors hash equal to the
trainer's exported weights sliced for it, and it received exactly the lower bound."""

from __future__ import annotations

import pytest
from weight_world_cases import host_rendezvous, server_worker, trainer_worker

from realscale.parallel.mesh import LayoutError
from realscale.parallel.spawn import DistributedJob, run_distributed
from realscale.parallel.weight_world import WorldSpec

# 4 trainer ranks: tp2 (with 2 data-parallel replicas), pp2 (2 replicas), tp2 x pp2.
LAYOUTS = ["d2t2p1", "d2t1p2", "d1t2p2"]
DESTINATIONS = {"2x1": [1, 1], "1x2": [2]}


def _cases(digest: str) -> list[tuple[str, list[dict]]]:
    """Per trainer layout, its worlds (port 0: trainer rank 0 hosts the store and
    publishes the port through the test's rendezvous store)."""
    return [(strategy, [WorldSpec("127.0.0.1", 0, f"{strategy}-{dst}", "gloo", strategy, servers, spec_digest=digest,
                                  timeout_s=600).to_json() for dst, servers in DESTINATIONS.items()])
            for strategy in LAYOUTS]


@pytest.mark.multiproc
def test_trainer_layouts_into_one_and_two_rank_servers_bit_identical_at_lower_bound():
    import torch

    from realscale.generate.weight_world_routes import server_spec
    from realscale.models.tiny import resolve_model_path
    from realscale.parallel.weight_world import spec_digest

    model = resolve_model_path("tiny-qwen2")
    cases = _cases(spec_digest(server_spec(model, torch.float32)))
    board, rdzv = host_rendezvous()
    servers = DistributedJob(server_worker, 2, model, cases, rdzv)
    try:
        trainers = run_distributed(trainer_worker, 4, model, cases, rdzv, timeout=900)
    except BaseException:
        servers.kill()  # they would wait for trainers that are gone
        raise
    dests = servers.wait(timeout=300)
    expected = {(r["world"], r["step"]): r for r in trainers[0]}
    sent: dict = {}
    for rank_results in trainers:
        for r in rank_results:
            sent[(r["world"], r["step"])] = sent.get((r["world"], r["step"]), 0) + r["sent"]
    received: dict = {}
    for rank_results in dests:
        for r in rank_results:
            key = (r["world"], r["step"])
            want = expected[key]["expected"][r["rank"]]
            assert r["hashes"] == want, f"{key} rank {r['rank']}: tensors differ: " \
                f"{sorted(n for n in want if want[n] != r['hashes'].get(n))[:4]}"
            received[key] = received.get(key, 0) + r["recv"]
    assert len(received) == len(LAYOUTS) * len(DESTINATIONS) * 2
    for key, got in received.items():
        assert got == expected[key]["lower_bound"] > 0, key
        # every trainer rank sent only what it held: the senders' bytes add up to at most
        # what the destinations received (a broadcast sends once for several receivers)
        assert 0 < sent[key] <= got, key


def test_world_spec_refuses_what_no_plan_can_serve():
    with pytest.raises(LayoutError, match="same number of ranks"):
        WorldSpec("127.0.0.1", 1, "w", "gloo", "d1t2p1", [1, 2])
    with pytest.raises(LayoutError, match="non-empty"):
        WorldSpec("127.0.0.1", 1, "w", "gloo", "d1t2p1", [])
    with pytest.raises(LayoutError, match="unknown fields"):
        WorldSpec.from_json({"master_address": "x", "bogus": 1})
    w = WorldSpec("127.0.0.1", 1, "w", "gloo", "d1t2p2", [2, 2])
    assert (w.trainer_ranks, w.world_size, w.server_offset(1)) == (4, 8, 6)
    src, dst = w.layouts()
    assert (str(src.strategy), str(dst.strategy), dst.mesh.start) == ("d1t2p2", "d2t2p1", 4)

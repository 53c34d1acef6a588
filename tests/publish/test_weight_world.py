"""The weight world on the running path: real Megatron trainer ranks (tp2, pp2, tp2xpp2,
four gloo processes) run ``ReshardTransport`` as the trainer does into real embedded
servers laid out as (a) two 1-rank servers and (b) one server with 2 ranks (two
processes). After every step each server rank's tensors hash equal to the trainer's
exported weights sliced for it, carry the new version, and each server rank received
exactly its own shard, straight from the trainer ranks (no funnel through the server's
rank 0 or the trainer's): bytes = the plan's lower bound."""

from __future__ import annotations

import pytest
from weight_world_cases import trainer_into_servers

from realscale.parallel.mesh import LayoutError
from realscale.parallel.spawn import run_distributed
from realscale.publish.weight_world import WorldSpec

# 4 trainer ranks: tp2 (with 2 data-parallel replicas), pp2 (2 replicas), tp2 x pp2; for the
# mixture of experts, experts split over 2 expert-parallel ranks, with tp2 (expert tensor
# parallelism) or pp2 beside.
LAYOUTS = {"tiny-qwen2": ["d2t2p1", "d2t1p2", "d1t2p2"], "tiny-qwen3-moe": ["d2t2p1e2", "d2t1p2e2"]}
STEPS = 2


def _shard_bytes(model: str, servers: list[int]) -> list[int]:
    """Bytes of each server rank's shard (float32), in world order."""
    import torch

    from realscale.serve.weights import model_spec, read_hf_config
    from realscale.parallel.reshard import shard_index

    spec, _ = model_spec(read_hf_config(model), 1, torch.float32)
    _, dst = WorldSpec("127.0.0.1", 1, "w", "gloo", "d2t2p1", servers).layouts()
    return [shard_index(spec, dst, g).numel * 4 for g in dst.mesh.gpus]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_trainer_layouts_into_real_one_and_two_rank_servers_bit_identical_at_lower_bound(name: str):
    from realscale.serve.server import EmbeddedServer, start_in_thread
    from realscale.models.tiny import resolve_model_path

    model = resolve_model_path(name)
    layouts = LAYOUTS[name]
    started = []
    try:
        for tp in (1, 1, 2):  # built here, on the main thread: a tp=2 server's rank dies with it
            started.append(start_in_thread(EmbeddedServer(model, max_running=4, context_length=128, tp=tp)))
        urls = [u for u, _ in started]
        servers = {"2x1": [(urls[0], 1), (urls[1], 1)], "1x2": [(urls[2], 2)]}
        ranks = run_distributed(trainer_into_servers, 4, model, layouts, servers, STEPS, timeout=900)
    finally:
        for _, stop in started:
            stop()
    rank0 = {r["case"]: r for r in ranks[0]}
    assert len(rank0) == len(layouts) * len(servers) * STEPS
    shards = {dst: _shard_bytes(model, [n for _, n in eps]) for dst, eps in servers.items()}
    for case, r in rank0.items():
        _, dst, _ = case
        for held in r["held"]:
            assert held["differ"] == [], f"{case} server {held['server']} rank {held['rank']}: {held['differ'][:4]}"
            assert held["version"] == r["version"], case
        assert len(r["held"]) == 2, case  # both server ranks checked, in either layout
        # every server rank reported receiving its own shard, whole, once
        assert [b for per_server in r["received"] for b in per_server] == shards[dst], case
        assert r["bytes"] == r["lower_bound"] == sum(shards[dst]) > 0, case
        # trainer ranks sent what they held, from several ranks (no funnel through rank 0);
        # a broadcast to several receivers sends once, so the senders' sum is at most that
        sent = [next(x["sent"] for x in rank if x["case"] == case) for rank in ranks]
        assert 0 < sum(sent) <= r["bytes"] and sum(1 for b in sent if b) >= 2, (case, sent)


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

"""SGLang's weight protocol from a pipelined trainer without a funnel through rank 0:
real Megatron trainer ranks (tp2 x pp2: four gloo processes) push updates with the run's
``BroadcastTransport`` (per-stage groups: ``StageBroadcastTransport``) into real embedded servers (1 rank and 2 ranks) speaking
SGLang's ``/init_weights_update_group`` / ``/update_weights_from_distributed`` protocol.
After every update each server rank holds the trainer's weights bit for bit and the new
version; each stage's leader sent its own stage's tensors and nothing else (rank 0 no
longer carries the whole model); the servers received one full copy per server rank."""

from __future__ import annotations

import pytest
from weight_world_cases import broadcast_into_servers

from realscale.parallel.spawn import run_distributed

# tp2 x pp2 (the one layout with both a TP gather per stage and two stage leaders); the
# default tier is at its 15-minute budget, so this runs with the end-to-end tests
LAYOUTS = ["d1t2p2"]
pytestmark = [pytest.mark.e2e, pytest.mark.multiproc, pytest.mark.timeout(900)]


def test_each_pipeline_stage_sends_its_own_part_bit_identical(tmp_path):
    from realscale.launcher.local import start_servers, stop_servers
    from realscale.models.tiny import resolve_model_path

    model = resolve_model_path("tiny-qwen2")
    # server processes (a group name is per process: two servers in one would collide)
    servers = []
    try:
        for tp in (1, 2):
            servers += start_servers(model, 1, str(tmp_path / f"tp{tp}"), max_running=4, context_length=128, tp=tp)
        endpoints = [(servers[0].url, 1), (servers[1].url, 2)]
        ranks = run_distributed(broadcast_into_servers, 4, model, LAYOUTS, endpoints, 2, timeout=900)
    finally:
        stop_servers(servers)
    for i, case in enumerate(r["case"] for r in ranks[0]):
        r0 = ranks[0][i]
        for held in r0["held"]:
            assert held["differ"] == [], f"{case} server {held['server']} rank {held['rank']}: {held['differ'][:4]}"
            assert held["version"] == r0["version"], case
        assert len(r0["held"]) == 3, case
        # every server rank received one whole copy: 3 receivers over 2 servers
        assert r0["bytes"] == r0["lower_bound"] * 3 // 2, case
        sent = [ranks[k][i]["sent"] for k in range(4)]
        # the stage leaders (first rank of each stage) together sent one full copy; rank 0
        # only its stage's part, the other ranks nothing
        leaders = [0, 2]  # Megatron's rank order: tp, then dp, then pp: stage 1 starts at rank tp*dp = 2
        assert sum(sent) == r0["full"], (case, sent)
        assert all(sent[k] > 0 for k in leaders) and all(sent[k] == 0 for k in range(4) if k not in leaders), \
            (case, sent)
        assert sent[0] < r0["full"] * 0.75, (case, sent)

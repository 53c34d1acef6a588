"""A server that dies *during* a weight transfer (after the update's liveness check) costs
a resend, not the run (issue 30, item 3): with the weight world (embedded servers) and with
SGLang's broadcast group (and a pp2 trainer's per-stage groups, the server killed while
stage 1's rank broadcasts), two trainer ranks push an update while one of two real
`realscale serve` processes is SIGKILLed mid-way; on gloo every member of the broken
group errors within a second, rank 0 retires the dead server, every trainer rank exports
again, and the survivor ends holding the trainer's weights bit for bit under the new
version. (On NCCL the survivors would wait in the collective until its timeout instead:
not run on GPUs.)"""

from __future__ import annotations

import pytest
from weight_world_cases import lose_one_mid_transfer

from realscale.parallel.spawn import run_distributed

pytestmark = [pytest.mark.e2e, pytest.mark.multiproc, pytest.mark.timeout(600)]


@pytest.mark.parametrize("kind", ["reshard", "broadcast", "broadcast-pp2"])
def test_server_killed_mid_transfer_costs_a_resend(kind: str, tmp_path) -> None:
    from realscale.launcher.local import start_servers, stop_servers
    from realscale.models.tiny import resolve_model_path

    model = resolve_model_path("tiny-qwen2")
    servers = start_servers(model, 2, str(tmp_path), max_running=4, context_length=128)
    try:
        out = run_distributed(lose_one_mid_transfer, 2, model, kind, [(s.url, 1) for s in servers],
                              servers[1].proc.pid, timeout=500)[0]
    finally:
        stop_servers(servers)
    assert out["retired"] == [servers[1].url]
    (held,) = out["held"]
    assert held["differ"] == [] and held["version"] == "2", held

"""The Slurm backend refuses a plan its allocation cannot hold, by the same rule (and the
same function) as the local backend: one device per trainer or server rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from realscale.config import load_config
from realscale.errors import LaunchError
from realscale.launcher.slurm import placement
from realscale.planner.apply import apply_plan


def _cfg(tmp_path: Path, *extra: str):
    plan = tmp_path / "plan.yaml"
    plan.write_text("mode: disaggregated\nroles:\n  actor_gen: {mesh: '0:2', strategy: d1t2p1}\n"
                    "  actor_train: {mesh: '2:4', strategy: d1t2p1}\n")
    return apply_plan(load_config(None, ["model.path=tiny-qwen2", f"parallel.plan={plan}", *extra]))


def test_cpu_job_with_a_plan_must_fit_its_cpus(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    with pytest.raises(LaunchError, match=r"needs 4 ranks \(2 trainer \+ 2 generation-server\), there are 2 CPUs "
                                          r"in the job \(1 nodes\); set launch.oversubscribe=true"):
        placement(cfg, ["vm"], env={"SLURM_CPUS_ON_NODE": "2"})
    p = placement(cfg, ["vm", "vm2"], env={"SLURM_CPUS_ON_NODE": "2"})
    assert (p.servers, p.ranks) == (1, 2)
    cfg.launch.oversubscribe = True
    placement(cfg, ["vm"], env={"SLURM_CPUS_ON_NODE": "2"})


def test_gpu_job_with_a_plan_never_oversubscribes(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "launch.gpus_per_node=2", "launch.oversubscribe=true")
    with pytest.raises(LaunchError, match="the plan needs 2 nodes, the job has 1"):
        placement(cfg, ["g1"])
    p = placement(cfg, ["g1", "g2"])
    assert (p.server_nodes, p.train_nodes, p.gpus_per_server) == (["g1"], ["g2"], 2)

"""`realscale train parallel.plan=plan.yaml` on this machine: the plan places the trainer
(tp=2) and one generation server with two tensor-parallel ranks, every step's weights
reach both server ranks through the weight world at exactly the resharding lower bound,
and its batch reaches the trainer ranks through the batch scatter at exactly its lower
bound; a plan the runtime cannot execute is refused in one line before any process starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

ARGS = ["model.path=tiny-qwen2", "data.source=task:arith", "run.total_steps=2", "run.checkpoint_every=0",
        "rollout.batch_size=2", "rollout.n_samples=2", "rollout.max_staleness=1", "generate.max_new_tokens=4",
        "train.max_tokens_per_micro_batch=512", "rollout.filter_all_equal=false", "launch.oversubscribe=true",
        "launch.backend=local"]

PLAN = """mode: disaggregated
cluster: {nodes: 1, gpus_per_node: 4, gpu: cpu}
roles:
  actor_gen:   {mesh: "0:2", strategy: d1t2p1}
  actor_train: {mesh: "2:4", strategy: d1t2p1}
"""


@pytest.mark.e2e  # a whole realscale train run (56 s): the default tier stays under its 15 minutes
@pytest.mark.timeout(900)
def test_a_plan_runs_end_to_end_with_shard_to_shard_weight_sync(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    cmd = [sys.executable, "-m", "realscale", "train", f"run.output_dir={tmp_path}", "run.name=r",
           f"parallel.plan={plan}", *ARGS]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    import yaml

    saved = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())  # the plan placed both roles
    assert (saved["parallel"]["dp"], saved["parallel"]["tp"], saved["parallel"]["pp"]) == (1, 2, 1)
    assert (saved["generate"]["num_servers"], saved["generate"]["tp"]) == (1, 2)
    # the two tp=2 trainer ranks exported the final weights themselves, which the supervisor evaluated
    record = json.loads((tmp_path / "r" / "final" / "export.json").read_text())
    assert record == {"step": 2, "world_size": 2, "backend": "gloo", "layout": {"tp": 2, "pp": 1, "dp": 1}}
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["accuracy_end"]["greedy"] is not None
    metrics = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "perf/weight_sync_bytes" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:  # what one server of 2 ranks needs: each rank its half (norms on both)
        assert m["perf/weight_sync_bytes"] == m["perf/weight_sync_bytes_lower_bound"] == _two_rank_server_bytes()
        assert m["perf/weight_sync_s"] > 0
        # the batch reached the TP peer through the scatter, at its bound; both ranks' compute timed
        assert m["perf/batch_bytes"] == m["perf/batch_bytes_lower_bound"] > 0 and m["perf/batch_s"] > 0
        assert m["perf/compute_s_rank0"] > 0 and m["perf/compute_s_max_other"] > 0


def _two_rank_server_bytes() -> int:
    import torch

    from realscale.serve.weights import model_spec, read_hf_config
    from realscale.models.tiny import resolve_model_path
    from realscale.parallel.reshard import shard_index
    from realscale.publish.weight_world import WorldSpec

    spec, _ = model_spec(read_hf_config(resolve_model_path("tiny-qwen2")), 1, torch.float32)
    _, dst = WorldSpec("127.0.0.1", 1, "w", "gloo", "d1t2p1", [2]).layouts()
    return sum(shard_index(spec, dst, g).numel * 4 for g in dst.mesh.gpus)


def _too_big() -> tuple[str, str]:
    import os

    n = (os.cpu_count() or 1) + 1
    plan = (PLAN.replace("cluster: {nodes: 1, gpus_per_node: 4, gpu: cpu}\n", "")
                .replace('"0:2", strategy: d1t2p1', f'"0:{n}", strategy: d{n}t1p1').replace('"2:4"', f'"{n}:{n + 2}"'))
    return plan, f"the plan needs {n + 2} ranks"


BAD = {
    "overlap": (PLAN.replace('"2:4"', '"0:2"'), "actor_train gpus[0:2] and actor_gen gpus[0:2] overlap"),
    "tp3": (PLAN.replace("cluster: {nodes: 1, gpus_per_node: 4, gpu: cpu}\n", "").replace("d1t2p1}", "d1t3p1}", 1)
            .replace('"0:2"', '"0:3"').replace('"2:4"', '"3:5"'), "actor_gen d1t3p1: "),
    "machine": _too_big(),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_plan_the_runtime_cannot_execute_is_refused_in_one_line_before_anything_starts(tmp_path: Path,
                                                                                         case: str) -> None:
    text, reason = BAD[case]
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    args = [a for a in ARGS if case != "machine" or "oversubscribe" not in a]
    cmd = [sys.executable, "-m", "realscale", "train", f"run.output_dir={tmp_path}", "run.name=r",
           f"parallel.plan={plan}", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr  # a user error, as config errors are
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert len(lines) == 1 and reason in lines[0] and lines[0].startswith("realscale: "), lines
    # the plan's layout is refused with the config, the machine's capacity by the local
    # backend's prepare (same error type): in neither case did a process start
    assert not (tmp_path / "r" / "logs" / "server0.log").exists() and not (tmp_path / "r" / "config.yaml").exists()

"""`realscale train parallel.plan=plan.yaml` on this machine: the plan places the trainer
and the generation servers, and every step's weights reach the servers through the
weight world at exactly the resharding lower bound."""

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
  actor_gen:   {mesh: "0:2", strategy: d2t1p1}
  actor_train: {mesh: "2:4", strategy: d1t2p1}
"""


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
    assert (saved["generate"]["num_servers"], saved["generate"]["tp"]) == (2, 1)
    metrics = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "perf/weight_sync_bytes" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["perf/weight_sync_bytes"] == m["perf/weight_sync_bytes_lower_bound"] > 0
        assert m["perf/weight_sync_s"] > 0


def test_a_plan_larger_than_the_machine_is_refused_before_anything_starts(tmp_path: Path) -> None:
    import os

    plan = tmp_path / "plan.yaml"
    n = (os.cpu_count() or 1) + 1
    plan.write_text(PLAN.replace("cluster: {nodes: 1, gpus_per_node: 4, gpu: cpu}\n", "")
                        .replace('"0:2", strategy: d2t1p1', f'"0:{n}", strategy: d{n}t1p1')
                        .replace('"2:4"', f'"{n}:{n + 2}"'))
    cmd = [sys.executable, "-m", "realscale", "train", f"run.output_dir={tmp_path}", "run.name=r",
           f"parallel.plan={plan}", *[a for a in ARGS if "oversubscribe" not in a]]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert f"the plan needs {n + 2} ranks" in res.stdout + res.stderr
    assert not (tmp_path / "r" / "logs" / "server0.log").exists()  # no process was started

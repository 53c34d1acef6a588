"""`realscale train parallel.plan=plan.yaml` with a colocated plan: two trainer ranks train
at tp=2 and generate as two tp=1 replicas in turn, the weights resharded in place each step.

Compared with the disaggregated synchronous run (η = 0: the same trainer layout, two
generation servers of one rank each) on the same seed, where the two can agree exactly:
decoding is made deterministic (top_k = 1, which still reports the log-probs of the full
distribution), the warm start answers most problems right, and REINFORCE (advantage = the
reward) turns every right answer into a policy update at a large learning rate. Then both
runs train the same prompts at every step, generate the same answers, earn the same rewards
and take the same loss; and in both the generation side used the trainer's current weights
(behaviour = proximal log-probs), which after a large update only holds if the new weights
reached it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(2400)]  # a warm start and two runs

TASK = ["data.source=task:arith", "data.task_max_operand=2", "data.task_heldout=1"]
RUN = [*TASK, "run.seed=3", "run.total_steps=2", "run.checkpoint_every=0", "rollout.batch_size=2",
       "rollout.n_samples=2", "generate.max_new_tokens=4", "generate.top_k=1", "train.max_tokens_per_micro_batch=512",
       "train.mini_batches=1", "rollout.filter_all_equal=false", "algo.adv_estimator=reinforce", "optim.lr=1e-2",
       "launch.backend=local"]
COLOCATED = """mode: colocated
roles:
  actor_gen:   {mesh: "0:2", strategy: d2t1p1}
  actor_train: {mesh: "0:2", strategy: d1t2p1}
"""
DISAGGREGATED = """mode: disaggregated
roles:
  actor_gen:   {mesh: "0:2", strategy: d2t1p1}
  actor_train: {mesh: "2:4", strategy: d1t2p1}
"""


def _realscale(*args: str, timeout: float = 900) -> None:
    res = subprocess.run([sys.executable, "-m", "realscale", *args], capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]


def _train(tmp_path: Path, name: str, plan: str, model: Path, *extra: str) -> tuple[list[dict], dict[int, list]]:
    (tmp_path / f"{name}.yaml").write_text(plan)
    _realscale("train", f"run.output_dir={tmp_path}", f"run.name={name}", f"parallel.plan={tmp_path / name}.yaml",
               f"model.path={model}", *RUN, *extra)
    run = tmp_path / name
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    uids = {}
    for line in (run / "trained_uids.jsonl").read_text().splitlines():
        rec = json.loads(line)
        uids[rec["step"]] = rec["uids"]
    return [m for m in metrics if "train/loss" in m], uids


@pytest.mark.e2e  # two whole runs (107 s): the e2e tier, which keeps the default tier under 15 minutes
def test_a_colocated_plan_trains_like_the_disaggregated_synchronous_run(tmp_path: Path) -> None:
    model = tmp_path / "warm"
    _realscale("sft", *TASK, "sft.steps=40", "sft.batch_size=32", "sft.warmup_steps=5", "sft.eval_size=0",
               f"sft.output={model}")
    colo, colo_uids = _train(tmp_path, "colocated", COLOCATED, model)
    disagg, disagg_uids = _train(tmp_path, "disaggregated", DISAGGREGATED, model, "rollout.max_staleness=0",
                                 "launch.oversubscribe=true")
    import yaml

    saved = yaml.safe_load((tmp_path / "colocated" / "config.yaml").read_text())
    assert saved["parallel"]["mode"] == "colocated" and saved["rollout"]["max_staleness"] == 0
    assert not (tmp_path / "colocated" / "logs" / "server0.log").exists()  # no server processes
    assert [m["step"] for m in colo] == [m["step"] for m in disagg] == [1, 2]
    assert colo_uids == disagg_uids  # the same prompts, step by step
    assert any(m["train/loss"] != 0 for m in colo)  # updates happened
    for c, d in zip(colo, disagg):
        step = c["step"]
        assert c["reward/mean"] == d["reward/mean"] and c["rollout/response_len"] == d["rollout/response_len"], step
        assert c["train/loss"] == pytest.approx(d["train/loss"], rel=1e-3, abs=1e-6), step
        for m in (c, d):  # generated with the weights the trainer had: on-policy in both modes
            assert abs(m["train/behav_kl"]) < 1e-5, (step, m["train/behav_kl"])
            assert m["staleness/max"] == 0
        # in place, at the lower bound: each rank lacks the half of every tp-split tensor it did not train
        assert c["perf/weight_sync_bytes"] == c["perf/weight_sync_bytes_lower_bound"] > 0
        assert c["perf/weight_sync_local_bytes"] > 0
        for rank in (0, 1):
            # (the kernel updates the peak lazily: it may trail a reading of the current RSS slightly)
            assert c[f"mem/peak_rss_mb_rank{rank}"] >= 0.99 * c[f"mem/rss_generate_mb_rank{rank}"] > 0
    assert colo[0]["train/grad_norm"] == pytest.approx(disagg[0]["train/grad_norm"], rel=1e-3)
    # `realscale sft`'s ranks came from the launcher; both runs' trainer ranks exported their weights
    assert json.loads((model / "sft_stage.json").read_text())["world_size"] == 1
    for name in ("colocated", "disaggregated"):
        record = json.loads((tmp_path / name / "final" / "export.json").read_text())
        assert (record["step"], record["world_size"], record["layout"]["tp"]) == (2, 2, 2), name

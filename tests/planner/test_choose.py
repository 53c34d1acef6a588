"""`--mode auto`: the planner picks colocated-synchronous or disaggregated-asynchronous from
the workload and the staleness bound, and says why (realscale/planner/choose.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from realscale.parallel.mesh import Cluster
from realscale.parallel.model_spec import known_model
from realscale.planner.choose import choose_mode, mode_cost
from realscale.planner.cost import Workload
from realscale.planner.hardware import get_gpu
from realscale.planner.search import Problem, default_roles, search_mode

LONG_TAIL = Workload(64, 8, 512, 16384, 4096, max_staleness=4)  # generation-heavy, longest answer 4x the mean
SHORT = Workload(64, 8, 4096, 256, 200, max_staleness=4, minibatches=8)  # long prompts, short even answers


def _problem(w: Workload) -> Problem:
    return Problem(known_model("qwen2-1.5b"), Cluster(1, 8), get_gpu("H100"), w, default_roles(ref=False))


@pytest.mark.parametrize("workload,mode,reason", [
    (LONG_TAIL, "disaggregated", "its tail is long"),
    (Workload(64, 8, 512, 16384, 4096, max_staleness=0), "colocated", "the staleness bound is 0"),
    (SHORT, "colocated", "does not pay for the split"),
], ids=["long tail, eta=4", "long tail, eta=0", "short answers, eta=4"])
def test_auto_picks_the_faster_mode_and_names_why(workload: Workload, mode: str, reason: str) -> None:
    p = _problem(workload)
    result, why = choose_mode(p, iters=2000)
    both = {m: search_mode(p, m, iters=2000).step_seconds for m in ("colocated", "disaggregated")}
    assert result.mode == mode == min(both, key=both.get)
    assert why[0].startswith("mode auto: ") and f"predicted {result.step_seconds:.3g} s/step" in why[0]
    assert reason in why[-1] and why[-1].strip().startswith("why:")
    assert sum(line.strip().startswith(("colocated:", "disaggregated:")) for line in why) == 2


def test_each_mode_is_explained_by_the_terms_that_make_its_step() -> None:
    for w in (LONG_TAIL, SHORT):
        for mode in ("colocated", "disaggregated"):
            c = mode_cost(search_mode(_problem(w), mode, iters=2000))
            joined = c.generate_s + c.train_s if mode == "colocated" else max(c.generate_s, c.train_s)
            assert c.step_s == pytest.approx(joined + c.sync_s, rel=1e-9), (w, mode)
            assert c.asynchronous == (mode == "disaggregated")


def test_realscale_plan_mode_auto_prints_the_reason_and_records_it(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    res = subprocess.run([sys.executable, "-m", "realscale", "plan", "--model", "qwen2-1.5b", "--nodes", "1",
                          "--gpus-per-node", "8", "--mode", "auto", "--no-ref", "--batch", "64", "--n-samples", "8",
                          "--prompt-len", "512", "--gen-len", "16384", "--mean-gen-len", "4096", "--max-staleness",
                          "0", "--iters", "2000", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "mode auto: colocated-synchronous" in res.stdout and "why: the staleness bound is 0" in res.stdout
    plan = yaml.safe_load(out.read_text())
    assert plan["mode"] == "colocated"
    assert plan["estimate"]["mode_choice"].startswith("colocated-synchronous, predicted")


def test_plan_takes_a_recipe_whose_model_is_its_warm_start() -> None:
    """`realscale plan --model configs/long_tail_cpu.yaml`: the warm start's size (model.path: sft)."""
    from realscale.commands.plan import _spec

    root = Path(__file__).resolve().parents[2]
    spec = _spec(str(root / "configs" / "long_tail_cpu.yaml"))
    assert spec.hidden == 128 and spec.n_layers == 4  # the sft section's fresh tiny Qwen2

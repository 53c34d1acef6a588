"""Activation recomputation: the engine turns on what ``train.recompute`` (or the plan) says,
and recomputing changes nothing but memory: identical losses, gradients and weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import recompute_cases
from realscale.config import load_config
from realscale.models.tiny import resolve_model_path
from realscale.parallel.spawn import run_distributed
from realscale.planner.apply import apply_plan
from realscale.train.engine import EngineConfig

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    model = resolve_model_path("tiny-qwen2")
    single = run_distributed(recompute_cases.run_all, 1, model, timeout=400)[0]
    tp2 = run_distributed(recompute_cases.run_all, 2, model, 2, 1, timeout=500)[0]
    return {"tp1": single, "tp2": tp2}


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_runs_and_changes_nothing_but_memory(runs: dict[str, Any], layout: str, mode: str) -> None:
    """Megatron's checkpoint ran (full: per layer; selective: per core attention), and the
    losses, gradient norms and trained weights' log-probs equal the run without it."""
    base, rc = runs[layout]["none"], runs[layout][mode]
    assert base["checkpoints"] == 0 and base["granularity"] is None
    assert rc["granularity"] == mode and rc["checkpoints"] > 0
    for a, b in zip(base["loss"], rc["loss"]):
        assert abs(a - b) <= 1e-6 * abs(a)
    for a, b in zip(base["grad_norm"], rc["grad_norm"]):
        assert abs(a - b) <= 1e-6 * a
    assert torch.allclose(base["lp1"], rc["lp1"], atol=1e-6, rtol=0)


def test_train_recompute_knob_and_plan_reach_the_engine(tmp_path) -> None:
    """``train.recompute`` is read by EngineConfig.from_config; ``auto`` takes the plan's."""
    plan = tmp_path / "plan.yaml"
    plan.write_text("mode: disaggregated\nroles:\n  actor_gen: {mesh: '0:2', strategy: d2t1p1}\n"
                    "  actor_train: {mesh: '2:4', strategy: d2t1p1, recompute: full}\n")
    assert EngineConfig.from_config(load_config(None, []), "m").recompute == "none"
    assert EngineConfig.from_config(load_config(None, ["train.recompute=selective"]), "m").recompute == "selective"
    # auto is resolved before any process starts, by apply_plan (the supervisor's first step)
    planned = apply_plan(load_config(None, [f"parallel.plan={plan}", "model.path=tiny-qwen2"]))
    assert planned.train.recompute == "full"
    assert EngineConfig.from_config(planned, "m").recompute == "full"
    assert EngineConfig.from_config(apply_plan(load_config(None, [f"parallel.plan={plan}", "model.path=tiny-qwen2",
                                                                  "train.recompute=none"])), "m").recompute == "none"
    with pytest.raises(RuntimeError, match="apply_plan resolves it"):  # never silently "none" on a planned run
        EngineConfig.from_config(load_config(None, [f"parallel.plan={plan}"]), "m")

"""The simulator's weight-sync term follows the path each engine's update really takes
(realscale/publish/): the resharder's plan (embedded servers; vLLM's shard-to-shard
``m2n``), SGLang's per-stage broadcast groups (``StageBroadcastTransport``), or the
funnel through trainer rank 0 (vLLM's broadcast engine)."""

from __future__ import annotations

import pytest

from realscale.config import load_config
from realscale.parallel.mesh import Strategy
from realscale.parallel.model_spec import known_model
from realscale.planner.hardware import builtin_profile
from realscale.planner.plan import Plan
from realscale.sim.build import RunLayout, SimError, broadcast_sync_seconds, sync_seconds, weight_path_for
from realscale.sim.recipe import scenario_from_config


def test_paths_by_engine() -> None:
    assert weight_path_for("sglang") == "stage_broadcast"
    assert weight_path_for("vllm", "m2n") == "reshard"
    assert weight_path_for("vllm", "broadcast") == "funnel"
    assert weight_path_for("embedded") == "reshard"
    with pytest.raises(SimError, match="weight path 'disk'"):
        sync_seconds(known_model("qwen2-7b"), builtin_profile("H100"), RunLayout(4, 4, Strategy(2, 4, 2)),
                     path="disk")


@pytest.mark.parametrize("model,train", [("qwen2-7b", Strategy(2, 4, 2)), ("qwen2-32b", Strategy(2, 8, 4))])
def test_per_stage_broadcast_beats_the_funnel_and_not_the_link(model, train) -> None:
    """Per stage: the whole model crosses the inter-node link once, each stage's TP gather
    hidden behind its send; the funnel adds the pipeline's trip to rank 0 and the gathers.
    Neither beats the link: every server rank must receive the whole model."""
    hw, spec = builtin_profile("H100"), known_model(model)
    layout = RunLayout(4, 8, train)
    stage = broadcast_sync_seconds(spec, hw, layout, per_stage=True)
    funnel = broadcast_sync_seconds(spec, hw, layout, per_stage=False)
    link = spec.param_bytes() / (hw.gpu.ib_gbps * hw.eff.link * 1e9)
    assert link <= stage < funnel
    # the funnel's extra: (pp-1)/pp of the model down the pipeline, plus the gathers unhidden
    assert funnel - stage >= link * (train.pp - 1) / train.pp
    # shard-to-shard moves each server rank only its shard: less than a whole model per rank
    assert sync_seconds(spec, hw, layout, path="reshard") < sync_seconds(spec, hw, layout, path="stage_broadcast")


def test_the_sglang_recipes_take_the_per_stage_path() -> None:
    cfg = load_config("configs/r1_distill_qwen_7b_math.yaml")
    assert cfg.generate.backend == "sglang"
    plan = Plan.load("launch/slurm/plans/ppo_7b.yaml")
    assert scenario_from_config(cfg, builtin_profile("H100"), plan=plan).weight_path == "stage_broadcast"


def test_a_measured_resharder_cost_is_refused_for_a_broadcast_path() -> None:
    from realscale.sim.transfer import LinkCost

    link = LinkCost(0.01, 1e-9, source=None)
    with pytest.raises(SimError, match="stage_broadcast path"):
        sync_seconds(known_model("qwen2-7b"), builtin_profile("H100"), RunLayout(4, 4, Strategy(2, 4, 2)),
                     weight_link=link, path="stage_broadcast")

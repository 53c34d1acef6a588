"""The simulator with a mixture-of-experts model: the Qwen3-30B-A3B recipe and its plan run,
the trainer's step is the cost model's for the plan's expert-parallel layout, servers decode
reading the routed experts, a colocated switch moves only the state a GPU holds."""

from __future__ import annotations

import os

import pytest

from realscale.config import load_config
from realscale.parallel.mesh import Strategy
from realscale.parallel.model_spec import known_model
from realscale.planner import cost as C
from realscale.planner.hardware import Source, builtin_profile
from realscale.planner.plan import Plan
from realscale.sim.build import RunLayout, SimError, server_model, switch_seconds, trainer_model
from realscale.sim.recipe import scenario_from_config
from realscale.sim.transfer import LinkCost

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(REPO, "configs", "qwen3_30b_a3b_math.yaml")
MOE = known_model("qwen3-30b-a3b")
H100 = builtin_profile("H100")


def test_the_moe_recipe_simulates_under_its_plan() -> None:
    cfg = load_config(RECIPE)
    plan = Plan.load(os.path.join(REPO, cfg.parallel.plan))
    sc = scenario_from_config(cfg, H100, plan=plan)
    assert sc.layout.train == plan.roles["actor_train"].strategy and sc.layout.train.ep > 1
    res = sc.run(steps=3, warmup=1, sample=0.1)
    assert res.tokens_per_s > 0 and res.step_seconds > 0


def test_the_simulated_trainer_is_the_cost_models_expert_parallel_step() -> None:
    free = LinkCost(0.0, 0.0, Source("assumed", "no batch transfer"))
    kw = dict(train_mb_tokens=32768, minibatches=4, gpus_per_node=8, sync_seconds=1.0, batch_link=free)
    s = Strategy(16, 1, 1, 8)
    n, prompt, answer = 1024, 1024 * 512, 1024 * 4000
    w = C.Workload(batch=n, n_samples=1, prompt_len=512, gen_len=4000, mean_gen_len=4000, train_mb_tokens=32768,
                   minibatches=4, max_staleness=0)
    expected = C.train_cost(MOE, s, w, H100.gpu, H100.eff, 8).seconds
    assert trainer_model(MOE, H100, s, **kw).train_seconds(n, prompt, answer) == pytest.approx(expected)
    # the same GPUs without expert parallelism cannot hold the experts' optimizer state
    with pytest.raises(SimError, match="out of memory"):
        trainer_model(MOE, H100, Strategy(16, 1, 1), **kw).train_seconds(n, prompt, answer)


def test_servers_decode_reading_the_routed_experts() -> None:
    server = server_model(MOE, H100, 4, 1024)
    one = server.decode_step(1, 2048)
    assert one < server.decode_step(256, 2048)
    # one sequence reads the dense part and 8 of 128 experts, not the whole model
    all_weights = MOE.param_bytes() / 4 / (H100.gpu.hbm_tbps * 1e12 * H100.eff.hbm_decode)
    assert one < 0.5 * all_weights + H100.eff.decode_step_overhead_s + 1e-3


def test_a_colocated_switch_moves_the_state_a_gpu_holds() -> None:
    dense_layout, ep_layout = (RunLayout(4, 16, Strategy(64, 1, 1, ep), colocated=True) for ep in (1, 8))
    assert switch_seconds(MOE, H100, ep_layout) < switch_seconds(MOE, H100, dense_layout)
    assert switch_seconds(MOE, H100, ep_layout) == pytest.approx(
        2 * C.offload_state_bytes(MOE, Strategy(64, 1, 1, 8)) / C.GB / H100.gpu.pcie_gbps)

"""The cost model and the search with a mixture-of-experts model (Qwen3-30B-A3B): active
FLOPs, the experts a GPU holds, the all-to-all of expert parallelism, decode reading the
routed experts, ep degrees in the search (and never for dense models), plans carrying ep."""

from __future__ import annotations

import os

import numpy as np
import pytest
import yaml

from realscale.config import ConfigError, load_config
from realscale.launcher.render import plan_for
from realscale.parallel.mesh import Cluster, LayoutError, Strategy
from realscale.parallel.model_spec import known_model
from realscale.planner import cost as C
from realscale.planner.apply import apply_plan
from realscale.planner.hardware import Efficiency, get_gpu
from realscale.planner.plan import Plan, plan_from_search
from realscale.planner.search import Problem, Role, _with_experts, build_instance, default_roles, role_options, search

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H100, EFF = get_gpu("H100"), Efficiency()
MOE = known_model("qwen3-30b-a3b")
W = C.Workload(batch=128, n_samples=8, prompt_len=512, gen_len=8192, max_staleness=2)


def test_active_parameters_match_the_published_figures() -> None:
    """Qwen3-30B-A3B's model card: 30.5B parameters, 3.3B activated per token."""
    assert MOE.n_params == pytest.approx(30.5e9, rel=0.01)
    assert C.active_params(MOE) == pytest.approx(3.3e9, rel=0.03)
    # the closed form the search uses is the spec's own tensor list
    assert C.expert_params(MOE) == sum(t.numel for t in MOE.tensors if t.expert >= 0)
    # forward FLOPs per token (no attention term at seq 0): 2 x the active matmul
    # parameters (all but the embedding lookup; the untied head is a matmul)
    emb = MOE.tensors[0].numel
    assert C.fwd_flops_per_token(MOE, 0) == pytest.approx(2 * (C.active_params(MOE) - emb))
    assert C.fwd_flops_per_token(MOE, 0) < 0.11 * 2 * MOE.n_params
    dense = known_model("qwen2-7b")
    assert C.active_params(dense) == dense.n_params and C.expert_params(dense) == 0


def test_memory_per_training_gpu_drops_with_ep() -> None:
    """A GPU holds its expert-parallel rank's experts: weights, gradients and optimizer
    state of the expert part fall with ep; the dense part does not."""
    mems = [C.train_memory_bytes(MOE, Strategy(16, 1, 1, ep), W, "full") for ep in (1, 2, 4, 8, 16)]
    assert all(a > b for a, b in zip(mems, mems[1:]))
    dense1, experts1 = C.held_params(MOE, Strategy(16, 1, 1, 1))
    dense8, experts8 = C.held_params(MOE, Strategy(16, 2, 1, 8))
    assert dense8 == pytest.approx(dense1 / 2) and experts8 == pytest.approx(experts1 / 16)
    # without ep the whole model's state does not fit a 16-GPU trainer; with ep=8 it does
    assert C.train_cost(MOE, Strategy(16, 1, 1, 1), W, H100, EFF, 8).note == "out of memory"
    assert np.isfinite(C.train_cost(MOE, Strategy(16, 1, 1, 8), W, H100, EFF, 8).seconds)


def test_generation_servers_hold_every_expert() -> None:
    rc = C.generate_cost(MOE, Strategy(4, 4, 1), W, H100, EFF, 8, asynchronous=True)
    assert rc.mem_gb * C.GB >= MOE.param_bytes() / 4
    with pytest.raises(LayoutError, match="ep=2 is refused"):
        C.generate_cost(MOE, Strategy(4, 4, 1, 2), W, H100, EFF, 8, asynchronous=True)


def test_all_to_all_is_zero_without_ep_and_grows_across_nodes() -> None:
    nbytes = 1e9
    assert C.all_to_all_seconds(nbytes, Strategy(16, 1, 1, 1), 8, H100, EFF) == 0.0
    assert C.moe_comm_seconds(MOE, Strategy(16, 1, 1, 1), 1e6, 3, H100, EFF, 8) == 0.0
    in_node = C.all_to_all_seconds(nbytes, Strategy(16, 1, 1, 8), 8, H100, EFF)
    assert in_node == pytest.approx(nbytes * 7 / 8 / (H100.nvlink_gbps * C.GB * EFF.link))
    across = C.all_to_all_seconds(nbytes, Strategy(16, 1, 1, 16), 8, H100, EFF)  # 2 nodes: half over IB
    assert across == pytest.approx(nbytes * 8 / 16 / (H100.ib_gbps * C.GB * EFF.link)) and across > 3 * in_node
    # tp 2 puts 4 ranks of an ep group in a node: ep=8 crosses nodes then
    assert C.all_to_all_seconds(nbytes, Strategy(8, 2, 1, 8), 8, H100, EFF) > in_node
    # in the training step: more ep within a node moves more of the tokens off the GPU
    comm = [C.moe_comm_seconds(MOE, Strategy(16, 1, 1, ep), 1e6, 3, H100, EFF, 8) for ep in (2, 4, 8, 16)]
    assert all(a < b for a, b in zip(comm, comm[1:])) and comm[-1] > 3 * comm[-2]
    # a dense model has no such term, whatever the layout
    assert C.moe_comm_seconds(known_model("qwen2-7b"), Strategy(16, 2, 1), 1e6, 3, H100, EFF, 8) == 0.0


def test_decode_reads_the_experts_its_batch_is_routed_to() -> None:
    weights = C.decode_weight_bytes(MOE, 1)
    experts = C.expert_params(MOE) * MOE.itemsize
    assert weights(1) == pytest.approx(MOE.param_bytes() - experts * (1 - 8 / 128))
    assert weights(4096) == pytest.approx(MOE.param_bytes(), rel=1e-6)
    assert C.decode_weight_bytes(known_model("qwen2-7b"), 1) is None
    one, many = (C.decode_step_seconds(MOE, 4, b, 2048, H100, EFF) for b in (1, 256))
    assert one < C.decode_step_seconds(MOE, 4, 64, 2048, H100, EFF) < many


def test_the_search_tries_ep_for_moe_training_only() -> None:
    """ep degrees: divisors of dp dividing the experts, for a MoE model's train roles; a
    dense model's options are what they were (ep 1 everywhere)."""
    train, gen = Role("actor_train", "train"), Role("actor_gen", "generate")
    assert [s.ep for s in _with_experts(MOE, train, [Strategy(12, 1, 1)])] == [1, 2, 4]
    assert [s.ep for s in _with_experts(MOE, gen, [Strategy(12, 1, 1)])] == [1]
    dense = known_model("qwen2-7b")
    assert _with_experts(dense, train, [Strategy(16, 1, 1)]) == [Strategy(16, 1, 1)]
    p = Problem(dense, Cluster(2, 8), H100, W, default_roles())
    inst = build_instance(p, "disaggregated")
    assert all((o.ep == 1).all() for o in inst.opts)
    opts = role_options(Problem(MOE, Cluster(2, 8), H100, W, default_roles(ref=False)), train, "disaggregated")
    assert set(opts.ep.tolist()) == {1, 2, 4, 8, 16}


def test_dense_shipped_plans_are_unchanged() -> None:
    """The dense recipes' plans render byte for byte as checked in before experts existed."""
    with open(os.path.join(REPO, "configs", "sweeps", "areal_sizes.yaml"), encoding="utf-8") as fh:
        jobs = yaml.safe_load(fh)["jobs"]
    for name, job in jobs.items():
        with open(os.path.join(REPO, "launch", "slurm", "plans", f"{name}.yaml"), encoding="utf-8") as fh:
            assert plan_for(load_config(os.path.join(REPO, job["recipe"]))).to_yaml() == fh.read(), name


def test_the_search_places_qwen3_moe_with_ep_on_64_h100() -> None:
    """8 nodes x 8 H100s, a step whose training time decides (the phases about balanced):
    the plan trains with ep > 1, strictly faster than any ep=1 layout of the same devices
    (not a tie), its ep group inside a node; the plan YAML keeps ep."""
    p = Problem(MOE, Cluster(8, 8), H100, W, default_roles(ref=False))
    result = search(p, "auto", iters=20_000)
    plan = plan_from_search(result, p)
    train = plan.roles["actor_train"]
    s = train.strategy
    assert s.ep > 1 and s.tp * s.ep <= 8
    inst, t = result.instance, [r.name for r in p.roles].index("actor_train")
    o = inst.opts[t]
    same = (o.lo == train.mesh.start) & (o.hi == train.mesh.end)
    assert train.seconds < o.seconds[same & (o.ep == 1)].min()
    assert train.seconds >= plan.roles["actor_gen"].seconds  # training decides this step
    back = Plan.from_yaml(plan.to_yaml())
    assert back.roles["actor_train"].strategy == s and f"e{s.ep}" in plan.to_yaml()
    assert " ep " in plan.table().splitlines()[0] + " "


def test_a_moe_plan_sets_parallel_ep_and_needs_sequence_parallel_under_tp(tmp_path) -> None:
    recipe = os.path.join(REPO, "configs", "qwen3_30b_a3b_math.yaml")
    cfg = apply_plan(load_config(recipe, ["parallel.ep=1"]))
    assert cfg.parallel.ep == Plan.load(os.path.join(REPO, cfg.parallel.plan)).roles["actor_train"].strategy.ep > 1
    plan = Plan.load(os.path.join(REPO, "configs", "plans", "qwen3_30b_a3b_math.yaml"))
    train = plan.roles["actor_train"]
    plan.roles["actor_train"] = type(train)(train.mesh, Strategy(8, 2, 1, 8))
    path = tmp_path / "tp2.yaml"
    path.write_text(plan.to_yaml())
    with pytest.raises(ConfigError, match="needs parallel.sequence_parallel=true"):
        apply_plan(load_config(recipe, [f"parallel.plan={path}"]))
    cfg = apply_plan(load_config(recipe, [f"parallel.plan={path}", "parallel.dp=8", "parallel.tp=2",
                                          "parallel.sequence_parallel=true"]))
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.ep, cfg.parallel.sequence_parallel) == (8, 2, 8, True)

"""Planner: cost model refusals, search optimality vs brute force, plan YAML, CLI."""

from __future__ import annotations

import math
import random

import pytest

from realscale import kernels
from realscale.parallel.mesh import Cluster, LayoutError, Mesh, Strategy
from realscale.parallel.model_spec import known_model
from realscale.planner import cost as C
from realscale.planner.hardware import Efficiency, HardwareError, get_gpu, load_profiles
from realscale.planner.plan import Plan, Placement, plan_from_search
from realscale.planner.search import (MODES, Problem, _anneal, anneal_py, build_instance, default_roles, evaluate,
                                      evaluate_placements, exhaustive, search, seeds)

H100 = get_gpu("H100")


def _problem(model: str, nodes: int, gpn: int, **kw) -> Problem:
    w = C.Workload(batch=kw.pop("batch", 128), n_samples=8, prompt_len=512, gen_len=kw.pop("gen_len", 8192),
                   max_staleness=kw.pop("eta", 2))
    return Problem(known_model(model), Cluster(nodes, gpn), kw.pop("gpu", H100), w, default_roles(**kw))


def test_spec_parameter_counts_match_published_sizes():
    assert known_model("qwen2-7b").n_params == pytest.approx(7.62e9, rel=0.01)
    assert known_model("qwen2-1.5b").n_params == pytest.approx(1.54e9, rel=0.01)
    assert known_model("qwen2-70b").n_params == pytest.approx(72.7e9, rel=0.01)


def test_cost_model_refuses_with_reasons():
    spec, w, eff = known_model("qwen2-70b"), C.Workload(), Efficiency()
    rc = C.train_cost(spec, Strategy(1, 1, 1), w, H100, eff, 8)
    assert math.isinf(rc.seconds) and rc.note == "out of memory"
    with pytest.raises(LayoutError, match="pp=2 is refused"):
        C.generate_cost(spec, Strategy(1, 4, 2), w, H100, eff, 8, False)
    with pytest.raises(LayoutError, match="key/value head groups"):
        C.train_cost(known_model("qwen2-1.5b"), Strategy(1, 4, 1), w, H100, eff, 8)
    with pytest.raises(LayoutError, match="exceeds the 4 GPUs of a node"):
        C.infer_cost(spec, Strategy(1, 8, 1), w, H100, eff, 4)


def test_cost_model_scales_sensibly():
    spec, w, eff = known_model("qwen2-7b"), C.Workload(), Efficiency()
    t8 = C.train_cost(spec, Strategy(4, 2, 1), w, H100, eff, 8).seconds
    t16 = C.train_cost(spec, Strategy(8, 2, 1), w, H100, eff, 8).seconds
    assert 0.4 * t8 < t16 < 0.75 * t8
    sync = C.generate_cost(spec, Strategy(8, 1, 1), w, H100, eff, 8, asynchronous=False).seconds
    asy = C.generate_cost(spec, Strategy(8, 1, 1), w, H100, eff, 8, asynchronous=True).seconds
    assert asy < sync  # no long tail, fuller batches
    h200 = C.generate_cost(spec, Strategy(8, 1, 1), w, get_gpu("H200"), eff, 8, asynchronous=True).seconds
    assert h200 < asy  # more HBM bandwidth and KV room


SMALL = [("qwen2-1.5b", 1, 4, {}), ("qwen2-1.5b", 1, 8, {"ref": False}), ("qwen2-7b", 2, 4, {}),
         ("qwen2-7b", 2, 2, {"critic": True, "ref": False})]


@pytest.mark.parametrize("model,nodes,gpn,kw", SMALL)
@pytest.mark.parametrize("mode", MODES)
def test_annealing_finds_the_brute_force_optimum(model, nodes, gpn, kw, mode):
    p = _problem(model, nodes, gpn, **kw)
    inst = build_instance(p, mode)
    best, opt = exhaustive(inst)
    start = sorted(seeds(inst, p.cluster), key=lambda ch: evaluate(inst, ch))[0]
    choice, c = _anneal(inst, start, 20_000, 0)
    assert c == pytest.approx(opt, rel=1e-9)
    assert evaluate(inst, choice) == pytest.approx(c, rel=1e-9)


def test_python_annealing_twin_finds_the_optimum():
    p = _problem("qwen2-1.5b", 1, 4)
    inst = build_instance(p, "disaggregated")
    _, opt = exhaustive(inst)
    _, c = anneal_py(inst, [0] * len(inst.opts), 20_000, 1)
    assert c == pytest.approx(opt, rel=1e-9)


def test_cpp_evaluator_matches_python():
    mod = kernels.load("plan_search")
    if mod is None:
        pytest.skip("plan_search kernel not built")
    p = _problem("qwen2-7b", 2, 4, critic=True)
    rng = random.Random(0)
    for mode in MODES:
        inst = build_instance(p, mode)
        for _ in range(200):
            ch = [rng.randrange(len(o)) for o in inst.opts]
            _, c = _anneal(inst, ch, 0, 0)
            assert c == pytest.approx(evaluate(inst, ch), rel=1e-12)


def test_disaggregated_forbids_sharing_generation_gpus():
    p = _problem("qwen2-1.5b", 1, 4)
    with pytest.raises(LayoutError, match="refused"):
        evaluate_placements(p, {"actor_gen": (Mesh(0, 4), Strategy(1, 4, 1)),
                                "ref_inf": (Mesh(0, 4), Strategy(4, 1, 1)),
                                "actor_train": (Mesh(0, 4), Strategy(4, 1, 1))}, "disaggregated")
    c, _, _ = evaluate_placements(p, {"actor_gen": (Mesh(0, 4), Strategy(2, 2, 1)),
                                      "ref_inf": (Mesh(0, 4), Strategy(4, 1, 1)),
                                      "actor_train": (Mesh(0, 4), Strategy(4, 1, 1))}, "disaggregated")
    assert c >= 1e17


def test_search_auto_and_plan_yaml_round_trip(tmp_path):
    p = _problem("qwen2-7b", 2, 8)
    r = search(p, "auto", iters=5_000)
    plan = plan_from_search(r, p)
    assert set(plan.roles) == {"actor_gen", "ref_inf", "actor_train"}
    back = Plan.from_yaml(plan.to_yaml())
    assert {k: (v.mesh, v.strategy) for k, v in back.roles.items()} == \
        {k: (v.mesh, v.strategy) for k, v in plan.roles.items()}
    assert back.step_seconds == pytest.approx(plan.step_seconds, rel=1e-3)
    assert "actor_train" in plan.table() and "estimate" in plan.table()
    with pytest.raises(LayoutError, match="'start:end'"):
        Plan.from_dict({"roles": {"x": {"mesh": "abc", "strategy": "d1"}}})
    with pytest.raises(LayoutError, match="needs 4 GPUs"):
        Plan.from_dict({"roles": {"x": {"mesh": "0:2", "strategy": "d4"}}})
    with pytest.raises(LayoutError, match="whole nodes"):
        Plan.from_dict({"cluster": {"nodes": 2, "gpus_per_node": 8},
                        "roles": {"x": {"mesh": "4:12", "strategy": "d8"}}})


def test_gpu_profiles_yaml(tmp_path):
    f = tmp_path / "gpus.yaml"
    f.write_text("H100: {hbm_gb: 94}\nMI300X: {peak_tflops: 1307, hbm_gb: 192, hbm_tbps: 5.3, "
                 "nvlink_gbps: 448, ib_gbps: 50}\n")
    prof = load_profiles(str(f))
    assert prof["H100"].hbm_gb == 94 and prof["H100"].peak_tflops == 989
    assert get_gpu("mi300x", prof).hbm_gb == 192
    f.write_text("X: {peak: 1}\n")
    with pytest.raises(HardwareError, match="unknown keys"):
        load_profiles(str(f))


def test_cli_plan(tmp_path, capsys):
    from realscale.cli import main

    out = tmp_path / "plan.yaml"
    assert main(["plan", "--model", "qwen2-1.5b", "--nodes", "1", "--gpus-per-node", "4", "--iters", "2000",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "actor_gen" in text and "tokens/s" in text
    assert Plan.load(str(out)).cluster == Cluster(1, 4)
    assert main(["plan", "--model", "qwen2-9b"]) == 2
    assert "did you mean" in capsys.readouterr().err


def test_gae_recipe_places_and_costs_the_critic(tmp_path) -> None:
    """With algo.adv_estimator=gae the plan holds critic_inf / critic_train and the cost
    model counts them; a plan that puts critic_train off the actor's placement is refused."""
    import dataclasses
    import pathlib

    from realscale.config import ConfigError, load_config
    from realscale.launcher.render import plan_for
    from realscale.planner.apply import apply_plan

    recipe = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "r1_distill_qwen_1.5b_math.yaml")
    grpo = plan_for(load_config(recipe))
    gae = plan_for(load_config(recipe, ["algo.adv_estimator=gae"]))
    assert {"critic_inf", "critic_train"} <= set(gae.roles) and "critic_train" not in grpo.roles
    assert gae.step_seconds > grpo.step_seconds  # two more passes over the batch
    actor = gae.roles["actor_train"]
    gae.roles["critic_train"] = dataclasses.replace(actor)
    ok = tmp_path / "ok.yaml"
    ok.write_text(gae.to_yaml())
    cfg = apply_plan(load_config(recipe, ["algo.adv_estimator=gae", f"parallel.plan={ok}"]))
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp) == (actor.strategy.dp, actor.strategy.tp,
                                                                   actor.strategy.pp)
    gae.roles["critic_train"] = gae.roles["actor_gen"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(gae.to_yaml())
    with pytest.raises(ConfigError, match="critic_train .* must share actor_train's placement"):
        apply_plan(load_config(recipe, ["algo.adv_estimator=gae", f"parallel.plan={bad}"]))

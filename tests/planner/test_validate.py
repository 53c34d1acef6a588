"""A plan the runtime cannot execute is refused before any process starts, in one line;
one it can run places every role (trainer dp/tp/pp, servers and their tp)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from realscale.config import ConfigError, load_config
from realscale.planner.apply import apply_plan
from realscale.planner.validate import check_capacity

TINY = ["model.path=tiny-qwen2"]  # 4 heads, 2 key/value groups, 2 layers


def _plan(tmp_path: Path, roles: dict[str, tuple[str, str]], mode: str = "disaggregated", cluster: str = "") -> str:
    lines = [f"mode: {mode}"]
    if cluster:
        lines.append(f"cluster: {cluster}")
    lines.append("roles:")
    lines += [f"  {name}: {{mesh: '{mesh}', strategy: {s}}}" for name, (mesh, s) in roles.items()]
    path = tmp_path / "plan.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _apply(plan: str, *extra: str):
    return apply_plan(load_config(None, [*TINY, f"parallel.plan={plan}", *extra]))


def test_a_plan_places_the_trainer_and_the_servers(tmp_path: Path) -> None:
    cfg = _apply(_plan(tmp_path, {"actor_gen": ("0:4", "d2t2p1"), "actor_train": ("4:8", "d1t2p2")}))
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp) == (1, 2, 2)
    assert (cfg.generate.num_servers, cfg.generate.tp) == (2, 2)


REFUSALS = [
    ({"actor_gen": ("0:2", "d2t1p1"), "actor_train": ("1:3", "d2t1p1")}, "disaggregated", "overlap"),
    ({"actor_gen": ("0:2", "d1t1p2"), "actor_train": ("2:3", "d1t1p1")}, "disaggregated", "pp must be 1"),
    ({"actor_gen": ("0:1", "d1t1p1"), "actor_train": ("1:5", "d1t4p1")}, "disaggregated", "key/value head groups"),
    ({"actor_gen": ("0:1", "d1t1p1"), "actor_train": ("1:5", "d1t1p4")}, "disaggregated", "more than the model's 2"),
    ({"actor_gen": ("0:1", "d1t1p1"), "actor_train": ("0:2", "d2t1p1")}, "colocated",
     "actor_gen gpus\\[0:1\\] must equal actor_train"),
    ({"actor_gen": ("0:1", "d1t1p1"), "actor_train": ("0:1", "d1t1p1")}, "elsewhere", "mode 'elsewhere' is not one"),
    ({"actor_gen": ("0:1", "d1t1p1"), "actor_train": ("1:2", "d1t1p1"), "ref_inf": ("2:3", "d1t1p1")},
     "disaggregated", r"ref_inf on gpus\[2:3\] must be on actor_train's devices"),
    ({"actor_gen": ("0:1", "d1t1p1"), "actor_train": ("2:4", "d1t2p1"), "ref_inf": ("1:3", "d1t2p1")},
     "disaggregated", r"ref_inf on gpus\[1:3\] must be on actor_train's devices"),
    ({"actor_gen": ("0:1", "d1t1p1"), "actor_train": ("1:2", "d1t1p1"), "reward": ("2:3", "d1t1p1")},
     "disaggregated", "role reward is not placed"),
    ({"actor_gen": ("0:1", "d1t1p1")}, "disaggregated", "no actor_train role"),
]


@pytest.mark.parametrize("roles,mode,reason", REFUSALS, ids=[r[2] for r in REFUSALS])
def test_plans_the_runtime_cannot_execute_are_refused_in_one_line(tmp_path: Path, roles, mode, reason) -> None:
    with pytest.raises(ConfigError, match=reason) as info:
        _apply(_plan(tmp_path, roles, mode))
    assert "\n" not in str(info.value)


def test_a_reference_on_the_actors_devices_is_accepted(tmp_path: Path) -> None:
    """ref_inf on actor_train's mesh runs there, in the actor's layout, whatever strategy the planner costed."""
    cfg = _apply(_plan(tmp_path, {"actor_gen": ("0:2", "d1t2p1"), "actor_train": ("2:4", "d1t2p1"),
                                  "ref_inf": ("2:4", "d2t1p1")}), "algo.kl_coef=0.1")
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp) == (1, 2, 1)
    # part of the actor's devices: the reference still runs on all of them
    _apply(_plan(tmp_path, {"actor_gen": ("0:2", "d1t2p1"), "actor_train": ("2:4", "d1t2p1"),
                            "ref_inf": ("3:4", "d1t1p1")}), "algo.kl_coef=0.1")


def test_pipeline_stages_must_split_the_layers_evenly(tmp_path: Path) -> None:
    plan = _plan(tmp_path, {"actor_gen": ("0:1", "d1t1p1"), "actor_train": ("1:5", "d1t1p4")})
    with pytest.raises(ConfigError, match="pp=4 does not divide the model's 6 layers"):
        _apply(plan, "model.path=small-qwen2")


def test_missing_and_malformed_plans(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        _apply("/no/plan.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("roles: {actor_gen: {mesh: '2:1', strategy: d1t1p1}}\n")
    with pytest.raises(ConfigError, match="is empty"):
        _apply(str(bad))


def test_capacity_rule_one_device_per_rank() -> None:
    cfg = load_config(None, ["parallel.tp=2", "generate.num_servers=2", "generate.tp=2"])
    check_capacity(cfg, 6, "CPU cores", "parallel.plan", gpus=False)
    with pytest.raises(ConfigError, match=r"needs 6 ranks \(2 trainer \+ 4 generation-server\), there are 4 CPU "
                                          r"cores; set launch.oversubscribe=true"):
        check_capacity(cfg, 4, "CPU cores", "parallel.plan", gpus=False)
    cfg.launch.oversubscribe = True
    check_capacity(cfg, 4, "CPU cores", "parallel.plan", gpus=False)  # CPU: allowed when asked
    with pytest.raises(ConfigError, match="there are 4 GPUs$"):  # GPUs: never
        check_capacity(cfg, 4, "GPUs", "parallel.plan", gpus=True)


def test_local_backend_refuses_a_plan_larger_than_the_machine(tmp_path: Path) -> None:
    import os

    from realscale.launcher.local import LocalBackend

    cores = os.cpu_count() or 1
    plan = _plan(tmp_path, {"actor_gen": (f"0:{cores}", f"d{cores}t1p1"), "actor_train": (f"{cores}:{cores + 1}",
                                                                                         "d1t1p1")})
    cfg = _apply(plan, "launch.backend=local")
    with pytest.raises(ConfigError, match=f"needs {cores + 1} ranks .* there are {cores} CPU cores"):
        LocalBackend(cfg, str(tmp_path / "run")).prepare()
    cfg.launch.oversubscribe = True
    LocalBackend(cfg, str(tmp_path / "run")).prepare()


def _realscale_plan(tmp_path: Path, mode: str, cores: int) -> str:
    """`realscale plan` of the tiny model for a CPU "cluster" of 1 node x ``cores``; the plan's path."""
    from realscale.models.tiny import resolve_model_path

    out = tmp_path / "plan.yaml"
    res = subprocess.run([sys.executable, "-m", "realscale", "plan", "--model", resolve_model_path("tiny-qwen2"),
                          "--nodes", "1", "--gpus-per-node", str(cores), "--gpu", "cpu", "--mode", mode, "--no-ref",
                          "--batch", "32", "--n-samples", "8", "--gen-len", "24", "--prompt-len", "16",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return str(out)


def test_realscale_plan_plans_this_machine(tmp_path: Path) -> None:
    """`realscale plan` for a CPU "cluster" of 1 node x N cores yields a plan a run takes."""
    cfg = _apply(_realscale_plan(tmp_path, "disaggregated", 4), "launch.oversubscribe=true")
    assert cfg.parallel.world_size + cfg.generate.num_servers * cfg.generate.tp <= 4


def test_a_colocated_plan_places_both_layouts_on_the_same_ranks_and_runs_synchronously(tmp_path: Path,
                                                                                      capsys) -> None:
    plan = _plan(tmp_path, {"actor_gen": ("0:2", "d2t1p1"), "actor_train": ("0:2", "d1t2p1")}, "colocated")
    cfg = _apply(plan, "rollout.max_staleness=3")
    assert (cfg.parallel.mode, cfg.parallel.tp, cfg.generate.num_servers, cfg.generate.tp) == ("colocated", 2, 2, 1)
    assert cfg.rollout.max_staleness == 0 and "max_staleness 3 -> 0" in capsys.readouterr().out
    check_capacity(cfg, 2, "CPU cores", "parallel.plan", gpus=False)  # no server ranks of their own
    with pytest.raises(ConfigError, match="generate.backend=vllm runs servers"):
        _apply(plan, "generate.backend=vllm")


def test_colocated_without_a_plan_must_cover_the_ranks_and_be_synchronous() -> None:
    ok = ["parallel.mode=colocated", "parallel.tp=2", "generate.num_servers=2", "rollout.max_staleness=0"]
    assert apply_plan(load_config(None, [*TINY, *ok])).parallel.mode == "colocated"
    with pytest.raises(ConfigError, match=r"parallel.mode=colocated: generate.num_servers x generate.tp = 1 x 1 "
                                          "must equal the trainer's 2 ranks"):
        apply_plan(load_config(None, [*TINY, *ok[:2], "rollout.max_staleness=0"]))
    with pytest.raises(ConfigError, match="set rollout.max_staleness=0 \\(got 2\\)"):
        apply_plan(load_config(None, [*TINY, *ok[:3], "rollout.max_staleness=2"]))


def test_realscale_plan_mode_colocated_gives_a_plan_a_colocated_run_takes(tmp_path: Path) -> None:
    cfg = _apply(_realscale_plan(tmp_path, "colocated", 2))
    assert cfg.parallel.mode == "colocated" and cfg.rollout.max_staleness == 0
    assert cfg.generate.num_servers * cfg.generate.tp == cfg.parallel.world_size == 2

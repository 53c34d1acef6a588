"""The Slurm backend's pure parts: where servers and ranks go, the srun command lines,
the allocation test, the shared-storage probe, and the launch config's checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from realscale.config import ConfigError, load_config
from realscale.errors import LaunchError
from realscale.launcher import backend_for
from realscale.launcher.dist_env import expand_hostlist
from realscale.launcher.local import LocalBackend
from realscale.launcher.render import plan_for
from realscale.launcher.roles import shared_check
from realscale.launcher.slurm import in_allocation, placement, srun_command

REPO = Path(__file__).resolve().parents[2]


def _planned(tmp_path: Path, recipe: str) -> object:
    cfg = load_config(str(REPO / "configs" / recipe))
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(plan_for(cfg).to_yaml())
    cfg.parallel.plan = str(plan_file)
    from realscale.planner.apply import apply_plan

    return apply_plan(cfg)


def test_gpu_placement_follows_the_plan(tmp_path: Path) -> None:
    cfg = _planned(tmp_path, "r1_distill_qwen_7b_math.yaml")  # 24 nodes: 18 generate, 6 train
    nodes = expand_hostlist("gpu[001-024]")
    p = placement(cfg, nodes)
    assert p.server_nodes == nodes[:18] and p.train_nodes == nodes[18:]
    assert p.servers * p.gpus_per_server == 144 and p.ranks == 48 and p.gpus_per_rank == 1
    assert not p.overlap  # GPU steps must not share GPUs
    with pytest.raises(LaunchError, match="the plan needs 24 nodes, the job has 8"):
        placement(cfg, nodes[:8])


def test_cpu_placement_and_srun_commands() -> None:
    cfg = load_config(str(REPO / "configs" / "ppo_tiny_slurm.yaml"))
    p = placement(cfg, ["vm"])
    assert (p.servers, p.ranks, p.gpus_per_rank, p.overlap) == (1, 2, 0, True)
    cmd = srun_command("rs-trainer", ["vm"], 2, "/r/logs/rank%t.log", ["python", "-m", "realscale", "rank"])
    assert cmd[:1] == ["srun"] and cmd[-4:] == ["python", "-m", "realscale", "rank"]
    for opt in ("--ntasks=2", "--nodelist=vm", "--kill-on-bad-exit=1", "--output=/r/logs/rank%t.log", "--overlap"):
        assert opt in cmd, opt
    gpu = srun_command("rs-servers", ["a", "b"], 4, "x%t", ["serve"], gpus_per_task=4, overlap=False,
                       tasks_per_node=2)
    for opt in ("--gpus-per-task=4", "--exact", "--nodes=2", "--nodelist=a,b", "--ntasks-per-node=2"):
        assert opt in gpu, opt
    assert "--overlap" not in gpu


def test_server_tasks_get_a_cpu_share_per_rank() -> None:
    """A server task of a GPU recipe gets launch.cpus_per_task per server rank (Slurm's
    default would be one CPU for a whole TP-8 SGLang server); none set: Slurm's default."""
    from realscale.launcher.slurm import server_cpus

    cfg = load_config(str(REPO / "configs" / "r1_distill_qwen_7b_math.yaml"))
    assert server_cpus(cfg) == cfg.launch.cpus_per_task * cfg.generate.tp == 12 * cfg.generate.tp
    assert server_cpus(load_config(str(REPO / "configs" / "ppo_tiny_slurm.yaml"))) == 0


def test_slurm_backend_outside_slurm_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from realscale.launcher.slurm import SlurmBackend

    for key in ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    cfg = load_config(None, ["launch.backend=slurm"])
    with pytest.raises(LaunchError, match="srun is not on PATH|not in a Slurm allocation"):
        SlurmBackend(cfg, str(tmp_path))


def test_gpu_job_without_a_plan_is_refused() -> None:
    cfg = load_config(str(REPO / "configs" / "qwen_14b_code.yaml"))
    with pytest.raises(LaunchError, match="needs parallel.plan"):
        placement(cfg, ["n1"])


def test_backend_choice() -> None:
    assert in_allocation({"SLURM_JOB_ID": "3"})  # batch script / salloc shell
    assert not in_allocation({"SLURM_JOB_ID": "3", "SLURM_STEP_ID": "0"})  # inside a step: a rank
    assert not in_allocation({})
    cfg = load_config(None, ["launch.backend=local"])
    assert isinstance(backend_for(cfg, "/tmp/x"), LocalBackend)


def test_shared_storage_probe(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    probe = tmp_path / "probe"
    probe.write_text("abc")
    shared_check(str(probe), "abc")
    shared_check(str(probe), "other")  # an old file of another job
    shared_check(str(tmp_path / "absent"), "abc")
    out = capsys.readouterr().out.split("\n")
    assert [line.split()[0] for line in out if line] == ["OK", "MISSING", "MISSING"]
    # the probe runs without torch (it starts on every node of the job)
    code = ("import sys, realscale.launcher.roles as r; r.shared_check(sys.argv[1], 'abc'); "
            "assert 'torch' not in sys.modules")
    res = subprocess.run([sys.executable, "-c", code, str(probe)], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0 and res.stdout.startswith("OK"), res.stderr


def test_launch_config_errors() -> None:
    with pytest.raises(ConfigError, match="launch.nccl: 'IB_HCA' is not an NCCL variable"):
        load_config(None, ["launch.nccl={IB_HCA: mlx5}"])
    with pytest.raises(ConfigError, match="launch.time: '3 hours' is not a Slurm time"):
        load_config(None, ["launch.time=3 hours"])
    with pytest.raises(ConfigError, match="launch.gen_fraction: must be in"):
        load_config(None, ["launch.gen_fraction=1.0"])
    with pytest.raises(ConfigError, match="launch.backend"):
        load_config(None, ["launch.backend=k8s"])
    assert load_config(None, ["launch.time=1-12:00:00"]).launch.time == "1-12:00:00"


def test_a_colocated_plan_is_one_step_of_trainer_tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU job: the rendered plan puts every role on all the job's GPUs and the placement
    starts no server step; the trainer step is the whole run."""
    from realscale.launcher import slurm
    from realscale.parallel.mesh import Mesh
    from realscale.planner.apply import apply_plan

    cfg = load_config(str(REPO / "configs" / "r1_distill_qwen_7b_math.yaml"),
                      ["parallel.mode=colocated", "rollout.max_staleness=0", "launch.nodes=2",
                       "generate.backend=embedded"])
    plan = plan_for(cfg)
    gen, train = plan.roles["actor_gen"], plan.roles["actor_train"]
    assert plan.mode == "colocated" and gen.mesh == train.mesh == Mesh(0, 16)
    (tmp_path / "plan.yaml").write_text(plan.to_yaml())
    cfg.parallel.plan = str(tmp_path / "plan.yaml")
    cfg = apply_plan(cfg)
    nodes = ["gpu1", "gpu2"]
    p = placement(cfg, nodes)
    assert (p.servers, p.server_nodes, p.train_nodes, p.ranks, p.gpus_per_rank) == (0, [], nodes, 16, 1)
    # CPU job: the same, without a plan
    tiny = load_config(str(REPO / "configs" / "ppo_tiny_slurm.yaml"),
                       ["parallel.mode=colocated", "generate.num_servers=2", "rollout.max_staleness=0"])
    assert placement(apply_plan(tiny), ["vm"]).servers == 0
    # what the backend would run: one srun, a task per trainer rank
    started: list[list[str]] = []
    monkeypatch.setattr(slurm, "start_step", lambda name, cmd, log, env: started.append(cmd))
    # srun "found"; nothing else (scontrol absent, as on a machine without Slurm: the node
    # list is then expanded by our own parser)
    monkeypatch.setattr(slurm.shutil, "which", lambda name: "/usr/bin/srun" if name == "srun" else None)
    backend = slurm.SlurmBackend(tiny, str(tmp_path / "run"), env={"SLURM_JOB_NODELIST": "vm", "SLURM_JOB_ID": "7"})
    backend.start_ranks(print, 2, ({}, "m", [], str(tmp_path / "run")))
    assert len(started) == 1 and "--ntasks=2" in started[0] and "--job-name=rs-trainer" in started[0]


def test_cpu_plan_across_nodes_places_servers_and_ranks_on_their_nodes(tmp_path: Path) -> None:
    """A CPU job across nodes with a plan: the meshes number the job's CPUs node by node
    (SLURM_CPUS_ON_NODE each), as GPU meshes number GPUs; without a plan, or one larger
    than the job (oversubscribed), everything runs everywhere."""
    from realscale.planner.apply import apply_plan

    plan = tmp_path / "plan.yaml"
    plan.write_text("mode: disaggregated\nroles:\n  actor_gen: {mesh: '0:1', strategy: d1t1p1}\n"
                    "  actor_train: {mesh: '2:4', strategy: d2t1p1}\n")
    cfg = apply_plan(load_config(str(REPO / "configs" / "ppo_tiny_slurm.yaml"), [f"parallel.plan={plan}"]))
    cpus = {"SLURM_CPUS_ON_NODE": "2"}
    p = placement(cfg, ["n1", "n2"], cpus)
    assert (p.server_nodes, p.servers, p.train_nodes, p.ranks) == (["n1"], 1, ["n2"], 2)
    assert placement(cfg, ["n1"], {"SLURM_CPUS_ON_NODE": "4"}).train_nodes == ["n1"]  # one node: as before
    cfg.launch.oversubscribe = True
    p = placement(cfg, ["n1", "n2"], {"SLURM_CPUS_ON_NODE": "1"})
    assert (p.server_nodes, p.train_nodes) == (["n1", "n2"], ["n1", "n2"])
    p = placement(load_config(str(REPO / "configs" / "ppo_tiny_slurm.yaml")), ["n1", "n2"], cpus)
    assert (p.server_nodes, p.train_nodes) == (["n1", "n2"], ["n1", "n2"])  # no plan: dp across the nodes


def test_a_multi_node_cpu_job_asks_for_tasks_per_node() -> None:
    """--ntasks alone lets Slurm split a CPU job's tasks unevenly over its nodes (3 + 1);
    the placement counts each node's CPUs, so the header asks for the same on each."""
    from realscale.launcher.render import render_sbatch

    recipe = str(REPO / "configs" / "ppo_tiny_slurm.yaml")
    two = render_sbatch("t", "r.yaml", [], load_config(recipe, ["launch.nodes=2", "launch.ntasks=3"]))
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n" in two and "--ntasks=" not in two
    one = render_sbatch("t", "r.yaml", [], load_config(recipe))
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks=2\n" in one and "ntasks-per-node" not in one


def test_an_sft_stage_is_a_step_of_ranks_named_in_its_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``realscale sft`` (and the warm start) inside an allocation: its ranks are one job
    step ``rs-sft`` on the trainer's nodes, a GPU each, whose tasks run ``realscale rank``
    with a spec naming the SFT entry; no server step, and no plan needed on a GPU job."""
    from realscale.launcher import slurm
    from realscale.launcher.roles import trainer_rank
    from realscale.launcher.spec import RunSpec, entry_name
    from realscale.sft import sft_rank

    cfg = load_config(str(REPO / "configs" / "qwen_14b_code.yaml"), ["parallel.plan=", "parallel.dp=2",
                                                                     "parallel.tp=4", "parallel.pp=2"])
    p = placement(cfg, ["g1", "g2", "g3"], ranks_only=True)  # 16 ranks, 8 GPUs a node: 2 nodes
    assert (p.servers, p.server_nodes, p.train_nodes, p.ranks, p.gpus_per_rank) == (0, [], ["g1", "g2"], 16, 1)
    with pytest.raises(LaunchError, match="the plan needs 2 nodes, the job has 1"):
        placement(cfg, ["g1"], ranks_only=True)
    started: list[tuple[str, list[str], str]] = []
    monkeypatch.setattr(slurm, "start_step", lambda name, cmd, log, env: started.append((name, cmd, log)))
    monkeypatch.setattr(slurm.shutil, "which", lambda name: "/usr/bin/srun" if name == "srun" else None)
    out = tmp_path / "sft"
    backend = slurm.SlurmBackend(cfg, str(out), env={"SLURM_JOB_NODELIST": "g[1-2]", "SLURM_JOB_ID": "7"},
                                 ranks_only=True)
    backend.start_ranks(sft_rank, 16, ({"sft": {}}, "base", [], str(out)), name="sft")
    (name, cmd, log), = started
    assert name == "sft" and log.endswith("srun-sft.log")
    for opt in ("--job-name=rs-sft", "--ntasks=16", "--nodelist=g1,g2", "--gpus-per-task=1", "--exact",
                "--ntasks-per-node=8", f"--output={out}/logs/sft-rank%t.log"):
        assert opt in cmd, (opt, cmd)
    spec_file = cmd[cmd.index("--spec") + 1]
    assert spec_file == str(out / "launch" / "sft-spec.json")
    spec = RunSpec.load(spec_file)
    assert (spec.entry, spec.model_dir, spec.server_urls, spec.out_dir) == ("realscale.sft:sft_rank", "base", [],
                                                                            str(out))
    assert entry_name(sft_rank) == spec.entry
    # `realscale rank` runs only an entry it knows, and says so before anything starts
    with pytest.raises(ValueError, match=r"entry 'realscale\.sft:sft_rank' is not one of realscale\.trainer:rank_main"):
        trainer_rank(spec_file, {"realscale.trainer:rank_main": print})

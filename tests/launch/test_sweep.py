"""Every GPU recipe dry-runs: a plan is found with 3/4 of the GPUs generating, memory per
GPU fits the GPU's HBM, and the sbatch script is rendered; the checked-in scripts and
plans are what the sweeps render now."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from realscale.config import ConfigError, load_config
from realscale.launcher.render import check_memory, plan_for, render_sbatch, split_meshes
from realscale.launcher.sweep import load_sweep, render_jobs
from realscale.parallel.mesh import LayoutError
from realscale.planner.hardware import get_gpu

REPO = Path(__file__).resolve().parents[2]
GPU_RECIPES = ["r1_distill_qwen_1.5b_math", "r1_distill_qwen_7b_math", "qwen_14b_code", "qwen_32b_code"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "realscale", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_gpu_recipe_plans_within_hbm(name: str) -> None:
    cfg = load_config(str(REPO / "configs" / f"{name}.yaml"))
    # the AReaL settings
    assert (cfg.rollout.batch_size, cfg.rollout.n_samples, cfg.optim.lr) == (512, 16, 2e-5)
    assert cfg.generate.max_new_tokens == 27648
    assert cfg.rollout.max_staleness == (8 if name.endswith("math") else 4)
    plan = plan_for(cfg)
    gen, train = plan.roles["actor_gen"], plan.roles["actor_train"]
    n = cfg.launch.nodes * cfg.launch.gpus_per_node
    assert gen.mesh.size == n * 3 // 4 and train.mesh.size == n // 4 and not gen.mesh.overlaps(train.mesh)
    hbm = get_gpu(cfg.launch.gpu).hbm_gb
    assert all(0 < pl.mem_gb <= hbm for pl in plan.roles.values()), plan.table()
    check_memory(plan, cfg)
    script = render_sbatch(name, f"configs/{name}.yaml", [], cfg, "plan.yaml")
    for line in (f"#SBATCH --nodes={cfg.launch.nodes}", "#SBATCH --gpus-per-node=8", "#SBATCH --requeue",
                 f"#SBATCH --signal=B:USR1@{cfg.launch.signal_seconds}", f"#SBATCH --time={cfg.launch.time}"):
        assert line in script.splitlines(), line
    assert f"-m realscale train configs/{name}.yaml parallel.plan=plan.yaml \"$@\"" in script
    # the recipe's NCCL settings are validated NCCL variables; nothing site-specific is
    # hard-coded (an eth0 that a cluster lacks, RoCE's GID index on InfiniBand, an HCA name
    # filter that on another fabric matches no device and drops NCCL to TCP sockets): NCCL
    # picks the bootstrap interface and its IB devices itself, the launcher sets gloo's per node
    assert "NCCL_NET_GDR_LEVEL" in cfg.launch.nccl
    assert not {"NCCL_SOCKET_IFNAME", "NCCL_IB_GID_INDEX", "NCCL_IB_HCA"} & set(cfg.launch.nccl)
    assert "GLOO_SOCKET_IFNAME" not in cfg.launch.env


def test_memory_check_refuses_a_too_small_gpu() -> None:
    cfg = load_config(str(REPO / "configs" / "qwen_32b_code.yaml"))
    plan = plan_for(cfg)
    cfg.launch.gpu = "A100"
    check_memory(plan, cfg)  # 80 GB as well: fits
    name, pl = next(iter(plan.roles.items()))
    plan.roles[name] = type(pl)(pl.mesh, pl.strategy, pl.seconds, 95.0)
    with pytest.raises(LayoutError, match=f"role {name} .*95.0 GB per GPU exceeds the 80 GB of a A100"):
        check_memory(plan, cfg)


def test_split_keeps_whole_nodes() -> None:
    gen, train = split_meshes(24, 8, 0.75)
    assert (gen.start, gen.size, train.start, train.size) == (0, 144, 144, 48)
    gen, train = split_meshes(2, 8, 0.75)
    assert (gen.size, train.size) == (8, 8)  # at least one node each
    with pytest.raises(LayoutError, match="at least 2 nodes"):
        split_meshes(1, 8, 0.75)


@pytest.mark.parametrize("sweep", ["areal_sizes", "ci_tiny"])
def test_checked_in_scripts_are_up_to_date(sweep: str) -> None:
    res = _cli("sweep", f"configs/sweeps/{sweep}.yaml", "--out", "launch/slurm", "--check")
    assert res.returncode == 0, res.stdout + res.stderr


def test_dry_run_prints_plans_and_scripts(tmp_path: Path) -> None:
    res = _cli("sweep", "configs/sweeps/areal_sizes.yaml", "--dry-run", "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    for job in ("ppo_1.5b", "ppo_7b", "ppo_14b", "ppo_32b"):
        assert f"=== job {job}:" in res.stdout
        assert f"parallel.plan={tmp_path}/out/plans/{job}.yaml" in res.stdout
    assert res.stdout.count("memory per GPU within the H800's HBM: ok") == 4
    assert res.stdout.count("#SBATCH --requeue") == 4
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_grid_sweep_renders_one_job_per_value(tmp_path: Path) -> None:
    jobs = load_sweep(str(REPO / "configs" / "sweeps" / "staleness_7b.yaml"))
    assert [j.name for j in jobs] == [f"ppo_7b-max_staleness{e}" for e in (0, 2, 4, 8)]
    assert [j.cfg.rollout.max_staleness for j in jobs] == [0, 2, 4, 8]
    assert len({j.cfg.run.name for j in jobs}) == 4  # separate run directories
    render_jobs(jobs, str(tmp_path))
    assert all(len(j.files) == 2 for j in jobs)
    assert not list(tmp_path.iterdir())  # rendering writes nothing by itself


def test_bad_sweeps_name_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "s.yaml"
    bad.write_text("jobs: {a: {recipe: configs/tiny_cpu.yaml, overrides: [rollout.max_stalenes=3]}}\n")
    with pytest.raises(ConfigError, match="job a: unknown config key 'rollout.max_stalenes'"):
        load_sweep(str(bad))
    bad.write_text("jobz: {}\n")
    with pytest.raises(ConfigError, match="unknown sweep keys"):
        load_sweep(str(bad))
    bad.write_text("jobs: {a: {recipe: configs/qwen_32b_code.yaml, overrides: [launch.nodes=1, launch.gpu=A100, "
                   "launch.gpus_per_node=1]}}\n")
    jobs = load_sweep(str(bad))
    with pytest.raises(ConfigError, match="job a: no plan"):
        render_jobs(jobs, str(tmp_path))
    res = _cli("sweep", str(tmp_path / "missing.yaml"), "--dry-run")
    assert res.returncode == 2 and "sweep file not found" in res.stderr

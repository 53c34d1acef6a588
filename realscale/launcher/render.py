"""Render a recipe into what a cluster job needs: a plan and an sbatch script.

Used by ``realscale sweep`` (one plan + one job per model size or config value) and the
source of the checked-in ``launch/slurm/ppo_*.sh`` (a test re-renders them and fails if
they drifted from their recipes).

The plan keeps the AReaL split: ``launch.gen_fraction`` of the nodes (3/4 by default)
generate and the rest train, and the planner's cost model picks the best (dp, tp, pp)
of each side within that split (exhaustively: two meshes give few choices). A
one-node job has no whole-node split, so the planner's free search decides there.
A colocated recipe (``parallel.mode: colocated``) gets a colocated plan with every role
on all the job's GPUs (each picks its own (dp, tp, pp)): the runtime's colocated mode
generates on the trainer's devices, and the job is one step of trainer tasks.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import time
from typing import TYPE_CHECKING

from realscale.parallel.mesh import Cluster, LayoutError, Mesh
from realscale.parallel.model_spec import ModelSpec, known_model, spec_from_hf_config
from realscale.planner.cost import Workload
from realscale.planner.hardware import get_gpu
from realscale.planner.plan import Plan, plan_from_search

if TYPE_CHECKING:
    from realscale.config import Config
    from realscale.planner.search import Problem


def model_spec_for(cfg: Config) -> ModelSpec:
    """The planner's view of the policy: its HF config.json when ``model.path`` is a local
    directory, else the size named by ``launch.model_size``."""

    config_json = os.path.join(cfg.model.path, "config.json")
    if os.path.isfile(config_json):
        with open(config_json, encoding="utf-8") as fh:
            return spec_from_hf_config(json.load(fh))
    if cfg.launch.model_size:
        return known_model(cfg.launch.model_size)
    raise LayoutError(f"model.path={cfg.model.path!r} is not a local model directory and launch.model_size is "
                      "empty: set launch.model_size (e.g. qwen2-7b) to plan before the weights are downloaded")


def problem_for(cfg: Config) -> Problem:
    from realscale.planner.search import Problem, default_roles

    workload = Workload(batch=cfg.rollout.batch_size, n_samples=cfg.rollout.n_samples,
                        prompt_len=cfg.data.max_prompt_tokens, gen_len=cfg.generate.max_new_tokens,
                        train_mb_tokens=cfg.train.max_tokens_per_micro_batch, minibatches=cfg.train.mini_batches,
                        max_staleness=cfg.rollout.max_staleness, sequence_parallel=cfg.parallel.sequence_parallel,
                        logprob_chunk_tokens=cfg.train.logprob_chunk_tokens)
    return Problem(model_spec_for(cfg), Cluster(cfg.launch.nodes, cfg.launch.gpus_per_node), get_gpu(cfg.launch.gpu),
                   workload, default_roles(ref=cfg.algo.kl_coef > 0, critic=cfg.algo.adv_estimator == "gae"))


def split_meshes(nodes: int, gpus_per_node: int, gen_fraction: float) -> tuple[Mesh, Mesh]:
    """Whole-node generation / training meshes, generation first, ~gen_fraction of nodes generating."""
    if nodes < 2:
        raise LayoutError("a generation / training split of whole nodes needs at least 2 nodes")
    gen_nodes = min(nodes - 1, max(1, round(nodes * gen_fraction)))
    return Mesh(0, gen_nodes * gpus_per_node), Mesh(gen_nodes * gpus_per_node, (nodes - gen_nodes) * gpus_per_node)


def plan_for(cfg: Config) -> Plan | None:
    """The plan of a GPU recipe (None for a CPU job)."""
    if cfg.launch.gpus_per_node == 0:
        return None
    from realscale.planner.search import (
        INFEASIBLE,
        MODES,
        Instance,
        SearchResult,
        _consts,
        exhaustive,
        role_options,
        search,
    )

    problem = problem_for(cfg)
    t0 = time.perf_counter()
    if cfg.parallel.mode == "colocated":
        whole = Mesh(0, cfg.launch.nodes * cfg.launch.gpus_per_node)
        mode, meshes, method = "colocated", (whole, whole), "exhaustive with every role on the whole job"
    elif cfg.launch.nodes < 2:
        return plan_from_search(search(problem, "auto"), problem)
    else:
        mode, method = "disaggregated", f"exhaustive within a {cfg.launch.gen_fraction:g} generation split"
        meshes = split_meshes(cfg.launch.nodes, cfg.launch.gpus_per_node, cfg.launch.gen_fraction)
    names = [r.name for r in problem.roles]
    opts = [role_options(problem, r, mode, [meshes[0] if r.kind == "generate" else meshes[1]]) for r in problem.roles]
    inst = Instance(opts, [[names.index(d) for d in r.deps] for r in problem.roles],
                    [{"generate": 0, "train": 1, "infer": 2}[r.kind] for r in problem.roles],
                    names.index("actor_gen"), names.index("actor_train"), MODES.index(mode),
                    problem.workload.max_staleness, _consts(problem))
    choice, seconds = exhaustive(inst)
    if seconds >= INFEASIBLE:
        raise LayoutError(f"no feasible {mode} plan with {meshes[0]} generating and {meshes[1]} training")
    result = SearchResult(mode, choice, seconds, inst, method, time.perf_counter() - t0)
    plan = plan_from_search(result, problem)
    plan.extra.pop("search_seconds", None)  # keeps rendered plans byte-identical (checked in CI)
    return plan


def check_memory(plan: Plan, cfg: Config) -> None:
    """Every role's estimated memory per GPU fits the GPU's HBM."""

    hbm = get_gpu(cfg.launch.gpu).hbm_gb
    for name, pl in plan.roles.items():
        if not math.isfinite(pl.mem_gb) or pl.mem_gb > hbm:
            raise LayoutError(f"role {name} ({pl.strategy} on {pl.mesh}): {pl.mem_gb:.1f} GB per GPU exceeds "
                              f"the {hbm:.0f} GB of a {cfg.launch.gpu}")


def render_sbatch(name: str, recipe: str, overrides: list[str], cfg: Config, plan_path: str = "") -> str:
    """The sbatch script of one job: its header from ``launch.*``, its body hands over to
    ``realscale train`` (which, inside the allocation, uses the Slurm backend)."""
    L = cfg.launch
    head = ["#!/usr/bin/env bash",
            f"# {name}: rendered by `realscale sweep` from {recipe}; change the recipe and re-render",
            "# (python -m realscale sweep configs/sweeps/<sweep>.yaml --out launch/slurm) instead of",
            "# editing this file. Extra `key=value` arguments to sbatch are passed on as overrides:",
            f"#   sbatch {os.path.join('launch', 'slurm', name + '.sh')} run.total_steps=10",
            f"#SBATCH --job-name=rs-{name}",
            f"#SBATCH --nodes={L.nodes}"]
    if L.gpus_per_node:
        head += [f"#SBATCH --gpus-per-node={L.gpus_per_node}", f"#SBATCH --ntasks-per-node={L.gpus_per_node}"]
    elif L.nodes > 1:
        # CPU job across nodes: the same tasks (CPUs) on every node; a bare --ntasks lets
        # Slurm split them unevenly (3 + 1), and the placement counts CPUs per node
        head.append(f"#SBATCH --ntasks-per-node={math.ceil((L.ntasks or cfg.parallel.world_size) / L.nodes)}")
    else:
        head.append(f"#SBATCH --ntasks={L.ntasks or cfg.parallel.world_size}")
    if L.cpus_per_task:
        head.append(f"#SBATCH --cpus-per-task={L.cpus_per_task}")
    head += [f"#SBATCH --time={L.time}",
             "#SBATCH --requeue",
             # B: the signal goes to the batch step only (the launcher), which checkpoints
             f"#SBATCH --signal=B:USR1@{L.signal_seconds}",
             "#SBATCH --open-mode=append",
             "#SBATCH --output=slurm-%x-%j.out"]
    if L.partition:
        head.append(f"#SBATCH --partition={L.partition}")
    if L.account:
        head.append(f"#SBATCH --account={L.account}")
    head += [f"#SBATCH {opt}" for opt in L.sbatch_extra]
    args = [recipe, *overrides] + ([f"parallel.plan={plan_path}"] if plan_path else [])
    body = ["",
            "set -euo pipefail",
            'cd "${SLURM_SUBMIT_DIR:-.}"  # recipes and plans are paths relative to the repository',
            'echo "realscale: job ${SLURM_JOB_ID:-?} restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-?}"',
            "# exec: the launcher itself receives the USR1 above; it starts servers and ranks as",
            "# job steps (srun), checkpoints on USR1 and requeues the job, which then resumes.",
            f'exec "${{REALSCALE_PYTHON:-{L.python}}}" -m realscale train {shlex.join(args)} "$@"',
            ""]
    return "\n".join(head + body)

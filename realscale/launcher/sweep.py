"""``realscale sweep``: many cluster jobs from one YAML file.

A sweep names jobs (a recipe + overrides each) and optionally a grid of config values;
every job x grid point becomes one job: its plan (GPU recipes, see
:mod:`realscale.launcher.render`) and its sbatch script::

    name: areal_sizes
    overrides: [run.total_steps=100]          # optional, for every job
    jobs:
      ppo_7b:  {recipe: configs/r1_distill_qwen_7b_math.yaml}
      ppo_32b: {recipe: configs/qwen_32b_code.yaml, overrides: [launch.nodes=64]}
    grid:                                     # optional: the cartesian product, per job
      rollout.max_staleness: [0, 4, 8]

A grid job is named ``<job>-<key leaf><value>`` and writes its own run directory.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from realscale.config import Config, ConfigError, load_config
from realscale.launcher.render import check_memory, plan_for, render_sbatch
from realscale.parallel.mesh import LayoutError
from realscale.planner.plan import Plan


@dataclass
class Job:
    name: str
    recipe: str
    overrides: list[str]
    cfg: Config
    plan: Plan | None = None
    script: str = ""
    files: dict[str, str] = field(default_factory=dict)  # path -> content


def _grid_points(grid: dict[str, list[Any]], origin: str) -> list[list[tuple[str, Any]]]:
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{origin}: grid.{key} must be a non-empty list of values")
    keys = list(grid)
    return [list(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))] or [[]]


def _value_text(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def load_sweep(path: str) -> list[Job]:
    """The jobs of a sweep file (configs loaded and validated, not yet planned)."""
    if not os.path.isfile(path):
        raise ConfigError(f"sweep file not found: {path}")
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    unknown = set(data) - {"name", "jobs", "grid", "overrides"}
    if unknown:
        raise ConfigError(f"{path}: unknown sweep keys {sorted(unknown)} (known: name, jobs, grid, overrides)")
    if not isinstance(data.get("jobs"), dict) or not data["jobs"]:
        raise ConfigError(f"{path}: 'jobs' must map job names to {{recipe: ..., overrides: [...]}}")
    common = [str(o) for o in data.get("overrides") or []]
    jobs = []
    for name, entry in data["jobs"].items():
        if not isinstance(entry, dict) or "recipe" not in entry:
            raise ConfigError(f"{path}: job {name!r} needs a 'recipe'")
        for point in _grid_points(data.get("grid") or {}, path):
            suffix = "".join(f"-{k.rsplit('.', 1)[-1]}{_value_text(v)}" for k, v in point)
            job_name = f"{name}{suffix}"
            overrides = common + [str(o) for o in entry.get("overrides") or []]
            overrides += [f"{k}={_value_text(v)}" for k, v in point]
            if point:
                overrides.append(f"run.name={job_name}")
            try:
                cfg = load_config(entry["recipe"], overrides)
            except ConfigError as exc:
                raise ConfigError(f"{path}: job {job_name}: {exc}") from None
            jobs.append(Job(job_name, entry["recipe"], overrides, cfg))
    return jobs


def render_jobs(jobs: list[Job], out_dir: str) -> None:
    """Plan (GPU jobs) and script of every job; the files they would write under out_dir."""

    for job in jobs:
        plan_path = ""
        try:
            job.plan = plan_for(job.cfg)
            if job.plan is not None:
                check_memory(job.plan, job.cfg)
        except LayoutError as exc:
            raise ConfigError(f"job {job.name}: no plan: {exc}") from None
        if job.plan is not None:
            plan_path = os.path.join(out_dir, "plans", f"{job.name}.yaml")
            job.files[plan_path] = job.plan.to_yaml()
        job.script = render_sbatch(job.name, job.recipe, job.overrides, job.cfg, plan_path)
        job.files[os.path.join(out_dir, f"{job.name}.sh")] = job.script


def stale_files(jobs: list[Job]) -> list[str]:
    """Rendered files that differ from what is on disk (or are missing)."""
    out = []
    for job in jobs:
        for path, content in job.files.items():
            try:
                with open(path, encoding="utf-8") as fh:
                    same = fh.read() == content
            except FileNotFoundError:
                same = False
            if not same:
                out.append(path)
    return out


def write_jobs(jobs: list[Job]) -> list[str]:
    written = []
    for job in jobs:
        for path, content in job.files.items():
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(content)
            if path.endswith(".sh"):
                os.chmod(path, 0o755)
            written.append(path)
    return written

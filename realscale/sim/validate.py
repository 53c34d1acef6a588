"""The simulator against our own measured runs (issue 19, item 2).

Two measured numbers are predicted, with a CPU profile measured by ``realscale profile``
(``benchmarks/results/cpu_profile.json``) and **nothing fitted to either number**:

1. the async/sync effective-throughput ratio of ``benchmarks/bench_async.py`` (η = 4 vs
   η = 0 on ``configs/long_tail_cpu.yaml``, geometric mean over ten seeds,
   ``benchmarks/results/async_vs_sync_seeds1-10.json``);
2. the default recipe's mean step time (``configs/tiny_cpu.yaml``, a measured
   ``realscale train`` run, ``benchmarks/results/default_recipe_run.json``).

The timings come from the profile (decode steps, per-request costs, train steps, weight
sync, the rollout side's CPU per request: each measured alone, in CPU time, see
:mod:`realscale.launcher.calibrate`); for these CPU recipes the simulator also makes the roles
share the host's cores, decodes over the batch padded to its longest context (the embedded
server's attention) and charges an abort pause per interrupted request
(:mod:`realscale.sim.des`). Result (BENCHMARKS.md): both within ±20% (the default recipe's
step against a run on a quiet machine; a run that shared the cores with other sessions' jobs
is not what the profile describes). The *workload* is not a timing and is taken
from the runs themselves, pooled over both modes: how long the generated answers were on
average, what fraction of groups the all-equal filter kept, and how long the kept answers
were. A :class:`~realscale.sim.workload.TaskMix` of the task's own answers (worked out
with probability ``q``) and a :class:`~realscale.sim.workload.Reliability` filter (worked
answers right with probability ``rho ** tokens``, short ones with ``p_bare``) reproduce
those three statistics (:func:`fit_workload`); the same workload serves both modes, so
what differs between the simulated runs is only what differs between the real ones: η.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from math import comb
from typing import TYPE_CHECKING, Any

import numpy as np

from realscale.planner.hardware import HardwareProfile, load_profile
from realscale.sim.build import Scenario
from realscale.sim.recipe import scenario_from_config, task_mix
from realscale.sim.workload import AcceptAll, Reliability, TaskMix, Workload

if TYPE_CHECKING:
    from realscale.planner.plan import Plan

BENCH_ASYNC = "benchmarks/results/async_vs_sync_seeds1-10.json"
DEFAULT_RUN = "benchmarks/results/default_recipe_run.json"
CPU_PROFILE = "benchmarks/results/cpu_profile.json"
TOLERANCE = 0.20


@dataclass(frozen=True)
class WorkloadStats:
    """What a run generated and kept, pooled (not timings)."""

    mean_generated_len: float   # tokens per finished answer
    accept_fraction: float      # groups kept by the filter / groups submitted
    mean_trained_len: float     # tokens per trained answer


def pooled_stats(runs: list[dict[str, Any]], n_samples: int) -> WorkloadStats:
    """Pool the workload statistics of runs summarised as ``bench_async.summarize_run`` does."""
    with_gen = [r for r in runs if "generated_tokens" in r]
    submitted = sum(r["submitted_groups"] for r in with_gen)
    gen = sum(r["generated_tokens"] for r in with_gen) / (n_samples * submitted)
    sub_all = sum(r["submitted_groups"] for r in runs)
    acc = (sub_all - sum(r["rejected_groups"] for r in runs)) / sub_all
    trained = sum(r["trained_tokens"] for r in runs) / sum(r["trained_trajectories"] for r in runs)
    return WorkloadStats(gen, acc, trained)


def _predicted_stats(mix: TaskMix, rho: float, p_bare: float, n: int) -> tuple[float, float]:
    """(accept fraction, mean trained length) of the mix under the filter, exactly."""
    w = np.asarray(mix.worked_lens, np.float64)
    b = np.asarray(mix.bare_lens, np.float64)
    q = mix.worked
    pw = rho ** w
    accept = np.zeros_like(w)
    kept_len = np.zeros_like(w)
    for k in range(n + 1):  # k answers of the group worked out
        pk = comb(n, k) * q ** k * (1 - q) ** (n - k)
        a = 1 - pw ** k * p_bare ** (n - k) - (1 - pw) ** k * (1 - p_bare) ** (n - k)
        accept += pk * a
        kept_len += pk * a * (k * w + (n - k) * b) / n
    return float(accept.mean()), float(kept_len.sum() / max(accept.sum(), 1e-12))


def fit_workload(task_mix: TaskMix, stats: WorkloadStats, n_samples: int) -> tuple[TaskMix, Reliability, dict]:
    """``q`` from the generated mean (closed form), then ``(rho, p_bare)`` to the kept
    fraction and kept length (grid, then refined)."""
    w_mean, b_mean = float(np.mean(task_mix.worked_lens)), float(np.mean(task_mix.bare_lens))
    q = min(1.0, max(0.0, (stats.mean_generated_len - b_mean) / (w_mean - b_mean)))
    mix = TaskMix(task_mix.bare_lens, task_mix.worked_lens, q)

    def err(rho: float, pb: float) -> float:
        a, t = _predicted_stats(mix, rho, pb, n_samples)
        return (math.log(a / stats.accept_fraction)) ** 2 + (math.log(t / stats.mean_trained_len)) ** 2

    best = min(((err(r, p), r, p) for r in 1 - np.geomspace(1e-5, 0.2, 60) for p in np.linspace(0, 1, 51)))
    _, rho, pb = best
    for scale in (0.3, 0.1, 0.03):  # local refinement around the grid optimum
        cands = [(err(min(1.0, rho * (1 + dr)), min(1.0, max(0.0, pb + dp))), min(1.0, rho * (1 + dr)),
                  min(1.0, max(0.0, pb + dp)))
                 for dr in np.linspace(-scale * (1 - rho + 1e-6), scale * (1 - rho + 1e-6), 9)
                 for dp in np.linspace(-scale * 0.1, scale * 0.1, 9)]
        _, rho, pb = min(cands)
    a, t = _predicted_stats(mix, rho, pb, n_samples)
    return mix, Reliability(rho, pb), {"worked_q": q, "rho": rho, "p_bare": pb, "fit_accept": a, "fit_trained_len": t}


def recipe_scenario(recipe: str, hw: HardwareProfile, stats: WorkloadStats,
                    overrides: list[str] | None = None, plan: Plan | None = None) -> tuple[Scenario, dict]:
    """The recipe's run on ``hw`` with the workload of its measured runs (a ``task:``
    recipe's answers fitted to ``stats``; other recipes keep their length distribution)."""
    from realscale.config import load_config

    cfg = load_config(recipe, overrides or [])
    sc = scenario_from_config(cfg, hw, plan=plan)
    info: dict[str, Any] = {"stats": stats.__dict__, "steps": cfg.run.total_steps}
    if cfg.data.source.startswith("task:"):
        mix, accept, fit = fit_workload(task_mix(cfg), stats, cfg.rollout.n_samples)
        w = sc.workload
        sc.workload = Workload(w.batch, w.n_samples, w.prompt_len, w.max_new_tokens, mix,
                               accept if cfg.rollout.filter_all_equal else AcceptAll())
        info.update(fit)
    return sc, info


def predict_bench_async(hw: HardwareProfile, bench: dict[str, Any], seeds: int = 10) -> dict[str, Any]:
    """Predicted async/sync throughput ratio of bench_async (geometric mean over sim seeds)."""
    pair = bench["pairs"][0]
    runs = [r for p in bench["pairs"] for r in p["runs"].values()]
    eta = pair["runs"]["async_eta4"]["max_staleness"]
    from realscale.config import load_config

    cfg = load_config(pair["recipe"], pair["overrides"])
    sc, fit = recipe_scenario(pair["recipe"], hw, pooled_stats(runs, cfg.rollout.n_samples), pair["overrides"])
    ratios, async_tps, sync_tps = [], [], []
    for seed in range(1, seeds + 1):
        a = sc.run(steps=pair["steps"], warmup=0, seed=seed, eta=eta)
        s = sc.run(steps=pair["steps"], warmup=0, seed=seed, eta=0)
        ratios.append(a.tokens_per_s / s.tokens_per_s)
        async_tps.append(a.tokens_per_s)
        sync_tps.append(s.tokens_per_s)
    # the measured ratio from the runs themselves (each pair: async over sync trained tokens/s)
    measured = float(math.exp(np.mean([math.log(p["runs"]["async_eta4"]["trained_tokens_per_s"]
                                                / p["runs"]["sync_eta0"]["trained_tokens_per_s"])
                                       for p in bench["pairs"]])))
    predicted = float(math.exp(np.mean(np.log(ratios))))
    per_mode = {k: float(np.mean([p["runs"][k]["trained_tokens_per_s"] for p in bench["pairs"]]))
                for k in ("async_eta4", "sync_eta0")}
    return {"measured_ratio": measured, "predicted_ratio": predicted, "error": predicted / measured - 1,
            "predicted_ratio_per_seed": ratios, "predicted_tokens_per_s": {"async": float(np.mean(async_tps)),
                                                                             "sync": float(np.mean(sync_tps))},
            "measured_tokens_per_s": per_mode, "workload": fit}


def predict_default_step(hw: HardwareProfile, run: dict[str, Any], seeds: int = 5) -> dict[str, Any]:
    """Predicted mean step time of the default recipe (steps after the first)."""
    from realscale.config import load_config

    cfg = load_config(run["recipe"], run.get("overrides", []))
    summary = run["summary"]
    sc, fit = recipe_scenario(run["recipe"], hw, pooled_stats([summary], cfg.rollout.n_samples), run.get("overrides"))
    steps = summary["steps"]
    runs = [sc.run(steps=steps, warmup=1, seed=s) for s in range(1, seeds + 1)]
    measured = (summary["rl_seconds"] - summary["step1_seconds"]) / (steps - 1)
    predicted = float(np.mean([r.step_seconds for r in runs]))
    parts = [(t.train_end - t.batch_ready, t.sync_end - t.train_end, t.wait_s) for r in runs for t in r.timeline[1:]]
    per_step = {"measured": {k: summary[k] / steps for k in ("train_s", "weight_sync_s", "wait_rollout_s")},
                "predicted": dict(zip(("train_s", "weight_sync_s", "wait_rollout_s"),
                                      (float(np.mean(col)) for col in zip(*parts))))}
    return {"measured_step_s": measured, "predicted_step_s": predicted, "error": predicted / measured - 1,
            "per_step": per_step, "workload": fit}


def validate(profile_path: str = CPU_PROFILE, bench_path: str = BENCH_ASYNC, run_path: str = DEFAULT_RUN) -> dict:
    hw = load_profile(profile_path)
    with open(bench_path, encoding="utf-8") as fh:
        bench = json.load(fh)
    with open(run_path, encoding="utf-8") as fh:
        run = json.load(fh)
    return {"profile": profile_path, "profile_load_avg": hw.measurements.get("load_avg_1_5_15"),
            "bench_async": predict_bench_async(hw, bench), "default_step": predict_default_step(hw, run),
            "tolerance": TOLERANCE}

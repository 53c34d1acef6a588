"""Does the planner's choice of mode hold up? Predicted vs measured step seconds, both modes.

    realscale profile --out benchmarks/results/cpu_profile.json      # this machine, measured
    python benchmarks/bench_plan_modes.py --profile benchmarks/results/cpu_profile.json [--steps 16]

For each workload (a recipe and overrides; both on the long-tail task, on this machine's
cores as a one-node "cluster"):

1. **predict** — the planner, with the measured CPU profile (its device constants and
   efficiencies replace the assumed ones), plans each mode (``search_mode``: the same
   search ``realscale plan --mode colocated|disaggregated`` runs) and predicts its step
   seconds; ``--mode auto``'s choice and reasons (:mod:`realscale.planner.choose`) are
   recorded. The planner's workload comes from the recipe and the task's length law, known
   before any run: B prompts x n answers, the mean prompt length of the training split, the
   mean answer length ``E[min(5 n, max_new_tokens)]`` (a worked answer is 5 tokens a step),
   and as the synchronous long tail the expected longest of the step's ``B * n`` answers.
2. **measure** — ``realscale train parallel.plan=<that plan>`` runs each mode's plan for
   ``--steps`` steps from the same warm start and seed (a colocated plan runs at η = 0, a
   disaggregated one at the recipe's η); a mode's measured step is the mean of
   ``perf/step_s`` over steps 3.. (the first steps fill the asynchronous pipeline and start
   the reward pool).
3. **compare** — per workload, whether the predicted faster mode is the measured faster one.

Writes ``benchmarks/results/plan_modes.json`` and prints predicted and measured seconds side
by side. The machine is shared: the result records ``uptime``'s load before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(REPO, "configs", "long_tail_cpu.yaml")
RESULT = os.path.join(REPO, "benchmarks", "results", "plan_modes.json")
QUICK_EVAL = ["data.task_heldout=20"]  # a small held-out evaluation (the training split does not change)
WORKLOADS: dict[str, list[str]] = {
    # the async benchmark's recipe: long-tailed answers (up to 450 tokens), 4 prompts x 4
    "long_tail": [],
    # the same task cut at 16 tokens (short, even answers), 16 prompts x 8, four PPO
    # mini-batches per step: training, not generation, is most of the work
    "short_answers": ["generate.max_new_tokens=16", "rollout.batch_size=16", "rollout.n_samples=8",
                      "train.mini_batches=4", "rollout.filter_all_equal=false"],
}


def answer_lengths(cfg: Any) -> tuple[float, float]:
    """(mean answer, expected longest of a step's answers), tokens, from the task's law."""
    import numpy as np

    from realscale.tasks.long_tail import LongTailTask

    task = LongTailTask.from_config(cfg.data)
    lengths = np.minimum(5 * np.arange(task.min_steps, task.max_steps + 1), cfg.generate.max_new_tokens)
    probs = task.step_probs()
    mean = float((lengths * probs).sum())
    k = cfg.rollout.batch_size * cfg.rollout.n_samples
    order = np.argsort(lengths)
    cdf = np.cumsum(probs[order])
    at_most = cdf ** k  # P(max of k draws <= lengths[order][i])
    p_max = np.diff(np.concatenate([[0.0], at_most]))
    return mean, float((lengths[order] * p_max).sum())


def mean_prompt_tokens(cfg: Any, model_dir: str) -> float:
    """Mean prompt length of the training split, as the workflow tokenizes it."""
    from transformers import AutoTokenizer

    from realscale.tasks.arith import prompt_ids
    from realscale.tasks.long_tail import LongTailTask

    tok = AutoTokenizer.from_pretrained(model_dir)
    train = LongTailTask.from_config(cfg.data).split("train")[:256]
    return statistics.fmean(len(prompt_ids(tok, p.prompt)) for p in train)


def problem_for(cfg: Any, model_dir: str, profile: Any, cores: int) -> Any:
    """The planner's problem for a recipe on this machine (module docstring, step 1)."""
    from realscale.parallel.mesh import Cluster
    from realscale.planner.cost import Workload
    from realscale.planner.search import Problem, default_roles
    from realscale.planner.validate import policy_spec

    mean, longest = answer_lengths(cfg)
    w = Workload(batch=cfg.rollout.batch_size, n_samples=cfg.rollout.n_samples,
                 prompt_len=max(1, round(mean_prompt_tokens(cfg, model_dir))), gen_len=max(1, round(longest)),
                 mean_gen_len=max(1, min(round(longest), round(mean))),
                 train_mb_tokens=cfg.train.max_tokens_per_micro_batch, minibatches=cfg.train.mini_batches,
                 max_staleness=cfg.rollout.max_staleness)
    return Problem(policy_spec(cfg), Cluster(1, cores), profile.gpu, w,
                   default_roles(ref=cfg.algo.kl_coef > 0, critic=cfg.algo.adv_estimator == "gae"), eff=profile.eff)


def load_measured_profile(path: str) -> Any:
    try:
        from realscale.planner.hardware import load_profile
    except ImportError:
        raise SystemExit("bench_plan_modes: this checkout has no `realscale profile` (realscale.planner.hardware."
                         "load_profile); it comes with the simulator's branch") from None
    profile = load_profile(path)
    if not any(s.kind == "measured" for s in profile.sources.values()):
        raise SystemExit(f"bench_plan_modes: {path} holds no measured constant; measure this machine with "
                         "`realscale profile`")
    return profile


def _realscale(args: list[str], log: str) -> None:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "w", encoding="utf-8") as fh:
        code = subprocess.run([sys.executable, "-m", "realscale", *args], cwd=REPO, env=env, stdout=fh,
                              stderr=subprocess.STDOUT).returncode
    if code:
        with open(log, encoding="utf-8", errors="replace") as fh:
            raise SystemExit(f"bench_plan_modes: `realscale {' '.join(args)}` failed ({code}); {log}:\n"
                             f"{fh.read()[-3000:]}")


def measured_step(run_dir: str, skip: int = 2) -> dict[str, float]:
    """Mean and median ``perf/step_s`` after the first ``skip`` steps."""
    from realscale.metrics import read_metrics

    steps = [r["perf/step_s"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "perf/step_s" in r]
    later = steps[skip:]
    if not later:
        raise SystemExit(f"bench_plan_modes: {run_dir} logged {len(steps)} steps, need more than {skip}")
    return {"mean_s": statistics.fmean(later), "median_s": statistics.median(later), "steps": len(steps)}


def run_workload(name: str, extra: list[str], args: argparse.Namespace, profile: Any, sft_dir: str
                 ) -> dict[str, Any]:
    from realscale.config import load_config
    from realscale.planner.choose import choose_mode, mode_cost
    from realscale.planner.plan import plan_from_search
    from realscale.planner.search import MODES, search_mode

    common = [RECIPE, *extra, *QUICK_EVAL, f"sft.output={sft_dir}", f"run.seed={args.seed}",
              f"run.total_steps={args.steps}", f"run.output_dir={args.work}"]
    cfg = load_config(RECIPE, common[1:])
    problem = problem_for(cfg, sft_dir, profile, args.cores)
    _, why = choose_mode(problem)
    out: dict[str, Any] = {"overrides": extra, "workload": problem.workload.__dict__, "auto": why, "modes": {}}
    print("\n".join([f"== {name}", *why]), flush=True)
    for mode in MODES:
        result = search_mode(problem, mode)
        plan = plan_from_search(result, problem)
        plan_path = os.path.join(args.work, f"{name}_{mode}.yaml")
        with open(plan_path, "w", encoding="utf-8") as fh:
            fh.write(plan.to_yaml())
        run = f"{name}_{mode}"
        shutil.rmtree(os.path.join(args.work, run), ignore_errors=True)
        _realscale(["train", *common, f"run.name={run}", f"parallel.plan={plan_path}"],
                   os.path.join(args.work, f"{run}.log"))
        measured = measured_step(os.path.join(args.work, run))
        out["modes"][mode] = {"plan": {k: str(v.strategy) for k, v in plan.roles.items()},
                              "predicted_s": result.step_seconds, "terms": mode_cost(result).__dict__,
                              "measured": measured}
        print(f"  {mode}: predicted {result.step_seconds:.3f} s, measured {measured['mean_s']:.3f} s/step", flush=True)
    by = out["modes"]
    out["predicted_faster"] = min(by, key=lambda m: by[m]["predicted_s"])
    out["measured_faster"] = min(by, key=lambda m: by[m]["measured"]["mean_s"])
    out["order_matches"] = out["predicted_faster"] == out["measured_faster"]
    return out


def table(result: dict[str, Any]) -> str:
    rows = [("workload", "mode", "plan", "predicted s/step", "measured s/step", "pred / meas")]
    for name, w in result["workloads"].items():
        for mode, m in w["modes"].items():
            plan = " ".join(f"{k} {v}" for k, v in m["plan"].items())
            rows.append((name, mode, plan, f"{m['predicted_s']:.3f}", f"{m['measured']['mean_s']:.3f}",
                         f"{m['predicted_s'] / m['measured']['mean_s']:.2f}"))
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, width)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in width))
    for name, w in result["workloads"].items():
        lines.append(f"{name}: predicted faster {w['predicted_faster']}, measured faster {w['measured_faster']} "
                     f"({'order matches' if w['order_matches'] else 'ORDER DIFFERS'})")
    return "\n".join(lines)


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="measured hardware profile JSON (`realscale profile`)")
    ap.add_argument("--steps", type=int, default=16, help="RL steps per run")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="devices of the one-node plan")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work", default=os.path.join(REPO, "runs", "bench_plan_modes"))
    ap.add_argument("--sft", default="", help="reuse this warm start of the recipe (default: make one in --work)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, from " + ", ".join(WORKLOADS))
    ap.add_argument("--out", default=RESULT)
    args = ap.parse_args()
    names = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown or args.steps < 4:
        raise SystemExit(f"bench_plan_modes: unknown workloads {unknown} or --steps < 4")
    sys.path.insert(0, REPO)
    profile = load_measured_profile(args.profile)
    args.work = os.path.abspath(args.work)
    os.makedirs(args.work, exist_ok=True)
    sft_dir = os.path.abspath(args.sft) if args.sft else os.path.join(args.work, "sft")
    load = {"start": _uptime()}
    if not os.path.isfile(os.path.join(sft_dir, "model.safetensors")):
        print(f"warm start (realscale sft) -> {sft_dir}", flush=True)
        # the runs' evaluation settings too: the held-out split is part of what a warm start
        # was made with, and a run refuses a warm start made with other settings
        _realscale(["sft", RECIPE, *QUICK_EVAL, f"sft.output={sft_dir}", f"run.seed={args.seed}"],
                   os.path.join(args.work, "sft.log"))
    t0 = time.perf_counter()
    result = {"benchmark": "plan_modes", "command": "python benchmarks/bench_plan_modes.py " + " ".join(sys.argv[1:]),
              "profile": args.profile, "steps": args.steps, "cores": args.cores,
              "workloads": {n: run_workload(n, WORKLOADS[n], args, profile, sft_dir) for n in names}}
    load["end"] = _uptime()
    result.update({"uptime": load, "benchmark_seconds": time.perf_counter() - t0})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1, default=str)
    print(table(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

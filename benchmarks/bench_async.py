"""Asynchronous vs synchronous RL: effective training throughput, same machine, same recipe.

    python benchmarks/bench_async.py [--recipe configs/long_tail_cpu.yaml] [--eta 4] [--steps N]
    python benchmarks/bench_async.py --seeds 5,6,7 --out benchmarks/results/async_vs_sync_seeds.json
    python benchmarks/bench_async.py --combine A.json B.json ... --out COMBINED.json
    python benchmarks/bench_async.py --colocated --seeds 11,12 --out benchmarks/results/async_vs_colocated.json

One warm start (``realscale sft``, shared), then two ``realscale train`` runs of the same
recipe with the same seeds and the same number of steps (so the same number of trained
groups and trajectories), one after the other: ``rollout.max_staleness = eta`` (async)
and ``= 0`` (synchronous RL through the same code). Each run starts from a fresh run
directory (a stale one would be resumed).

What is timed: the RL phase only, from the trainer's first ``get_batch`` call to the end
of the last weight push, i.e. the sum of the steps' ``perf/step_s`` (the step loop runs
them back to back; the recipe saves no checkpoint before the last step). Excluded: the
SFT warm start, generation-server and trainer start-up, the held-out evaluations, the final
checkpoint and HF export. Effective training throughput = trained tokens (response tokens
with loss mask 1, summed over steps) / that time. Accuracy, at equal trained samples: the
held-out accuracy of each run's final weights (greedy and sampled, ``summary.json``) and, on
the long-tail task, ``task_accuracy``: the same weights on every length of the task, stratified
(the held-out split has one problem per length, so one short problem can move it by up to 25
points; the stratified set caps any problem at a tenth of its length's weight).

``--colocated`` adds a third run, the stronger synchronous baseline (verl's and ReaL's): η = 0
in colocated mode on the same cores, every core training and then every core generating
(``parallel.plan``: a colocated plan of ``C`` ranks, ``C`` = the disaggregated runs' trainer
ranks + server ranks; training ``d{C}t1p1``, generation ``C`` one-rank replicas). The
η = 0 run on the disaggregated layout leaves the servers' cores idle while the trainer works
and the trainer's while they generate (AReaL's "sync" baseline); the colocated one does not.
Both ratios are reported side by side: async / sync and async / colocated.

Writes ``benchmarks/results/async_vs_sync.json`` and prints a table. With ``--seeds`` it runs
one pair per seed (each with its own warm start, under ``--work/seed<N>``) and judges the bar on
the seeds together (``aggregate``: geometric-mean throughput ratio, mean accuracy gaps), since a
single pair of this recipe is a noisy draw; ``--combine`` aggregates pair results already written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from collections import Counter
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RECIPE = os.path.join(REPO, "configs", "long_tail_cpu.yaml")
RESULT = os.path.join(REPO, "benchmarks", "results", "async_vs_sync.json")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import run_realscale  # noqa: E402 - benchmarks/ is not a package


def _realscale(args: list[str], log_path: str) -> float:
    """Run ``python -m realscale ARGS`` from this checkout, output to ``log_path``; seconds taken."""
    return run_realscale(args, log_path, "bench_async")


def _load_avg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def summarize_run(run_dir: str, steps: int) -> dict[str, Any]:
    """Throughput and accuracy of one finished run, from its metrics.jsonl and summary.json."""
    sys.path.insert(0, REPO)
    from realscale.metrics import read_metrics

    records = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "perf/step_s" in r]
    if len(records) != steps:
        raise SystemExit(f"bench_async: {run_dir} logged {len(records)} training steps, expected {steps}")
    total = lambda key: float(sum(r[key] for r in records))  # noqa: E731
    rl_seconds = total("perf/step_s")
    tokens = total("perf/trained_tokens")
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as fh:
        summary = json.load(fh)
    last = records[-1]
    generated_groups = int(last.get("rollout_ctl/submitted", 0))
    generated_tokens = int(last.get("rollout_ctl/generated_tokens", 0))
    later = records[1:]  # without step 1: pipeline fill and one-off costs (reward pool start, first update)
    later_seconds = float(sum(r["perf/step_s"] for r in later))
    return {
        "rl_seconds": rl_seconds,
        "step1_seconds": float(records[0]["perf/step_s"]),
        "step1_train_s": float(records[0]["perf/train_s"]),
        "trained_tokens_per_s_after_step1": float(sum(r["perf/trained_tokens"] for r in later)) / later_seconds,
        "trained_tokens": tokens,
        "trained_tokens_per_s": tokens / rl_seconds,
        "trained_trajectories": int(total("rollout/trajectories")),
        # every finished answer's model tokens by the last step log, filtered-out and still
        # buffered groups included: the servers' work rate, which trained tokens/s understates
        # when the all-equal filter drops most groups
        "generated_tokens": generated_tokens,
        "generated_tokens_per_s": generated_tokens / rl_seconds,
        "trained_groups": int(total("rollout/groups")),
        "wait_rollout_s": total("perf/wait_rollout_s"),
        "train_s": total("perf/train_s"),
        "weight_sync_s": total("perf/weight_sync_s"),
        "mean_response_len": sum(r["rollout/response_len"] for r in records) / len(records),
        "max_response_len": max(r["rollout/response_len_max"] for r in records),
        "interruptions": int(total("rollout/interruptions")),
        "due_waits": int(last.get("rollout_ctl/due_waits", 0)),
        "stale_dropped": int(last.get("rollout_ctl/rejected_stale", 0)),
        "submitted_groups": generated_groups,
        "rejected_groups": int(last.get("rollout_ctl/rejected", 0)),
        "staleness_hist": {str(k): v for k, v in sorted(Counter(
            {int(k): int(v) for k, v in summary.get("staleness_hist", {}).items()}).items())},
        "staleness_max": max(r["staleness/max"] for r in records),
        "accuracy_start": summary["accuracy_start"],
        "accuracy_end": summary["accuracy_end"],
        "reward_first": records[0]["reward/mean"],
        "reward_last": records[-1]["reward/mean"],
        "total_seconds": summary["seconds"],
    }


TASK_EVAL_BUDGET = 1200  # sampled answers, as many as the trainer's held-out evaluation (300 x 4)


def task_accuracy(model_dir: str, cfg: Any, budget: int = TASK_EVAL_BUDGET) -> dict[str, float] | None:
    """Accuracy of ``model_dir`` under the long-tail task's law, stratified by length.

    ``LongTailTask.length_strata``: every length, its start digits in turn, weighted by P(n);
    greedy (each distinct problem once) and sampled (one answer per stratum entry, at the
    recipe's temperature). The run's own held-out numbers are draws from one problem per
    length, so a single short problem moves them by up to 25 points (P(2)); this estimate
    gives each problem at most a tenth of its length's weight. None for other tasks.
    """
    sys.path.insert(0, REPO)
    from realscale.eval import generate_completions
    from realscale.tasks.arith import is_correct, prompt_ids, task_from_config
    from realscale.tasks.long_tail import LongTailTask
    from transformers import AutoTokenizer

    task = task_from_config(cfg.data)  # the rule that picks the task from data.source
    if not isinstance(task, LongTailTask):
        return None
    strata = task.length_strata(budget)
    tok = AutoTokenizer.from_pretrained(model_dir)
    distinct = sorted({p for _, _, problems in strata for p in problems}, key=lambda p: (p.steps, p.start))
    greedy_out = generate_completions(model_dir, [prompt_ids(tok, p.prompt) for p in distinct],
                                      max_new_tokens=cfg.generate.max_new_tokens)
    greedy_right = {p: is_correct(o[0], p.answer) for p, o in zip(distinct, greedy_out)}
    entries = [p for _, _, problems in strata for p in problems]
    sampled_out = generate_completions(model_dir, [prompt_ids(tok, p.prompt) for p in entries],
                                       temperature=cfg.generate.temperature,
                                       max_new_tokens=cfg.generate.max_new_tokens, seed=cfg.run.seed)
    sampled_right = iter(is_correct(o[0], p.answer) for p, o in zip(entries, sampled_out))
    greedy = sampled = 0.0
    for _, weight, problems in strata:
        greedy += weight * sum(greedy_right[p] for p in problems) / len(problems)
        sampled += weight * sum(next(sampled_right) for _ in problems) / len(problems)
    return {"greedy": greedy, "sampled": sampled, "greedy_problems": len(distinct), "sampled_answers": len(entries)}


def _add_task_accuracy(pair: dict[str, Any]) -> None:
    """Evaluate the pair's two final models (``task_accuracy``) and add the gap, in place."""
    sys.path.insert(0, REPO)
    from realscale.config import load_config

    cfg = load_config(os.path.join(REPO, pair["recipe"]), [*pair.get("overrides", []), f"run.seed={_seed_of(pair)}"])
    for mode in ("async", "sync", "colocated")[:3 if _has_colocated(pair) else 2]:
        run = _run(pair, mode)
        run_dir = run.get("run_dir") or _run_dir_of(pair, mode)
        final = os.path.join(run_dir, "final")
        if not os.path.isfile(os.path.join(final, "model.safetensors")):
            raise SystemExit(f"bench_async: no final model at {final} to evaluate")
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as fh:
            if json.load(fh)["accuracy_end"] != run["accuracy_end"]:  # a later benchmark reused the directory
                raise SystemExit(f"bench_async: {run_dir} no longer holds the run this result describes "
                                 "(its summary.json's accuracy_end differs)")
        run["task_accuracy_end"] = _cached_task_accuracy(run_dir, final, cfg)
    a, s = _run(pair, "async")["task_accuracy_end"], _run(pair, "sync")["task_accuracy_end"]
    if a is not None:
        pair["task_accuracy_gap_points"] = {k: 100 * (a[k] - s[k]) for k in ("greedy", "sampled")}
        if _has_colocated(pair):
            c = _run(pair, "colocated")["task_accuracy_end"]
            pair["task_accuracy_gap_vs_colocated_points"] = {k: 100 * (a[k] - c[k]) for k in ("greedy", "sampled")}


def _has_colocated(pair: dict[str, Any]) -> bool:
    return any(k.startswith("colocated") for k in pair["runs"])


def colocated_plan(cfg: Any, path: str) -> list[str]:
    """Write the colocated plan of the cores the disaggregated runs use (trainer ranks +
    server ranks; module docstring) to ``path``; the overrides that run it."""
    cores = cfg.parallel.world_size + cfg.generate.num_servers * cfg.generate.tp
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(f"mode: colocated\ncluster: {{nodes: 1, gpus_per_node: {cores}, gpu: cpu}}\nroles:\n"
                 f"  actor_gen:   {{mesh: \"0:{cores}\", strategy: d{cores}t1p1}}\n"
                 f"  actor_train: {{mesh: \"0:{cores}\", strategy: d{cores}t1p1}}\n")
    return [f"parallel.plan={path}"]


def _cached_task_accuracy(run_dir: str, final: str, cfg: Any) -> dict[str, float] | None:
    """``task_accuracy`` of a run's final weights, kept in the run directory so that a second
    ``--combine`` (or one that stopped half way) does not evaluate them again."""
    path = os.path.join(run_dir, "task_accuracy.json")
    key = {"budget": TASK_EVAL_BUDGET, "seed": cfg.run.seed, "temperature": cfg.generate.temperature}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            cached = json.load(fh)
        if cached.get("key") == key:
            return cached["accuracy"]
    accuracy = task_accuracy(final, cfg)
    _write(path, {"key": key, "accuracy": accuracy})
    return accuracy


def _run_dir_of(pair: dict[str, Any], mode: str) -> str:
    """Run directory of a pair written before results recorded it: from its command's --work
    (and --seeds: one directory per seed)."""
    words = pair["command"].split()
    work = words[words.index("--work") + 1] if "--work" in words else os.path.join("runs", "bench_async")
    if "--seeds" in words:
        work = os.path.join(work, f"seed{_seed_of(pair)}")
    return os.path.join(REPO, work, _run_name(pair, mode))


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default=DEFAULT_RECIPE, help="YAML recipe (default: configs/long_tail_cpu.yaml)")
    ap.add_argument("--eta", type=int, default=4, help="staleness bound of the asynchronous run (the other is 0)")
    ap.add_argument("--steps", type=int, default=0, help="RL steps per run (0: the recipe's run.total_steps)")
    ap.add_argument("--work", default=os.path.join(REPO, "runs", "bench_async"), help="run directories go here")
    ap.add_argument("--reuse-sft", action="store_true", help="keep an existing warm start in --work (default: redo it)")
    ap.add_argument("--seeds", default="",
                    help="comma-separated run.seed values: one pair per seed (own warm start, in --work/seed<N>), "
                         "then the seeds' aggregate (default: one pair at the recipe's seed)")
    ap.add_argument("--combine", nargs="+", default=None, metavar="RESULT_JSON",
                    help="run nothing: aggregate the pairs in these result files (single pairs or --seeds "
                         "results) into --out")
    ap.add_argument("--task-eval", action="store_true",
                    help="with --combine: evaluate each pair's final models on the length-stratified task set "
                         "(task_accuracy) where its result has no such figures")
    ap.add_argument("--colocated", action="store_true",
                    help="also run eta=0 in colocated mode on the same cores (module docstring) and report "
                         "async / colocated beside async / sync")
    ap.add_argument("--out", default=RESULT, help="result JSON")
    ap.add_argument("overrides", nargs="*", help="dotted overrides applied to both runs, e.g. rollout.batch_size=8")
    args = ap.parse_args()
    if args.eta < 1:
        raise SystemExit(f"bench_async: --eta must be >= 1 (the synchronous run is eta=0), got {args.eta}")
    if not os.path.isfile(args.recipe):
        raise SystemExit(f"bench_async: recipe not found: {args.recipe}")
    try:
        args.seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"bench_async: --seeds must be comma-separated integers, got {args.seeds!r}") from None
    if args.task_eval and not args.combine:
        raise SystemExit("bench_async: --task-eval goes with --combine (pairs it runs are evaluated anyway)")
    if args.seeds and any(o.startswith("run.seed=") for o in args.overrides):
        raise SystemExit("bench_async: give the seeds either as --seeds or as a run.seed= override, not both")
    return args


def run_pair(recipe: str, overrides: list[str], eta: int, steps: int, work: str, reuse_sft: bool,
             colocated: bool = False) -> dict[str, Any]:
    """One warm start (or a reused one) and the two runs, async then sync (then, with
    ``colocated``, the colocated synchronous run); the pair's result."""
    sys.path.insert(0, REPO)
    from realscale.config import load_config

    cfg = load_config(recipe, overrides)
    steps = steps or cfg.run.total_steps
    work = os.path.abspath(work)
    os.makedirs(work, exist_ok=True)
    sft_dir = os.path.join(work, "sft")
    common = [recipe, *overrides, f"sft.output={sft_dir}", f"run.output_dir={work}", f"run.total_steps={steps}"]

    t_all = time.perf_counter()
    load = {"start": _load_avg()}
    if not (reuse_sft and os.path.isfile(os.path.join(sft_dir, "model.safetensors"))):
        shutil.rmtree(sft_dir, ignore_errors=True)
        print(f"warm start (realscale sft) -> {sft_dir}", flush=True)
        _realscale(["sft", *common], os.path.join(work, "sft.log"))
    runs: dict[str, dict[str, Any]] = {}
    plan = [(f"async_eta{eta}", eta, []), ("sync_eta0", 0, [])]
    if colocated:
        plan.append(("colocated_eta0", 0, colocated_plan(cfg, os.path.join(work, "colocated_plan.yaml"))))
    for name, run_eta, extra in plan:
        run_dir = os.path.join(work, name)
        shutil.rmtree(run_dir, ignore_errors=True)  # a leftover run directory would be resumed
        print(f"{name}: realscale train, rollout.max_staleness={run_eta} {' '.join(extra)}, {steps} steps", flush=True)
        seconds = _realscale(["train", *common, f"run.name={name}", f"rollout.max_staleness={run_eta}", *extra],
                             os.path.join(work, f"{name}.log"))
        runs[name] = {"max_staleness": run_eta, "run_dir": run_dir, "wall_seconds": seconds, "overrides": extra,
                      **summarize_run(run_dir, steps)}
        load[name] = _load_avg()
        print(f"  {runs[name]['rl_seconds']:.1f} s RL phase, {runs[name]['trained_tokens_per_s']:.1f} trained tok/s",
              flush=True)

    a, s = runs[f"async_eta{eta}"], runs["sync_eta0"]
    if len({r["trained_trajectories"] for r in runs.values()}) != 1:
        raise SystemExit("bench_async: the runs trained different numbers of samples: "
                         f"{ {k: r['trained_trajectories'] for k, r in runs.items()} }")
    ratio = a["trained_tokens_per_s"] / s["trained_tokens_per_s"]
    ratio_later = a["trained_tokens_per_s_after_step1"] / s["trained_tokens_per_s_after_step1"]
    acc_gap = {k: 100 * (a["accuracy_end"][k] - s["accuracy_end"][k]) for k in a["accuracy_end"]}
    # Samples/s as well as tokens/s: the two runs train the same number of answers, but not
    # necessarily of the same mean length, and tokens/s alone would reward training longer ones.
    sample_ratio = s["rl_seconds"] / a["rl_seconds"]
    pair = {
        "benchmark": "async_vs_sync",
        "command": _command(),
        "recipe": os.path.relpath(recipe, REPO),
        "overrides": overrides,
        "seed": cfg.run.seed,
        "eta": eta,
        "steps": steps,
        "timed": "sum of perf/step_s over all RL steps: first get_batch to the end of the last weight push "
                 "(excludes SFT, server/trainer start-up, evaluation, final checkpoint and export)",
        "throughput_ratio": ratio,
        "throughput_ratio_after_step1": ratio_later,
        "trained_samples_per_s_ratio": sample_ratio,
        "accuracy_gap_points": acc_gap,
        # The issue's bar, on every accuracy the runs report (greedy and sampled): a gap on
        # either is a gap.
        "accuracy_within_2_points": all(abs(g) <= 2.0 for g in acc_gap.values()),
        "runs": runs,
        "machine": _machine(load),
    }
    if colocated:
        c = runs["colocated_eta0"]
        pair.update({"throughput_ratio_vs_colocated": a["trained_tokens_per_s"] / c["trained_tokens_per_s"],
                     "throughput_ratio_colocated_vs_sync": c["trained_tokens_per_s"] / s["trained_tokens_per_s"],
                     "trained_samples_per_s_ratio_vs_colocated": c["rl_seconds"] / a["rl_seconds"],
                     "accuracy_gap_vs_colocated_points": {k: 100 * (a["accuracy_end"][k] - c["accuracy_end"][k])
                                                          for k in a["accuracy_end"]}})
    _add_task_accuracy(pair)
    pair["benchmark_seconds"] = time.perf_counter() - t_all
    return pair


def _machine(load: dict[str, list[float]]) -> dict[str, Any]:
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "load_avg_1_5_15": load}


def aggregate(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """The seeds' verdict from single-pair results (``run_pair``'s dicts).

    One pair is one draw: its trained tokens/s ratio moved from 1.3x to 3.6x and its sampled
    accuracy gap from -4 to +1 points between seeds of the same recipe (BENCHMARKS.md), while
    the held-out split alone gives a gap a standard error of ~1 point. So the bar is judged on
    the seeds together: the geometric mean of the per-seed throughput ratios (ratios multiply,
    and each seed counts once) and the mean accuracy gap, each accuracy on its own. Pooled
    throughput (all trained tokens over all RL seconds, per mode) and the spread are reported
    with them.
    """
    if not pairs:
        raise ValueError("aggregate: no pair results")
    etas = {p["eta"] for p in pairs if "eta" in p}
    if len(etas) > 1:
        raise ValueError(f"aggregate: pairs ran at different eta: {sorted(etas)}")
    ratios = [p["throughput_ratio"] for p in pairs]
    geomean = _geomean(ratios)
    runs = [(_run(p, "async"), _run(p, "sync")) for p in pairs]
    pooled = ((sum(a["trained_tokens"] for a, _ in runs) / sum(a["rl_seconds"] for a, _ in runs))
              / (sum(s["trained_tokens"] for _, s in runs) / sum(s["rl_seconds"] for _, s in runs)))
    gaps = _gap_stats([p["accuracy_gap_points"] for p in pairs])
    task = [p.get("task_accuracy_gap_points") for p in pairs]
    task_gaps = _gap_stats(task) if all(task) else None
    out = {
        "seeds": [_seed_of(p) for p in pairs],
        "per_seed": [{"seed": _seed_of(p), "throughput_ratio": p["throughput_ratio"],
                      "trained_samples_per_s_ratio": p["trained_samples_per_s_ratio"],
                      "accuracy_gap_points": p["accuracy_gap_points"],
                      "task_accuracy_gap_points": p.get("task_accuracy_gap_points")} for p in pairs],
        "throughput_ratio_geomean": geomean,
        "throughput_ratio_min": min(ratios),
        "throughput_ratio_max": max(ratios),
        "throughput_ratio_pooled": pooled,
        "trained_samples_per_s_ratio_geomean": _geomean([p["trained_samples_per_s_ratio"] for p in pairs]),
        "accuracy_gap_points": gaps,
        "throughput_at_least_2x": geomean >= 2.0,
        "accuracy_within_2_points": all(abs(g["mean"]) <= 2.0 for g in gaps.values()),
        "task_accuracy_gap_points": task_gaps,
        "task_accuracy_within_2_points": (None if task_gaps is None
                                          else all(abs(g["mean"]) <= 2.0 for g in task_gaps.values())),
    }
    if all(_has_colocated(p) for p in pairs):
        out["vs_colocated"] = _vs_colocated(pairs)
    return out


def _vs_colocated(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """The same verdict against the colocated synchronous run (pairs run with --colocated),
    and how much faster that baseline is than the disaggregated one."""
    ratios = [p["throughput_ratio_vs_colocated"] for p in pairs]
    task = [p.get("task_accuracy_gap_vs_colocated_points") for p in pairs]
    return {"throughput_ratio_geomean": _geomean(ratios), "throughput_ratio_min": min(ratios),
            "throughput_ratio_max": max(ratios),
            "colocated_vs_sync_geomean": _geomean([p["throughput_ratio_colocated_vs_sync"] for p in pairs]),
            "trained_samples_per_s_ratio_geomean": _geomean([p["trained_samples_per_s_ratio_vs_colocated"]
                                                             for p in pairs]),
            "accuracy_gap_points": _gap_stats([p["accuracy_gap_vs_colocated_points"] for p in pairs]),
            "task_accuracy_gap_points": _gap_stats(task) if all(task) else None}


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _gap_stats(per_pair: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Mean, sd, standard error and range of each accuracy gap over the pairs."""
    n = len(per_pair)
    stats: dict[str, dict[str, float]] = {}
    for key in per_pair[0]:
        values = [g[key] for g in per_pair]
        mean = sum(values) / n
        sd = statistics.stdev(values) if n > 1 else float("nan")
        stats[key] = {"mean": mean, "sd": sd, "se": sd / math.sqrt(n), "min": min(values), "max": max(values)}
    return stats


def _seed_of(pair: dict[str, Any]) -> int:
    """The pair's run.seed (results written before pairs recorded it: from its overrides)."""
    if "seed" in pair:
        return pair["seed"]
    given = [o.split("=", 1)[1] for o in pair.get("overrides", []) if o.startswith("run.seed=")]
    if given:
        return int(given[-1])
    sys.path.insert(0, REPO)
    from realscale.config import load_config

    return load_config(os.path.join(REPO, pair["recipe"]), pair.get("overrides", [])).run.seed


def _run_name(pair: dict[str, Any], mode: str) -> str:
    """The key of the pair's ``mode`` ("async" or "sync") run, e.g. ``async_eta4``."""
    names = [k for k in pair["runs"] if k.startswith(mode)]
    if len(names) != 1:
        raise ValueError(f"aggregate: pair result has no single {mode} run: {sorted(pair['runs'])}")
    return names[0]


def _run(pair: dict[str, Any], mode: str) -> dict[str, Any]:
    """The pair's async or sync run record."""
    return pair["runs"][_run_name(pair, mode)]


def _command() -> str:
    """This invocation, as the result files record it."""
    return "python benchmarks/bench_async.py " + " ".join(sys.argv[1:])


def _write(path: str, result: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    os.replace(tmp, path)  # a crash mid-write leaves the previous file, not half of one


def main() -> int:
    args = _parse_args()
    if args.combine:
        pairs = []
        for path in args.combine:
            with open(path, encoding="utf-8") as fh:
                loaded = json.load(fh)
            for pair in loaded.get("pairs", [loaded]):  # a --seeds result holds its pairs
                if args.task_eval and "task_accuracy_gap_points" not in pair:
                    print(f"task accuracy of seed {_seed_of(pair)}'s final models ({path})", flush=True)
                    _add_task_accuracy(pair)
                pairs.append(pair)
        result = {"benchmark": "async_vs_sync_seeds", "command": _command(), "combined": args.combine,
                  "aggregate": aggregate(pairs), "pairs": pairs}
        _write(args.out, result)
        print(_seeds_table(result["aggregate"], args.eta))
        print(f"wrote {args.out}")
        return 0
    if not args.seeds:
        result = run_pair(args.recipe, args.overrides, args.eta, args.steps, args.work, args.reuse_sft, args.colocated)
        _write(args.out, result)
        print(_table(result, args.eta))
        print(f"wrote {args.out}")
        return 0
    t_all = time.perf_counter()
    pairs: list[dict[str, Any]] = []
    for seed in args.seeds:
        print(f"== seed {seed}", flush=True)
        pair = run_pair(args.recipe, [*args.overrides, f"run.seed={seed}"], args.eta, args.steps,
                        os.path.join(args.work, f"seed{seed}"), args.reuse_sft, args.colocated)
        print(_table(pair, args.eta), flush=True)
        pairs.append(pair)
        # after every seed, so a crash or Ctrl-C later keeps the pairs already run
        agg = aggregate(pairs)
        _write(args.out, {"benchmark": "async_vs_sync_seeds", "command": _command(), "aggregate": agg,
                          "pairs": pairs, "complete": len(pairs) == len(args.seeds),
                          "benchmark_seconds": time.perf_counter() - t_all})
    print(_seeds_table(agg, args.eta))
    print(f"wrote {args.out}")
    return 0


def _seeds_table(agg: dict[str, Any], eta: int) -> str:
    task = agg.get("task_accuracy_gap_points")
    heads = [f"held-out {k}" for k in agg["accuracy_gap_points"]] + [f"task {k}" for k in (task or {})]
    lines = [f"{'seed':>6} | {'tok/s ratio':>11} | {'samples/s ratio':>15} | " + " | ".join(f"{h:>16}" for h in heads)]
    for row in agg["per_seed"]:
        gaps = [*row["accuracy_gap_points"].values(), *(row.get("task_accuracy_gap_points") or {}).values()]
        lines.append(f"{str(row['seed']):>6} | {row['throughput_ratio']:>10.2f}x | "
                     f"{row['trained_samples_per_s_ratio']:>14.2f}x | " + " | ".join(f"{g:>+16.1f}" for g in gaps))
    lines.append(f"eta={eta} vs 0 over {len(agg['per_seed'])} seeds: trained tokens/s ratio geometric mean "
                 f"{agg['throughput_ratio_geomean']:.2f}x (range {agg['throughput_ratio_min']:.2f}-"
                 f"{agg['throughput_ratio_max']:.2f}x, pooled {agg['throughput_ratio_pooled']:.2f}x; "
                 f"{'meets' if agg['throughput_at_least_2x'] else 'misses'} 2x)")
    lines.append(f"mean accuracy gap (async - sync), held-out: {_gap_line(agg['accuracy_gap_points'])} "
                 f"({'within' if agg['accuracy_within_2_points'] else 'outside'} 2 points)")
    if task:
        lines.append(f"mean accuracy gap (async - sync), task (length-stratified): {_gap_line(task)} "
                     f"({'within' if agg['task_accuracy_within_2_points'] else 'outside'} 2 points)")
    if "vs_colocated" in agg:
        c = agg["vs_colocated"]
        lines.append(f"eta={eta} vs colocated eta=0 (same cores): trained tokens/s ratio geometric mean "
                     f"{c['throughput_ratio_geomean']:.2f}x (range {c['throughput_ratio_min']:.2f}-"
                     f"{c['throughput_ratio_max']:.2f}x); colocated / disaggregated sync "
                     f"{c['colocated_vs_sync_geomean']:.2f}x")
        lines.append(f"mean accuracy gap (async - colocated), held-out: {_gap_line(c['accuracy_gap_points'])}"
                     + (f"; task: {_gap_line(c['task_accuracy_gap_points'])}" if c["task_accuracy_gap_points"] else ""))
    return "\n".join(lines)


def _gap_line(stats: dict[str, dict[str, float]]) -> str:
    return ", ".join(f"{k} {g['mean']:+.1f} (sd {g['sd']:.1f}, se {g['se']:.1f})" for k, g in stats.items())


def _table(result: dict[str, Any], eta: int) -> str:
    runs = [result["runs"][f"async_eta{eta}"], result["runs"]["sync_eta0"]]
    rows = [("", f"async eta={eta}", "sync eta=0")]
    if "colocated_eta0" in result["runs"]:
        runs.append(result["runs"]["colocated_eta0"])
        rows[0] += ("colocated eta=0",)
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    for label, fmt in (("RL phase s (step 1)", lambda r: f"{r['rl_seconds']:.1f} ({r['step1_seconds']:.1f})"),
                       ("trained tokens", lambda r: f"{r['trained_tokens']:.0f}"),
                       ("trained tokens/s", lambda r: f"{r['trained_tokens_per_s']:.1f}"),
                       ("trained tokens/s after step 1", lambda r: f"{r['trained_tokens_per_s_after_step1']:.1f}"),
                       ("trained trajectories", lambda r: str(r["trained_trajectories"])),
                       ("generated tokens (/s)", lambda r: f"{r['generated_tokens']} ({r['generated_tokens_per_s']:.1f})"),
                       ("wait for rollouts s", lambda r: f"{r['wait_rollout_s']:.1f}"),
                       ("train s", lambda r: f"{r['train_s']:.1f}"),
                       ("weight sync s", lambda r: f"{r['weight_sync_s']:.1f}"),
                       ("mean / max response len", lambda r: f"{r['mean_response_len']:.1f} / {r['max_response_len']:.0f}"),
                       ("staleness histogram", lambda r: json.dumps(r["staleness_hist"])),
                       ("groups submitted / rejected", lambda r: f"{r['submitted_groups']} / {r['rejected_groups']}"),
                       ("interrupted requests", lambda r: str(r["interruptions"])),
                       ("stale groups dropped / due waits",
                        lambda r: f"{r['stale_dropped']} / {r['due_waits']}"),
                       ("held-out greedy start -> end", lambda r: f"{pct(r['accuracy_start']['greedy'])} -> "
                                                                 f"{pct(r['accuracy_end']['greedy'])}"),
                       ("held-out sampled start -> end", lambda r: f"{pct(r['accuracy_start']['sampled'])} -> "
                                                                  f"{pct(r['accuracy_end']['sampled'])}"),
                       ("task greedy / sampled at end", lambda r: "-" if not r.get("task_accuracy_end") else
                        f"{pct(r['task_accuracy_end']['greedy'])} / {pct(r['task_accuracy_end']['sampled'])}")):
        rows.append((label, *(fmt(r) for r in runs)))
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, width)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in width))
    gap = result["accuracy_gap_points"]
    lines.append(f"throughput ratio async/sync: {result['throughput_ratio']:.2f}x trained tokens/s (after step 1: "
                 f"{result['throughput_ratio_after_step1']:.2f}x), {result['trained_samples_per_s_ratio']:.2f}x "
                 f"trained samples/s; accuracy gap (async - sync): greedy {gap['greedy']:+.1f} points, sampled "
                 f"{gap['sampled']:+.1f} points ({'within' if result['accuracy_within_2_points'] else 'outside'} "
                 "2 points)")
    if result.get("task_accuracy_gap_points"):
        t = result["task_accuracy_gap_points"]
        lines.append(f"task accuracy gap (length-stratified): greedy {t['greedy']:+.1f}, sampled {t['sampled']:+.1f} "
                     "points")
    if "throughput_ratio_vs_colocated" in result:
        g = result["accuracy_gap_vs_colocated_points"]
        lines.append(f"throughput ratio async/colocated: {result['throughput_ratio_vs_colocated']:.2f}x trained tokens/s, "
                     f"{result['trained_samples_per_s_ratio_vs_colocated']:.2f}x trained samples/s (colocated/sync "
                     f"{result['throughput_ratio_colocated_vs_sync']:.2f}x); accuracy gap (async - colocated): greedy "
                     f"{g['greedy']:+.1f}, sampled {g['sampled']:+.1f} points")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

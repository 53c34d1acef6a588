"""The learning curve of a real-model run: held-out sampled accuracy, with 95% intervals,
of the starting model, every ``run.export_every`` export and the final model.

    python -m realscale train configs/smollm2_chain_sum_cpu.yaml run.output_dir=runs
    python benchmarks/smollm2_curve.py runs/smollm2_chain_sum --config configs/smollm2_chain_sum_cpu.yaml

The run itself scores the starting model (``<run>/eval_start``) and the final one
(``<run>/eval_final``) with the recipe's ``eval`` section; this script scores each export
under ``<run>/exports`` the same way (``realscale eval --config``, through
``generate.num_servers`` embedded servers; ``--servers`` overrides the count, e.g. 2 on an
otherwise idle 2-core machine) into ``<run>/eval_curve/step_<k>``, skipping exports already
scored. Every point is avg@n over the held-out problems with its 95% interval over problems;
each is also compared with the start, paired per problem
(:func:`realscale.eval.metrics.paired_difference`). Writes ``<out>.json`` and ``<out>.png``
(the curve against the step and against the run's wall time, beside the training reward).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._cli import run_realscale  # noqa: E402
from realscale.eval.benchmark import paired_change, per_problem_accuracy, read_per_problem  # noqa: E402
from realscale.eval.metrics import mean_interval  # noqa: E402
from realscale.metrics import read_metrics  # noqa: E402
from realscale.train.checkpoint import EXPORTS  # noqa: E402


def _exports(run_dir: str) -> list[tuple[int, str]]:
    """(step, directory) of every export of the run, in step order."""
    root = os.path.join(run_dir, EXPORTS)
    if not os.path.isdir(root):
        return []
    found = [(int(name.split("_")[1]), os.path.join(root, name)) for name in os.listdir(root)
             if name.startswith("step_") and name.split("_")[1].isdigit()]
    return sorted(found)


def _score(run_dir: str, step: int, model_dir: str, config: str, servers: int) -> str:
    out = os.path.join(run_dir, "eval_curve", f"step_{step}")
    if read_per_problem(out) is None:
        args = ["eval", "--model", model_dir, "--config", config, "--out", out]
        if servers:
            args.append(f"generate.num_servers={servers}")
        os.makedirs(out, exist_ok=True)
        run_realscale(args, os.path.join(out, "eval.log"), "smollm2_curve")
    return out


def curve(run_dir: str, config: str, servers: int) -> dict:
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    total = max((int(r["step"]) for r in records if "step" in r), default=0)
    points = [(0, os.path.join(run_dir, "eval_start"))]
    points += [(step, _score(run_dir, step, path, config, servers)) for step, path in _exports(run_dir)
               if step < total]
    points.append((total, os.path.join(run_dir, "eval_final")))
    # the trainer's clock: each step's record time, from the start of step 1
    timed = [r for r in records if "time" in r and "perf/step_s" in r]
    t0 = float(timed[0]["time"]) - float(timed[0]["perf/step_s"]) if timed else 0.0
    wall = {int(r["step"]): float(r["time"]) - t0 for r in timed}
    rows = []
    for step, eval_dir in points:
        acc = per_problem_accuracy(eval_dir)
        change = paired_change(points[0][1], eval_dir)
        if acc is None or change is None:
            raise SystemExit(f"smollm2_curve: {eval_dir} has no per_problem.jsonl, or scored other problems "
                             f"(or another number of answers each) than {points[0][1]}")
        mean, half = mean_interval(list(acc.values()))
        rows.append({"step": step, "elapsed_s": wall.get(step, 0.0 if step == 0 else None), "eval_dir": eval_dir,
                     "accuracy": mean, "ci95": half, "change_vs_start": change[1], "change_ci95": change[2]})
    reward = [(int(r["step"]), float(r["reward/mean"])) for r in records if "reward/mean" in r and "step" in r]
    return {"run": run_dir, "config": config, "problems": len(acc), "points": rows, "train_reward": reward}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [p["step"] for p in pts]
    acc = [100 * p["accuracy"] for p in pts]
    err = [100 * p["ci95"] for p in pts]
    ax.errorbar(steps, acc, yerr=err, marker="o", capsize=4, label="held-out sampled accuracy (avg@n, 95% interval)")
    if result["train_reward"]:
        s, r = zip(*result["train_reward"])
        ax.plot(s, [100 * x for x in r], alpha=0.5, label="training reward (batch mean, after the all-equal filter)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("%")
    ax.set_title(f"{os.path.basename(result['run'].rstrip('/'))}: {result['problems']} held-out problems")
    ax.legend(fontsize=8)
    timed = [p for p in pts if p["elapsed_s"] is not None]
    ax2.errorbar([p["elapsed_s"] / 60 for p in timed], [100 * p["accuracy"] for p in timed],
                 yerr=[100 * p["ci95"] for p in timed], marker="o", capsize=4)
    ax2.set_xlabel("minutes of RL (trainer's clock)")
    ax2.set_ylabel("held-out sampled accuracy, %")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--config", required=True, help="the recipe the run used (its eval section scores the exports)")
    ap.add_argument("--servers", type=int, default=0, help="generation servers per evaluation (0: the recipe's)")
    ap.add_argument("--out", default="benchmarks/results/smollm2_chain_sum", help="output path stem (.json, .png)")
    args = ap.parse_args()
    result = curve(args.run_dir, args.config, args.servers)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    plot(result, args.out + ".png")
    for p in result["points"]:
        print(f"step {p['step']:>4}  {100 * p['accuracy']:5.1f}% ± {100 * p['ci95']:.1f}  "
              f"change vs start {100 * p['change_vs_start']:+5.1f} ± {100 * p['change_ci95']:.1f} points")
    print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()

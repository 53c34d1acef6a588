"""Start-up and in-loop checkpoint cost of ``realscale train`` on the default recipe, this
checkout against an earlier commit, alternating, in one run.

    python benchmarks/bench_startup.py --baseline 58dcb7a [--reps 3] [--steps 30] [KEY=VALUE ...]

(``KEY=VALUE``: config overrides for both, e.g. ``eval.before=false`` as in
``bench_vs_peers.py``.)

The baseline is checked out as a git worktree under ``runs/bench_startup/`` (its compiled
kernels copied from this checkout) and run with that tree first on the import path; both
run from the same warm start (``runs/bench_vs_peers/sft`` when it is there, else
``runs/bench_startup/sft``, a ``realscale sft`` of the recipe made by the first run that
needed it). Per run, from the metrics: seconds from
launch to the first and the last optimizer step, and the checkpoints' cost inside the
loop (the time between two logged steps beyond the later step's own ``perf/step_s``,
summed over the steps after a checkpoint). Medians over ``--reps``; writes
``benchmarks/results/startup_vs_<baseline>.json``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from _cli import REPO, run_realscale

LOAD_BEFORE = os.getloadavg()
RECIPE = os.path.join(REPO, "configs", "tiny_cpu.yaml")


def _worktree(commit: str, work: str) -> str:
    path = os.path.join(work, f"tree_{commit}")
    if not os.path.isdir(path):
        subprocess.run(["git", "worktree", "add", "--detach", path, commit], cwd=REPO, check=True,
                       capture_output=True)
        for so in glob.glob(os.path.join(REPO, "realscale", "_kernels", "*.so")):
            shutil.copy(so, os.path.join(path, "realscale", "_kernels"))
    return path


def _run(tree: str, sft: str, work: str, name: str, steps: int, every: int,
         overrides: list[str]) -> dict[str, float]:
    out = os.path.join(work, "runs")
    shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "realscale", "train", RECIPE, f"model.path={sft}", f"run.output_dir={out}",
           f"run.name={name}", f"run.total_steps={steps}", f"run.checkpoint_every={every}", *overrides]
    start = time.time()
    with open(os.path.join(work, f"{name}.log"), "w", encoding="utf-8") as log:
        code = subprocess.run(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"bench_startup: {name} failed (exit {code}); see {log.name}")
    metrics = [json.loads(line) for line in open(os.path.join(out, name, "metrics.jsonl"), encoding="utf-8")]
    steps_ = [m for m in metrics if "train/loss" in m]
    after_ckpt = [s for s in range(1, len(steps_)) if steps_[s - 1]["step"] % every == 0]
    gap = sum(steps_[s]["time"] - steps_[s - 1]["time"] - steps_[s]["perf/step_s"] for s in after_ckpt)
    return {"first_step_s": steps_[0]["time"] - start, "last_step_s": steps_[-1]["time"] - start,
            "first_wait_s": steps_[0]["perf/wait_rollout_s"], "checkpoint_gaps_s": gap}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="the commit to compare with")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("overrides", nargs="*", help="config overrides for both (KEY=VALUE)")
    args = ap.parse_args()
    work = os.path.join(REPO, "runs", "bench_startup")
    os.makedirs(work, exist_ok=True)
    sft = os.path.join(REPO, "runs", "bench_vs_peers", "sft")
    if not os.path.isfile(os.path.join(sft, "model.safetensors")):
        sft = os.path.join(work, "sft")
    if not os.path.isfile(os.path.join(sft, "model.safetensors")):
        run_realscale(["sft", RECIPE, f"sft.output={sft}"], os.path.join(work, "sft.log"), "bench_startup")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    trees = {"baseline": _worktree(args.baseline, work), "this": REPO}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    for rep in range(args.reps):
        for which, tree in trees.items():
            runs[which].append(_run(tree, sft, work, f"{which}_{rep}", args.steps, args.checkpoint_every,
                                      args.overrides))
            print(which, rep, {k: round(v, 2) for k, v in runs[which][-1].items()}, flush=True)
    med = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in runs.items()}
    for k in med["this"]:
        print(f"{k:18s} baseline {args.baseline} {med['baseline'][k]:6.2f}   this ({head}) {med['this'][k]:6.2f}")
    out = os.path.join(REPO, "benchmarks", "results", f"startup_vs_{args.baseline}.json")
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({"runs": runs, "median": med, "args": vars(args), "this": head,
                   "load_average_before": LOAD_BEFORE}, fh, indent=1)


if __name__ == "__main__":
    main()

"""Throughput of N steps of a recipe, on this machine or under Slurm, beside the simulator's prediction.

    python benchmarks/cluster_throughput.py configs/tiny_cpu.yaml --steps 10                 # local backend
    python benchmarks/cluster_throughput.py configs/ppo_tiny_slurm.yaml --steps 10 \\
        --slurm launch/slurm/ppo_tiny.sh                                                     # sbatch --wait
    python benchmarks/cluster_throughput.py configs/r1_distill_qwen_7b_math.yaml --steps 20 \\
        --slurm launch/slurm/ppo_7b.sh --predict                                             # a GPU cluster

Reports, with the simulator's definitions (realscale/sim/des.py) so that a run and its
prediction sit side by side:

- effective training tokens/s: trained answer tokens / wall time of the steps
  (``perf/trained_tokens`` over ``perf/step_s``, the first ``--warmup`` steps left out);
- generation tokens/s: answer tokens the servers finished (``rollout_ctl/generated_tokens``)
  over the same window;
- weight-sync seconds per step (``perf/weight_sync_s``: pause, stream, resume);
- idle fractions: the trainer's = time waiting for a batch / wall time (``perf/wait_rollout_s``);
  the generation servers' = the share of their time with no running request or paused,
  sampled every ``--poll`` seconds from each server's ``/get_server_info`` (the URLs come
  from the run directory: ``logs/server<i>.log`` locally, ``launch/servers/`` under Slurm;
  the machine running this script must reach the servers).

``--predict`` runs the simulator on the same recipe with the workload this run measured
(answer lengths and the filter's kept fraction: :func:`realscale.sim.validate.fit_workload`)
and the hardware profile (``--profile``; the CPU profile for CPU recipes). Writes
``benchmarks/results/cluster_throughput_<run name>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


class ServerPoller(threading.Thread):
    """Samples every server's running-request count and pause state."""

    def __init__(self, run_dir: str, poll: float) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.poll = run_dir, poll
        self.samples: list[tuple[float, str, bool]] = []  # (time, url, idle)
        self.stop = threading.Event()

    def urls(self) -> list[str]:
        found = []
        for path in sorted(glob.glob(os.path.join(self.run_dir, "launch", "servers", "*", "*.url"))):
            with open(path, encoding="utf-8") as fh:
                found.append(fh.read().strip())
        for path in sorted(glob.glob(os.path.join(self.run_dir, "logs", "server*.log"))):
            with open(path, encoding="utf-8", errors="replace") as fh:
                m = re.findall(r"realscale serve: .* on (http://\S+)", fh.read())
            if m:
                found.append(m[-1])
        return list(dict.fromkeys(found))

    def run(self) -> None:
        while not self.stop.is_set():
            for url in self.urls():
                try:
                    with urllib.request.urlopen(url + "/get_server_info", timeout=2) as resp:
                        info = json.load(resp)
                    idle = bool(info.get("paused")) or int(info.get("num_running_reqs", 0)) == 0
                    self.samples.append((time.time(), url, idle))
                except (OSError, ValueError):
                    pass  # not up yet, or gone
            self.stop.wait(self.poll)

    def idle_fraction(self, t0: float, t1: float) -> float | None:
        window = [idle for t, _, idle in self.samples if t0 <= t <= t1]
        return sum(window) / len(window) if window else None


def run_job(args: argparse.Namespace, run_dir: str, overrides: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.time()
    log = os.path.join(os.path.dirname(run_dir), f"{os.path.basename(run_dir)}.out")
    if args.slurm:
        cmd = ["sbatch", "--wait", args.slurm, *overrides]
    else:
        cmd = [sys.executable, "-m", "realscale", "train", args.recipe, *overrides]
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        with open(log, encoding="utf-8", errors="replace") as fh:
            raise SystemExit(f"cluster_throughput: {' '.join(cmd)} failed ({proc.returncode}):\n{fh.read()[-3000:]}")
    return time.time() - t0


def measure(records: list[dict], warmup: int, poller: ServerPoller | None) -> dict:
    """The run's rates over the steps after ``warmup`` (the simulator's definitions)."""
    steps = [r for r in records if "perf/step_s" in r]
    kept = steps[warmup:]
    wall = sum(r["perf/step_s"] for r in kept)
    # the steps run back to back and each is logged as it ends, except that the last log
    # may wait for the final checkpoint: the window is the first kept step's start + wall
    t0 = kept[0]["time"] - kept[0]["perf/step_s"]
    t1 = t0 + wall
    gen0 = steps[warmup - 1].get("rollout_ctl/generated_tokens", 0) if warmup else 0
    gen1 = kept[-1].get("rollout_ctl/generated_tokens", 0)
    return {"steps": len(steps), "measured_steps": len(kept), "wall_s": wall,
            "tokens_per_s": sum(r["perf/trained_tokens"] for r in kept) / wall,
            "generated_tokens_per_s": (gen1 - gen0) / wall,
            "step_s": wall / len(kept),
            "weight_sync_s": sum(r["perf/weight_sync_s"] for r in kept) / len(kept),
            "idle": {"train": sum(r["perf/wait_rollout_s"] for r in kept) / wall,
                     "generate": poller.idle_fraction(t0, t1) if poller else None},
            "poll_samples": len([s for s in poller.samples if t0 <= s[0] <= t1]) if poller else 0}


def predict(recipe: str, overrides: list[str], records: list[dict], profile: str, warmup: int) -> dict:
    from realscale.config import load_config
    from realscale.planner.hardware import load_profile
    from realscale.sim.validate import WorkloadStats, recipe_scenario

    cfg = load_config(recipe, overrides)
    steps = [r for r in records if "perf/step_s" in r]
    last = steps[-1]
    n = cfg.rollout.n_samples
    stats = WorkloadStats(last["rollout_ctl/generated_tokens"] / max(1, n * last["rollout_ctl/submitted"]),
                          1 - last.get("rollout_ctl/rejected", 0) / max(1, last["rollout_ctl/submitted"]),
                          sum(r["perf/trained_tokens"] for r in steps) / sum(r["rollout/trajectories"] for r in steps))
    plan = None
    if cfg.launch.gpus_per_node > 0:
        from realscale.planner.plan import Plan

        plan = Plan.load(cfg.parallel.plan)
    hw = load_profile(profile or ("benchmarks/results/cpu_profile.json" if cfg.launch.gpus_per_node == 0
                                  else cfg.launch.gpu))
    sc, _ = recipe_scenario(recipe, hw, stats, overrides, plan)
    res = sc.run(steps=len(steps), warmup=warmup)
    return {"profile": hw.name, "tokens_per_s": res.tokens_per_s, "generated_tokens_per_s": res.generated_tokens_per_s,
            "step_s": res.step_seconds, "weight_sync_s": res.weight_sync_s, "idle": res.idle,
            "workload": stats.__dict__}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the rates")
    ap.add_argument("--slurm", default="", help="an sbatch script rendered from the recipe (sbatch --wait)")
    ap.add_argument("--name", default="", help="run name (default: throughput-<recipe>)")
    ap.add_argument("--output-dir", default="runs")
    ap.add_argument("--poll", type=float, default=0.25, help="seconds between server samples")
    ap.add_argument("--predict", action="store_true", help="add the simulator's prediction for this run")
    ap.add_argument("--profile", default="", help="hardware profile for --predict")
    ap.add_argument("--keep", action="store_true", help="keep the run directory")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        raise SystemExit("cluster_throughput: --steps must exceed --warmup")
    os.chdir(REPO)
    from realscale.metrics import read_metrics

    name = args.name or "throughput-" + os.path.splitext(os.path.basename(args.recipe))[0]
    run_dir = os.path.join(args.output_dir, name)
    if os.path.exists(run_dir):
        raise SystemExit(f"cluster_throughput: {run_dir} exists (a run there would resume); pick --name")
    os.makedirs(args.output_dir, exist_ok=True)
    overrides = [*args.overrides, f"run.total_steps={args.steps}", f"run.name={name}",
                 f"run.output_dir={args.output_dir}", "run.checkpoint_every=0"]
    poller = ServerPoller(run_dir, args.poll)
    poller.start()
    load0 = [round(x, 2) for x in os.getloadavg()]
    seconds = run_job(args, run_dir, overrides)
    poller.stop.set()
    records = list(read_metrics(os.path.join(run_dir, "metrics.jsonl")))
    out = {"benchmark": "cluster_throughput", "recipe": args.recipe, "overrides": overrides,
           "backend": "slurm" if args.slurm else "local", "script": args.slurm or None,
           "command": "python benchmarks/cluster_throughput.py " + " ".join(sys.argv[1:]),
           "measured": measure(records, args.warmup, poller), "job_seconds": seconds,
           "load_avg_1_5_15": {"start": load0, "end": [round(x, 2) for x in os.getloadavg()]},
           "date": time.strftime("%Y-%m-%d %H:%M")}
    if args.predict:
        out["simulated"] = predict(args.recipe, overrides, records, args.profile, args.warmup)
    m, s = out["measured"], out.get("simulated")
    print(f"{'metric':<30} {'measured':>12}" + (f" {'simulated':>12}" if s else ""))
    for key, label in (("tokens_per_s", "trained tokens/s"), ("generated_tokens_per_s", "generated tokens/s"),
                       ("step_s", "step seconds"), ("weight_sync_s", "weight sync s/step")):
        print(f"{label:<30} {m[key]:>12.2f}" + (f" {s[key]:>12.2f}" if s else ""))
    for role in ("train", "generate"):
        mv = m["idle"].get(role)
        sv = s["idle"].get(role) if s else None
        print(f"{'idle ' + role:<30} {('-' if mv is None else f'{mv:.0%}'):>12}"
              + (f" {('-' if sv is None else f'{sv:.0%}'):>12}" if s else ""))
    path = os.path.join(REPO, "benchmarks", "results", f"cluster_throughput_{name}.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {os.path.relpath(path, REPO)}")
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

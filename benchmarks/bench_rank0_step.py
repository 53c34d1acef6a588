"""Does trainer rank 0 train like the others? The rollout controller in its own process
(``rollout.controller_process=true``, the default) vs on a thread of rank 0 (``false``),
side by side on the same recipe.

    python benchmarks/bench_rank0_step.py [--steps 8] [--dp 2]   # writes results/rank0_step.json

One warm start (``realscale sft``, shared), then two ``realscale train`` runs of the
default recipe with ``parallel.dp`` trainer ranks, one after the other, from fresh run
directories. Each step the trainer logs every rank's forward/backward compute seconds
(megatron's schedule timers, :mod:`realscale.parallel.rank_metrics`): rank 0's
(``perf/compute_s_rank0``) and the slowest other rank's (``perf/compute_s_max_other``).
The ranks hold equal token-balanced shares, so on an idle machine the two are equal; what
rank 0 also hosts (the controller's event loop, HTTP client, reward scoring and batch
packing on a thread, sharing its interpreter lock) shows as rank 0's excess. Reported per
run, over the steps after the first (one-off start-up costs): the medians of both, their
ratio, the step time, and the batch transfer (``perf/batch_s``, bytes against the bound).

The machine is shared: the load average is recorded before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = os.path.join(REPO, "benchmarks", "results", "rank0_step.json")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import run_realscale  # noqa: E402 - benchmarks/ is not a package
KEYS = ("perf/compute_s_rank0", "perf/compute_s_max_other", "perf/step_s", "perf/train_s", "perf/batch_s",
        "perf/batch_bytes", "perf/batch_bytes_lower_bound")


def summarize(run_dir: str, steps: int) -> dict[str, Any]:
    """Medians over the steps after the first of the per-step figures (module docstring)."""
    sys.path.insert(0, REPO)
    from realscale.metrics import read_metrics

    records = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "perf/step_s" in r]
    if len(records) != steps:
        raise SystemExit(f"{run_dir} logged {len(records)} steps, expected {steps}")
    later = records[1:]
    out = {k.removeprefix("perf/"): statistics.median(r[k] for r in later) for k in KEYS}
    out["rank0_over_other"] = out["compute_s_rank0"] / out["compute_s_max_other"]
    out["bytes_equal_bound"] = all(r["perf/batch_bytes"] == r["perf/batch_bytes_lower_bound"] for r in records)
    out["per_step"] = [{k.removeprefix("perf/"): r[k] for k in KEYS} for r in records]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--work", default=os.path.join(REPO, "runs", "bench_rank0_step"))
    ap.add_argument("--out", default=RESULT)
    args = ap.parse_args()
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    sft_dir = os.path.join(work, "sft")
    common = [os.path.join(REPO, "configs", "tiny_cpu.yaml"), f"sft.output={sft_dir}", f"run.output_dir={work}",
              f"run.total_steps={args.steps}", "run.checkpoint_every=0", f"parallel.dp={args.dp}",
              "eval.max_problems=20"]
    if not os.path.isfile(os.path.join(sft_dir, "model.safetensors")):
        print(f"warm start -> {sft_dir}", flush=True)
        run_realscale(["sft", *common], os.path.join(work, "sft.log"), "bench_rank0_step")
    runs: dict[str, Any] = {}
    for name, in_process in (("process", True), ("thread", False)):
        run_dir = os.path.join(work, name)
        shutil.rmtree(run_dir, ignore_errors=True)  # a leftover run directory would be resumed
        load_before = os.popen("uptime").read().strip()
        seconds = run_realscale(["train", *common, f"run.name={name}",
                                 f"rollout.controller_process={str(in_process).lower()}"],
                                os.path.join(work, f"{name}.log"), "bench_rank0_step")
        runs[name] = {"controller_process": in_process, "wall_s": seconds, "uptime_before": load_before,
                      "uptime_after": os.popen("uptime").read().strip(), **summarize(run_dir, args.steps)}
    print(f"{'controller':10s} {'rank-0 compute s':>17s} {'max other s':>12s} {'rank0/other':>12s} "
          f"{'step s':>8s} {'batch s':>8s} {'batch bytes = bound':>20s}")
    for name, r in runs.items():
        print(f"{name:10s} {r['compute_s_rank0']:17.3f} {r['compute_s_max_other']:12.3f} {r['rank0_over_other']:12.2f} "
              f"{r['step_s']:8.2f} {r['batch_s']:8.3f} {str(r['bytes_equal_bound']):>20s}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"benchmark": "rank0_step", "command": " ".join(["python", *sys.argv]), "steps": args.steps,
                   "dp": args.dp, "medians_over": "steps 2..N", "runs": runs}, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

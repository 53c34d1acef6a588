"""The step-time simulator against our measured CPU runs (issue 19, item 2).

    python -m realscale profile --repeats 7 --out benchmarks/results/cpu_profile.json  # the CPU profile (~12 min)
    python benchmarks/sim_validate.py --measure-default                 # a default-recipe run (~7 min, quiet machine)
    python benchmarks/sim_validate.py --from-run RUN_DIR --samples S    # or record a finished run (S: _cpu_monitor.py PID S)
    python benchmarks/sim_validate.py                                   # predict, compare, write JSON

The profile times CPU (what each component costs with a core of its own), as the runs
predicted had it: bench_async's ran on an otherwise idle machine, and the default-recipe run
needs the same. ``nice`` cannot give it that on this machine: Linux autogroups share the CPU
between sessions first and ``nice`` orders threads only inside one, so run it when the
machine is quiet. The record keeps the load, the session's autogroup, and where the cores
went (``benchmarks/_cpu_monitor.py``: every role's CPU and run-queue wait, and what other
jobs took), so a loaded run shows itself.

Predicts, from the measured profile alone (no fit to the numbers predicted), (1) the
async/sync throughput ratio of bench_async (ten seeds, committed) and (2) the default
recipe's mean step time (a `realscale train` run summarised with bench_async's own
summarize_run, so the metric definitions are the same). Writes
benchmarks/results/sim_validation.json and prints a table; tests/sim/test_validation.py
checks the same predictions stay within ±20%.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))


def _autogroup() -> str:
    """The scheduler group this session's processes share (Linux autogroup): ``nice``
    orders threads only inside it; other sessions' jobs get their share regardless."""
    try:
        with open("/proc/self/autogroup", encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return "none"


def _train_windows(records: list[dict]) -> list[tuple[float, float]]:
    """Wall-clock window of each step's update (steps after the first), from its metrics:
    a record is logged right after its step ends (``time``), and the step was wait, then
    update, then publish."""
    out = []
    for r in records[1:]:
        start = r["time"] - r["perf/step_s"] + r["perf/wait_rollout_s"]
        out.append((start, start + r["perf/train_s"]))
    return out


def cpu_breakdown(samples: list[dict], records: list[dict]) -> dict:
    """Where the cores went during the trainer's updates and over the RL steps after step 1
    (``_cpu_monitor``), with the trainer's own figures (``perf/train_cpu_s``, ``perf/train_runq_s``)."""
    from _cpu_monitor import during

    later = records[1:]
    rl = [(later[0]["time"] - later[0]["perf/step_s"], later[-1]["time"])]
    out = {"updates": during(samples, _train_windows(records)), "rl_after_step1": during(samples, rl)}
    if all("perf/train_cpu_s" in r for r in later):
        out["trainer_self"] = {k: float(sum(r.get(f"perf/train_{k}", 0.0) for r in later)) / len(later)
                               for k in ("cpu_s", "runq_s")}
        out["trainer_self"]["wall_s"] = float(sum(r["perf/train_s"] for r in later)) / len(later)
    return out


def _step_records(path: str) -> list[dict]:
    """Each step's own record, as logged when the step ended (``read_metrics`` merges the
    final evaluation's record into the last step's, ``time`` included)."""
    out: dict[int, dict] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                rec = json.loads(line)
                if "perf/step_s" in rec:
                    out.setdefault(int(rec["step"]), rec)
    return [out[k] for k in sorted(out)]


def record_run(run_dir: str, recipe: str, overrides: list[str], samples: list[dict] | None, **provenance: object) -> dict:
    """The measured-run record the validation reads: bench_async's summary of ``run_dir``,
    every step's perf/* figures, and (with monitor ``samples``) where the cores went."""
    from bench_async import summarize_run

    from realscale.config import load_config

    cfg = load_config(recipe, overrides)
    summary = summarize_run(run_dir, cfg.run.total_steps)
    summary["steps"] = cfg.run.total_steps
    records = _step_records(os.path.join(run_dir, "metrics.jsonl"))
    out = {"benchmark": "default_recipe_run", **provenance, "recipe": recipe, "overrides": overrides,
           "summary": summary,
           "per_step": [{k: r[k] for k in r if k.startswith("perf/") and not k.startswith("perf/batch")}
                        for r in records]}
    if samples:
        out["cpu"] = cpu_breakdown(samples, records)
    return out


def _write(result: dict, out: str) -> None:
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    s = result["summary"]
    print(f"wrote {out}: mean step {(s['rl_seconds'] - s['step1_seconds']) / (s['steps'] - 1):.2f} s")
    if "cpu" in result:
        print(json.dumps(result["cpu"], indent=1))


def _git_head() -> str:
    import subprocess

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return head.stdout.strip() or "unknown"


def measure_default(recipe: str, out: str, overrides: list[str]) -> None:
    """One `realscale train` run of the recipe in a fresh directory, summarised, with where
    the cores went (the roles' CPU and run-queue wait, sampled)."""
    import subprocess

    from _cpu_monitor import CpuMonitor

    work = tempfile.mkdtemp(prefix="sim-default-")
    try:
        args = [recipe, f"run.output_dir={work}", "run.name=default", *overrides]
        load = [round(x, 2) for x in os.getloadavg()]
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        t0 = time.perf_counter()
        with open(os.path.join(work, "train.log"), "w", encoding="utf-8") as log:
            proc = subprocess.Popen([sys.executable, "-m", "realscale", "train", *args], cwd=REPO, env=env,
                                    stdout=log, stderr=subprocess.STDOUT)
            monitor = CpuMonitor(proc.pid).start()
            code = proc.wait()
            monitor.stop()
        t = time.perf_counter() - t0
        if code != 0:
            with open(os.path.join(work, "train.log"), encoding="utf-8", errors="replace") as fh:
                raise SystemExit(f"sim_validate: `realscale train` failed (exit {code}):\n{fh.read()[-3000:]}")
        nice = os.nice(0)
        cmd = ("nice -n {} ".format(nice) if nice else "") + "python benchmarks/sim_validate.py --measure-default"
        result = record_run(os.path.join(work, "default"), recipe, overrides, monitor.samples, command=cmd,
                            code=_git_head(), command_seconds=t,
                            machine={"cpus": os.cpu_count(), "niceness": nice, "autogroup": _autogroup(),
                                     "load_avg_1_5_15": {"start": load, "end": [round(x, 2) for x in os.getloadavg()]}},
                            date=time.strftime("%Y-%m-%d %H:%M"))
        _write(result, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def from_run(run_dir: str, recipe: str, out: str, overrides: list[str], samples: str | None, command: str,
             note: str, code: str) -> None:
    """Record a default-recipe run made by someone else's command (a quiet-machine run),
    with ``samples`` from ``benchmarks/_cpu_monitor.py`` watching it if there are any."""
    data = None
    if samples:
        with open(samples, encoding="utf-8") as fh:
            data = json.load(fh)
    result = record_run(run_dir, recipe, overrides, data, command=command, code=code or _git_head(), machine={
        "cpus": os.cpu_count(), "note": note}, date=time.strftime("%Y-%m-%d %H:%M"))
    _write(result, out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure-default", action="store_true", help="run the default recipe and write its summary")
    ap.add_argument("--from-run", metavar="RUN_DIR", help="record a finished run of the recipe instead of running one")
    ap.add_argument("--samples", help="with --from-run: _cpu_monitor samples (JSON) taken while it ran")
    ap.add_argument("--command", default="", help="with --from-run: the command that made the run")
    ap.add_argument("--note", default="", help="with --from-run: the machine's load while it ran, and who ran it")
    ap.add_argument("--code", default="", help="with --from-run: the commit the run's code was (default: this HEAD)")
    ap.add_argument("--recipe", default="configs/tiny_cpu.yaml")
    ap.add_argument("--profile", default="benchmarks/results/cpu_profile.json")
    ap.add_argument("--run", default="benchmarks/results/default_recipe_run.json")
    ap.add_argument("--bench", default="benchmarks/results/async_vs_sync_seeds1-10.json")
    ap.add_argument("--out", default="benchmarks/results/sim_validation.json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    os.chdir(REPO)
    if args.measure_default:
        measure_default(args.recipe, args.run, args.overrides)
        return 0
    if args.from_run:
        from_run(args.from_run, args.recipe, args.run, args.overrides, args.samples, args.command, args.note, args.code)
        return 0
    from realscale.sim.validate import validate

    res = validate(args.profile, args.bench, args.run)
    res["command"] = "python benchmarks/sim_validate.py"
    res["load_avg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    b, d = res["bench_async"], res["default_step"]
    print(f"{'quantity':<44} {'measured':>10} {'simulated':>10} {'error':>8}")
    print(f"{'bench_async async/sync ratio (10 seeds)':<44} {b['measured_ratio']:>10.2f} {b['predicted_ratio']:>10.2f} "
          f"{b['error']:>+8.1%}")
    for k, m in (("async", "async_eta4"), ("sync", "sync_eta0")):
        meas, pred = b["measured_tokens_per_s"][m], b["predicted_tokens_per_s"][k]
        print(f"{'  ' + k + ' trained tokens/s (mean of seeds)':<44} {meas:>10.0f} {pred:>10.0f} {pred / meas - 1:>+8.1%}")
    print(f"{'default recipe mean step (s)':<44} {d['measured_step_s']:>10.2f} {d['predicted_step_s']:>10.2f} "
          f"{d['error']:>+8.1%}")
    for k in ("train_s", "weight_sync_s", "wait_rollout_s"):
        meas, pred = d["per_step"]["measured"][k], d["per_step"]["predicted"][k]
        print(f"{'  ' + k + ' per step':<44} {meas:>10.2f} {pred:>10.2f} {pred / max(meas, 1e-9) - 1:>+8.1%}")
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

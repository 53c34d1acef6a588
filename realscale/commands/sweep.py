"""``realscale sweep``: one plan and one sbatch job per model size (or config value).

    realscale sweep configs/sweeps/areal_sizes.yaml --dry-run          # print plans and scripts
    realscale sweep configs/sweeps/areal_sizes.yaml --out launch/slurm # write them
    realscale sweep configs/sweeps/areal_sizes.yaml --submit           # write, then sbatch each
    realscale sweep configs/sweeps/areal_sizes.yaml --out launch/slurm --check  # up to date?

Scripts refer to recipes and plans by paths relative to the repository: run sbatch from
its root. See realscale/launcher/sweep.py for the file format.
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("sweep", help="sweep YAML (jobs: name -> recipe + overrides; optional grid)")
    parser.add_argument("--out", default="", help="directory for scripts and plans/ (default: runs/sweeps/<name>)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print every job's plan and sbatch script; write nothing")
    parser.add_argument("--check", action="store_true",
                        help="fail (exit 1) if the files under --out differ from a fresh render")
    parser.add_argument("--submit", action="store_true", help="after writing, submit every script with sbatch")


def run(args: argparse.Namespace) -> int:
    import subprocess

    import yaml

    from realscale.cli import UsageError
    from realscale.launcher.sweep import load_sweep, render_jobs, stale_files, write_jobs

    jobs = load_sweep(args.sweep)
    with open(args.sweep, encoding="utf-8") as fh:
        name = (yaml.safe_load(fh) or {}).get("name") or os.path.splitext(os.path.basename(args.sweep))[0]
    out = args.out or os.path.join("runs", "sweeps", str(name))
    render_jobs(jobs, out)
    if args.dry_run:
        for job in jobs:
            print(f"=== job {job.name}: {job.recipe} {' '.join(job.overrides)}")
            if job.plan is not None:
                print(job.plan.table())
                print(f"memory per GPU within the {job.cfg.launch.gpu}'s HBM: ok")
            else:
                print("(CPU job: no plan; servers and ranks share the allocation's nodes)")
            print(f"--- {os.path.join(out, job.name + '.sh')}")
            print(job.script)
        return 0
    if args.check:
        stale = stale_files(jobs)
        for path in stale:
            print(f"out of date: {path} (re-render: realscale sweep {args.sweep} --out {out})")
        if not stale:
            print(f"{sum(len(j.files) for j in jobs)} files under {out} are up to date")
        return 1 if stale else 0
    for path in write_jobs(jobs):
        print(f"wrote {path}")
    if args.submit:
        for job in jobs:
            script = os.path.join(out, f"{job.name}.sh")
            res = subprocess.run(["sbatch", script], capture_output=True, text=True)
            if res.returncode != 0:
                raise UsageError(f"sbatch {script}: {res.stderr.strip()}")
            print(f"{job.name}: {res.stdout.strip()}")
    return 0

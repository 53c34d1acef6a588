"""``realscale profile``: measure this machine's hardware profile for the cost model and the simulator.

    realscale profile --repeats 7 --out benchmarks/results/cpu_profile.json   # ~12 min on 2 cores
    realscale plan --profile benchmarks/results/cpu_profile.json ...   # the planner on it
    realscale simulate configs/long_tail_cpu.yaml --profile benchmarks/results/cpu_profile.json
    realscale profile --show H800                                      # a profile's constants + sources

What is measured and how it is fitted: realscale/launcher/calibrate.py.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default="configs/long_tail_cpu.yaml",
                        help="recipe whose model, micro-batch budget and settings are measured")
    parser.add_argument("--out", default="benchmarks/results/cpu_profile.json", help="profile JSON to write")
    parser.add_argument("--work", default="runs/profile", help="scratch directory (model, server log)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per role (a 2-core run gives 1 each)")
    parser.add_argument("--repeats", type=int, default=5, help="repetitions per point (the median is kept)")
    parser.add_argument("--rollout-seconds", type=float, default=30.0,
                        help="how long the rollout side (client, workflow, rewards) is measured, to a batch boundary")
    parser.add_argument("--show", default="", help="print this profile (JSON file or GPU name) and exit")


def run(args: argparse.Namespace) -> int:
    from realscale.cli import UsageError
    from realscale.planner.hardware import HardwareError, load_profile

    if args.show:
        try:
            prof = load_profile(args.show)
        except HardwareError as exc:
            raise UsageError(str(exc)) from None
        print(f"profile {prof.name}")
        print(prof.table())
        return 0
    if args.threads < 1 or args.repeats < 1:
        raise UsageError("--threads and --repeats must be >= 1")
    if not args.rollout_seconds > 0:
        raise UsageError(f"--rollout-seconds must be > 0, got {args.rollout_seconds}")
    from realscale.launcher.calibrate import measure_cpu_profile

    prof = measure_cpu_profile(args.recipe, args.work, threads=args.threads, repeats=args.repeats,
                               rollout_seconds=args.rollout_seconds)
    prof.save(args.out)
    print(prof.table())
    print(f"wrote {args.out}")
    return 0

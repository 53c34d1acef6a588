"""``realscale simulate``: simulate whole RL runs of a recipe (or plan), asynchronous vs synchronous.

    realscale simulate configs/r1_distill_qwen_7b_math.yaml                # the recipe's cluster
    realscale simulate configs/r1_distill_qwen_7b_math.yaml --gpus 1024    # re-planned for 1,024 GPUs
    realscale simulate launch/slurm/plans/ppo_7b.yaml --recipe configs/r1_distill_qwen_7b_math.yaml
    realscale simulate configs/long_tail_cpu.yaml --profile benchmarks/results/cpu_profile.json
    realscale simulate configs/tiny_cpu.yaml --timeline --json
    realscale simulate configs/tiny_cpu.yaml --weight-sync measured --batch-path measured

Prints, for the recipe's η and for η = 0 on the same layout: effective training tokens/s
(trained answer tokens / wall time), generated tokens/s, mean step seconds, idle fraction
of the generation and training GPUs, weight-sync seconds, and their ratio; ``--timeline``
adds every step. The data-movement terms (realscale/sim/transfer.py) say where their
figures come from: ``--weight-sync measured`` takes the resharder's cost measured by
``benchmarks/bench_weight_sync.py`` instead of the link model, ``--batch-path measured``
the rollout batch's transfer measured by ``benchmarks/bench_batch_transfer.py`` instead of
the assumed link speed. The simulator: realscale/sim/des.py; its step times: the planner's cost
model under the hardware profile (realscale/planner/hardware.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

DEFAULT_CPU_PROFILE = os.path.join("benchmarks", "results", "cpu_profile.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="a recipe YAML, or a plan YAML (then --recipe gives the workload)")
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    parser.add_argument("--recipe", default="", help="the recipe of a plan given as target")
    parser.add_argument("--gpus", type=int, default=0, help="GPU recipes: re-plan for this many GPUs (whole nodes)")
    parser.add_argument("--profile", default="",
                        help="hardware profile: a JSON from `realscale profile` or a calibration, or a GPU name "
                             f"(default: {DEFAULT_CPU_PROFILE} for CPU recipes; the AReaL-calibrated "
                             "profile, else launch.gpu, for GPU recipes)")
    parser.add_argument("--lengths", default="", help="answer lengths: lognormal:MEDIAN:SIGMA, hist:FILE.json, "
                                                      "task[:WORKED] or calibrated")
    parser.add_argument("--accept", type=float, default=None, help="fraction of groups the filter keeps (default 1)")
    parser.add_argument("--eta", type=int, default=-1, help="staleness bound of the asynchronous run (default: the recipe's)")
    parser.add_argument("--steps", type=int, default=10, help="RL steps to simulate")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the rates")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weight-sync", default="link",
                        help="weight-sync cost: link (the engine's path at the profile's link speed: the "
                             "resharder's plan for embedded servers and vLLM m2n, per-stage broadcast for SGLang, "
                             "the rank-0 funnel for vLLM broadcast), measured (the resharder's measured cost, "
                             "benchmarks/results/bench_weight_sync.json) or measured:FILE")
    parser.add_argument("--batch-path", default="assumed",
                        help="rollout-batch transfer to the trainer ranks: assumed (the profile's IB speed), "
                             "measured (benchmarks/results/bench_batch_transfer.json, scatter rows) or "
                             "measured:FILE[:METHOD]")
    parser.add_argument("--timeline", action="store_true", help="print every step")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--rollout-processes", type=int, default=1,
                        help="rollout processes taking in the answers (GPU recipes; realscale/rollout/sharded.py): "
                             "each costs the measured CPU per answer and per token (realscale/sim/build.py "
                             "MEASURED_ROLLOUT); a run that loads one past 0.5 is flagged")


def _profile(args: argparse.Namespace, cfg) -> object:  # noqa: ANN001 - Config
    from realscale.planner.hardware import load_profile

    if args.profile:
        return load_profile(args.profile)
    if cfg.launch.gpus_per_node == 0:
        return load_profile(DEFAULT_CPU_PROFILE)
    from realscale.sim.recipe import CALIBRATION_JSON

    if os.path.isfile(CALIBRATION_JSON) and cfg.launch.gpu == "H800":
        from realscale.sim.paper import Calibrated

        with open(CALIBRATION_JSON, encoding="utf-8") as fh:
            return Calibrated.from_dict(json.load(fh)).profile
    return load_profile(cfg.launch.gpu)


def _plan(args: argparse.Namespace, cfg):  # noqa: ANN001, ANN202
    from realscale.planner.plan import Plan

    if cfg.launch.gpus_per_node == 0:
        return None
    if args.gpus:
        gpn = cfg.launch.gpus_per_node
        if args.gpus % gpn:
            from realscale.cli import UsageError

            raise UsageError(f"--gpus {args.gpus} is not a whole number of {gpn}-GPU nodes")
        cfg.launch.nodes = args.gpus // gpn
    elif cfg.parallel.plan:
        return Plan.load(cfg.parallel.plan)
    from realscale.launcher.render import plan_for

    return plan_for(cfg)


def run(args: argparse.Namespace) -> int:
    from realscale.cli import UsageError
    from realscale.config import load_config
    from realscale.planner.plan import Plan
    from realscale.sim.recipe import parse_lengths, scenario_from_config
    from realscale.sim.transfer import batch_cost, weight_cost

    try:
        plan = None
        recipe = args.target
        with open(args.target, encoding="utf-8") as fh:
            is_plan = "roles:" in fh.read()
        if is_plan:
            if not args.recipe:
                raise UsageError(f"{args.target} is a plan: name its recipe with --recipe (for the workload)")
            plan, recipe = Plan.load(args.target), args.recipe
        cfg = load_config(recipe, args.overrides)
        if plan is None:
            plan = _plan(args, cfg)
        hw = _profile(args, cfg)
        lengths = parse_lengths(args.lengths, cfg) if args.lengths else None
        sc = scenario_from_config(cfg, hw, plan=plan, lengths=lengths, accept=args.accept)
        sc.weight_link, sc.batch_link = weight_cost(args.weight_sync), batch_cost(args.batch_path, hw)
        if args.rollout_processes < 1:
            raise UsageError(f"--rollout-processes must be >= 1, got {args.rollout_processes}")
        sc.rollout = dataclasses.replace(sc.rollout, processes=args.rollout_processes)
        eta = sc.eta if args.eta < 0 else args.eta
        results = {f"eta={eta}": sc.run(args.steps, args.warmup, args.seed, eta=eta),
                   "eta=0": sc.run(args.steps, args.warmup, args.seed, eta=0)}
    except OSError as exc:  # a recipe, plan or profile file that is not there (every other
        # mistake a user can make here is a UserError already: layout, hardware, sim, workload)
        raise UsageError(str(exc)) from None
    head = {"recipe": recipe, "layout": sc.layout.describe(), "gpus": sc.layout.gpus, "profile": hw.name,
            "model_params": sc.spec.n_params, "lengths": sc.workload.lengths.describe(),
            "weight_sync": sc.weight_link.describe() if sc.weight_link else
            "the resharder's plan at the profile's link bandwidth x eff.link, + eff.weight_update_overhead_s",
            "batch_path": sc.batch_link.describe(),
            "rollout": (f"{sc.rollout.processes} process(es), {sc.rollout.per_token_s * 1e6:.2f} us CPU a token + "
                        f"{sc.rollout.per_answer_s * 1e3:.2f} ms an answer ({sc.rollout.source})"
                        if sc.hw.gpu.host_cores <= 0 else "shares the host's cores (gpu.host_cores)")}
    if args.json:
        out = {**head, "runs": {k: {**r.summary(), **({"timeline": [t.__dict__ for t in r.timeline]}
                                                       if args.timeline else {})} for k, r in results.items()}}
        print(json.dumps(out, indent=1))
        return 0
    for k, v in head.items():
        print(f"{k}: {v}")
    print(f"{'run':<8} {'tokens/s':>12} {'gen tok/s':>12} {'step s':>9} {'idle gen':>9} {'idle train':>10} {'sync s':>7}")
    for name, r in results.items():
        idle = r.idle
        print(f"{name:<8} {r.tokens_per_s:>12,.0f} {r.generated_tokens_per_s:>12,.0f} {r.step_seconds:>9.1f} "
              f"{idle.get('generate', idle.get('all', 0)):>9.0%} {idle.get('train', idle.get('all', 0)):>10.0%} "
              f"{r.weight_sync_s:>7.2f}")
    a, s = results.values()
    print(f"async / sync effective throughput: {a.tokens_per_s / s.tokens_per_s:.2f}x (simulated)")
    for name, r in results.items():
        if r.rollout_load > 0.5:
            print(f"rollout side ({name}): the busiest rollout process is loaded {r.rollout_load:.2f} "
                  f"(less than 2x headroom): raise --rollout-processes (rollout/sharded.py)")
    if args.timeline:
        for name, r in results.items():
            print(f"--- {name}: step, batch ready (s), train end, sync end, waited (s), trained tokens, max lag")
            for t in r.timeline:
                print(f"{t.step:>4} {t.batch_ready:>10.2f} {t.train_end:>10.2f} {t.sync_end:>10.2f} {t.wait_s:>8.2f} "
                      f"{t.trained_tokens:>10} {t.max_staleness:>3}")
    return 0

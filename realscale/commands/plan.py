"""``realscale plan``: place the roles of an RL step on a cluster and print the plan.

Prints a table (role, mesh, dp/tp/pp, time, memory per GPU), the estimated step time and
throughput, and with ``--out`` writes the plan YAML that ``planner.plan`` in a train
recipe accepts. Times are cost-model estimates (see realscale/planner/hardware.py).
``--mode auto`` plans both modes and keeps the faster, saying why
(:mod:`realscale.planner.choose`: colocated-synchronous vs disaggregated-asynchronous).
"""

from __future__ import annotations

import argparse
import json
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2-7b",
                        help="known size (qwen2-1.5b/7b/14b/32b/70b, qwen3-8b, llama3-8b/70b), an HF config.json "
                             "path or model directory, or a YAML recipe (uses model.path)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu", default="H100", help="A100, H800, H100, H200 or one from --gpu-profiles")
    parser.add_argument("--gpu-profiles", default="", help="YAML file adding/overriding GPU profiles")
    parser.add_argument("--profile", default="",
                        help="a hardware profile JSON (`realscale profile`, or a calibration): its device and "
                             "efficiencies replace --gpu and the assumed ones")
    parser.add_argument("--mode", default="auto", choices=("auto", "colocated", "disaggregated"))
    parser.add_argument("--batch", type=int, default=512, help="prompts per RL step")
    parser.add_argument("--n-samples", type=int, default=16, help="answers per prompt")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--gen-len", type=int, default=16384, help="maximum answer length")
    parser.add_argument("--mean-gen-len", type=int, default=0, help="mean answer length (0: gen-len / 2)")
    parser.add_argument("--max-staleness", type=int, default=4, help="eta of the asynchronous mode")
    parser.add_argument("--no-ref", action="store_true", help="no reference model (KL coefficient 0)")
    parser.add_argument("--critic", action="store_true", help="add critic inference and training roles")
    parser.add_argument("--iters", type=int, default=200_000, help="annealing iterations per restart")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="write the plan YAML here")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")


def _spec(model: str):
    from realscale.cli import UsageError
    from realscale.parallel.mesh import LayoutError
    from realscale.parallel.model_spec import known_model, spec_from_hf_config

    path = model
    if model.endswith((".yaml", ".yml")) and os.path.isfile(model):
        from realscale.config import load_config
        from realscale.planner.validate import policy_spec

        cfg = load_config(model)
        spec = policy_spec(cfg)  # also a recipe's warm start (model.path: sft) before it exists
        if spec is not None:
            return spec
        path = cfg.model.path
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                return spec_from_hf_config(json.load(fh))
        return known_model(path)
    except (LayoutError, json.JSONDecodeError) as exc:
        raise UsageError(f"--model {model}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from realscale.cli import UsageError
    from realscale.parallel.mesh import Cluster, LayoutError
    from realscale.planner.cost import Workload
    from realscale.planner.hardware import Efficiency, HardwareError, get_gpu, load_profile, load_profiles
    from realscale.planner.plan import plan_from_search
    from realscale.planner.choose import choice_summary, choose_mode
    from realscale.planner.search import Problem, default_roles, search

    try:
        eff = Efficiency()
        if args.profile:
            prof = load_profile(args.profile)
            gpu, eff = prof.gpu, prof.eff
        else:
            profiles = load_profiles(args.gpu_profiles) if args.gpu_profiles else None
            gpu = get_gpu(args.gpu, profiles)
        problem = Problem(_spec(args.model), Cluster(args.nodes, args.gpus_per_node), gpu,
                          Workload(args.batch, args.n_samples, args.prompt_len, args.gen_len, args.mean_gen_len,
                                   max_staleness=args.max_staleness),
                          default_roles(ref=not args.no_ref, critic=args.critic), eff=eff)
        why: list[str] = []
        if args.mode == "auto":
            result, why = choose_mode(problem, iters=args.iters, seed=args.seed)
        else:
            result = search(problem, args.mode, iters=args.iters, seed=args.seed)
    except (LayoutError, HardwareError, OSError) as exc:
        raise UsageError(str(exc)) from None
    plan = plan_from_search(result, problem)
    if why:
        plan.extra["mode_choice"] = choice_summary(why)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(plan.table())
        print(f"search: {result.method} in {result.search_seconds:.2f} s")
        print("\n".join(why))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(plan.to_yaml())
        print(f"wrote {args.out}")
    return 0

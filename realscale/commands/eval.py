"""``realscale eval``: pass@k / avg@n / maj@n of a model on a benchmark (realscale/eval/benchmark.py).

Sampling settings default to the ``eval`` section of the config (a recipe and dotted
overrides may be given); the flags override it.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF model directory (e.g. <run>/final) or built-in model name")
    parser.add_argument("--data", default="", help="benchmark JSONL/Parquet (prompt + answer or tests rows), or "
                        "task:arith / task:long_tail (held-out split); default: eval.data, else task:arith")
    parser.add_argument("--samples", type=int, default=None, help="answers per problem, n (default: eval.samples)")
    parser.add_argument("--k", default="", help="comma-separated k of pass@k, each <= n (default: eval.k)")
    parser.add_argument("--temperature", type=float, default=None, help="default: eval.temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=None, help="default: eval.top_p")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="default: eval.max_new_tokens, else generate.max_new_tokens")
    parser.add_argument("--num", type=int, default=None, help="score only the first N problems (0: all)")
    parser.add_argument("--servers", default="", help="comma-separated URLs of running generation servers "
                        "(embedded, SGLang, vLLM); default: start generate.num_servers servers for the evaluation")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed of the started servers (run.seed)")
    parser.add_argument("--out", default="", help="output directory (default: runs/eval/<model name>)")
    parser.add_argument("--config", default=None, help="YAML recipe to take settings from")
    parser.add_argument("--examples", type=int, default=0, help="print this many problems with their completions")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. generate.num_servers=2")


def _flag_overrides(args: argparse.Namespace) -> list[str]:
    pairs = [("eval.samples", args.samples), ("eval.temperature", args.temperature), ("eval.top_p", args.top_p),
             ("eval.max_new_tokens", args.max_new_tokens), ("eval.max_problems", args.num), ("run.seed", args.seed)]
    out = [f"{key}={value}" for key, value in pairs if value is not None]
    if args.k:
        out.append(f"eval.k=[{args.k}]")
    return out


def run(args: argparse.Namespace) -> int:
    import json
    import os

    from realscale.cli import UsageError
    from realscale.config import load_config

    cfg = load_config(args.config, [*args.overrides, *_flag_overrides(args)])
    from realscale.eval.benchmark import run_benchmark, settings_from_config
    from realscale.launcher import served
    from realscale.models.tiny import resolve_model_path

    data = args.data or cfg.eval.data or "task:arith"
    out = args.out or os.path.join(cfg.run.output_dir, "eval", os.path.basename(os.path.normpath(args.model)))
    urls = [u.strip() for u in args.servers.split(",") if u.strip()]
    try:
        settings = settings_from_config(cfg, data)
        if urls:
            result = run_benchmark(cfg, args.model, settings, out, urls)
        else:
            model_dir = resolve_model_path(args.model)
            with served(cfg, model_dir, out) as started:
                result = run_benchmark(cfg, model_dir, settings, out, started)
    except (ValueError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    if args.examples:
        with open(result.per_problem, encoding="utf-8") as fh:
            for line in list(fh)[: args.examples]:
                rec = json.loads(line)
                print(f"  {rec['prompt'][:60]!r} -> {rec['answer']!r}: {rec['extracted']} {rec['correct']}")
    print(result.table())
    print(f"per-problem results: {result.per_problem}")
    return 0

"""``realscale eval``: accuracy of a model directory on the task's held-out split."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF model directory (e.g. <run>/sft) or built-in tiny model name")
    parser.add_argument("--num", type=int, default=0, help="held-out problems to score (0: all of them)")
    parser.add_argument("--samples", type=int, default=1, help="samples per problem (>1 also reports pass@k and mixed groups)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="most tokens generated per answer")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--out", default="", help="also write the result as JSON here")
    parser.add_argument("--examples", type=int, default=0, help="print this many problems with their completions")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides for the task, e.g. data.task_max_operand=49")


def run(args: argparse.Namespace) -> int:
    from realscale.cli import UsageError
    from realscale.config import load_config

    if args.samples < 1 or args.num < 0 or args.temperature < 0 or args.max_new_tokens < 1:
        raise UsageError("--samples and --max-new-tokens must be >= 1, --num and --temperature >= 0")
    cfg = load_config(None, args.overrides)
    from realscale.eval import evaluate, write_result
    from realscale.tasks.arith import task_from_config

    try:
        problems = task_from_config(cfg.data).split("heldout")
        if args.num:
            problems = problems[: args.num]
        result = evaluate(args.model, problems, samples=args.samples, temperature=args.temperature,
                          max_new_tokens=args.max_new_tokens, seed=args.seed, keep_examples=args.examples)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for ex in result.examples:
        print(f"  {ex['prompt']} {ex['answer']!r:>6}  <- {ex['completions']}")
    print(f"realscale eval: {args.model}: {result.summary()}")
    if args.out:
        write_result(result, args.out)
    return 0

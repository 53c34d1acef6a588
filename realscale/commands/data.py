"""``realscale data convert``: public dataset layouts -> the recipe format; ``realscale data gym``: a
reasoning-gym task written as a fixed recipe file with a held-out split (realscale/data/convert.py)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    conv = sub.add_parser("convert", help="convert a dataset file into recipe JSONL (prompt/answer/tests/metadata)")
    conv.add_argument("input", help="JSONL, JSON array, Parquet, a TOML file or a directory of TOML files")
    conv.add_argument("--out", required=True, help="output JSONL")
    conv.add_argument("--format", default="auto", help="gsm8k, math, deepscaler, aime, areal, code, recipe "
                      "(default auto: from the first row's keys)")
    conv.add_argument("--id2info", default="", help="AReaL: the id2info.json holding each query_id's solutions")
    conv.add_argument("--target", default="rl", choices=("rl", "sft"),
                      help="rl: prompt/answer/tests rows; sft: prompt/response rows for realscale sft")
    conv.add_argument("--instruction", default="", help="text appended to every prompt after a blank line, e.g. "
                      "'Please reason step by step, and put your final answer within \\boxed{}.'")
    conv.add_argument("--heldout", type=int, default=0,
                      help="also write this many rows, drawn at random, to <out stem>.heldout.jsonl (not in --out)")
    conv.add_argument("--seed", type=int, default=0, help="seed of the held-out draw")
    gym = sub.add_parser("gym", help="write problems of a reasoning-gym task as recipe JSONL (repeats refused)")
    gym.add_argument("task", help="reasoning-gym task name, e.g. chain_sum")
    gym.add_argument("--size", type=int, required=True, help="problems to generate (repeated questions are dropped)")
    gym.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                     help="a setting of the task's generator, e.g. --option min_terms=2 (repeatable)")
    gym.add_argument("--out", required=True, help="output JSONL")
    gym.add_argument("--heldout", type=int, default=0,
                     help="also write this many problems, drawn at random, to <out stem>.heldout.jsonl (not in --out)")
    gym.add_argument("--seed", type=int, default=0, help="seed of the generator and of the held-out draw")
    gym.add_argument("--instruction", default="", help="text appended to every prompt after a blank line")


def run(args: argparse.Namespace) -> int:
    from realscale.cli import UsageError
    from realscale.data.convert import (ConvertError, add_instruction, convert_file, convert_rows, heldout_path,
                                        parse_gym_options, read_gym, split_heldout, write_records)

    source = args.input if args.action == "convert" else f"reasoning-gym {args.task}"
    try:
        if args.action == "convert":
            records, report = convert_file(args.input, args.format, args.target, args.id2info, args.instruction)
        else:
            rows = read_gym(args.task, args.size, args.seed, parse_gym_options(args.option))
            records, report = convert_rows(rows, "gym")
            records = add_instruction(records, args.instruction)
        if not records:
            raise ConvertError(f"{source}: no row could be converted\n{report.summary()}")
        train, held = split_heldout(records, args.heldout, args.seed)
    except OSError as exc:  # ConvertError and every other mistake in the input is a UserError
        raise UsageError(f"{source}: {exc}") from None
    print(report.summary())
    try:
        print(f"wrote {len(train)} rows to {write_records(train, args.out)}")
        if held:
            print(f"wrote {len(held)} held-out rows to {write_records(held, heldout_path(args.out))}")
    except OSError as exc:
        raise UsageError(f"--out {args.out}: {exc}") from None
    return 0

"""``realscale data convert``: public dataset layouts -> the recipe format (realscale/data/convert.py)."""

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


def run(args: argparse.Namespace) -> int:
    from realscale.cli import UsageError
    from realscale.data.convert import (ConvertError, convert_file, heldout_path, split_heldout,
                                        write_records)

    try:
        records, report = convert_file(args.input, args.format, args.target, args.id2info, args.instruction)
        if not records:
            raise ConvertError(f"{args.input}: no row could be converted\n{report.summary()}")
        train, held = split_heldout(records, args.heldout, args.seed)
    except OSError as exc:  # ConvertError and every other mistake in the input is a UserError
        raise UsageError(f"{args.input}: {exc}") from None
    print(report.summary())
    try:
        print(f"wrote {len(train)} rows to {write_records(train, args.out)}")
        if held:
            print(f"wrote {len(held)} held-out rows to {write_records(held, heldout_path(args.out))}")
    except OSError as exc:
        raise UsageError(f"--out {args.out}: {exc}") from None
    return 0

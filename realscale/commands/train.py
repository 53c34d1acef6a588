"""``realscale train``: the fully asynchronous RL loop (default: the tiny CPU recipe)."""

from __future__ import annotations

import argparse
import os

DEFAULT_RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "configs", "tiny_cpu.yaml")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", default=None,
                        help="YAML recipe (default: configs/tiny_cpu.yaml, the embedded CPU run)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.max_staleness=4")


def run(args: argparse.Namespace) -> int:
    from realscale.config import load_config
    from realscale.launcher.supervisor import train
    from realscale.trainer import rank_main

    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe:
        recipe, overrides = None, [recipe, *overrides]
    if recipe is None:
        recipe = DEFAULT_RECIPE if os.path.exists(DEFAULT_RECIPE) else None
    return train(load_config(recipe, overrides), rank_main)

"""``realscale config``: resolve a recipe with overrides, print it, or list every knob."""

from __future__ import annotations

import argparse

from realscale import config as cfgmod
from realscale.commands import recipe_and_overrides


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("show", "check", "describe"),
                        help="show: print the resolved YAML; check: validate only; describe: every knob with its help")
    parser.add_argument("recipe", nargs="?", default=None, help="YAML recipe (default: built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.max_staleness=4")


def run(args: argparse.Namespace) -> int:
    recipe, overrides = recipe_and_overrides(args)
    if args.action == "describe":
        for key, tname, default, help_ in cfgmod.describe():
            print(f"{key} ({tname}, default {default!r})\n    {help_}")
        return 0
    cfg = cfgmod.load_config(recipe, overrides)
    if args.action == "show":
        print(cfgmod.to_yaml(cfg), end="")
    else:
        print(f"ok: {recipe or 'defaults'} with {len(overrides)} override(s)")
    return 0

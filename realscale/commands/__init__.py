"""One module per ``realscale`` subcommand (see ``realscale/cli.py``)."""

from __future__ import annotations

import argparse


def recipe_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """The ``recipe`` and ``overrides`` positionals, where a first word with ``=`` is an
    override: only overrides were given, no recipe."""
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe:
        recipe, overrides = None, [recipe, *overrides]
    return recipe, overrides

"""The ``realscale`` command.

Subcommands are listed in :data:`COMMANDS` as ``name -> (module, one-line help)``. A
module is imported only when its subcommand runs, so ``realscale --help`` never imports
torch. Each module defines ``add_arguments(parser)`` and ``run(args) -> int``.

A :class:`~realscale.errors.UserError` (a bad config or command line, a missing model or
dataset, a recipe for hardware that is not there, a bad plan) is printed as one line,
``realscale: error: ...``, with exit code 2 and no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from realscale.errors import UserError

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("realscale.commands.train", "run fully asynchronous RL (default: the tiny CPU recipe, embedded servers)"),
    "config": ("realscale.commands.config", "show, check or document the configuration (recipe + overrides)"),
    "info": ("realscale.commands.info", "report the environment: torch, megatron-core, CUDA, compiled kernels"),
    "plan": ("realscale.commands.plan", "place RL roles on a cluster (mesh + dp/tp/pp each) from the cost model; print/write a plan"),
    "serve": ("realscale.commands.serve", "start the embedded generation server (SGLang HTTP protocol)"),
    "judge": ("realscale.commands.judge", "serve the code reward's sandbox over HTTP to runs whose hosts cannot run it (reward.code_judge_url)"),
    "sft": ("realscale.commands.sft", "supervised fine-tuning (prompt/response or chat JSONL, or the task) on the Megatron engine; staged recipes"),
    "eval": ("realscale.commands.eval", "pass@k / avg@n / maj@n of a model on a benchmark file or a task, through generation servers"),
    "data": ("realscale.commands.data", "convert public dataset layouts (GSM8K, MATH, AIME, AReaL, code) into the recipe format"),
    "sweep": ("realscale.commands.sweep", "render one plan and one sbatch job per model size (or config axis); --dry-run prints them"),
    "profile": ("realscale.commands.profile", "measure this machine's hardware profile (decode, train step, weight sync) for the cost model"),
    "simulate": ("realscale.commands.simulate", "simulate whole RL runs (async vs sync) from a recipe or plan: tokens/s, idle, timeline"),
    "rank": ("realscale.commands.rank", "one trainer rank or generation server of a launched run (under srun, torchrun or mpirun)"),
}


class UsageError(UserError):
    """A user mistake that deserves a one-line message rather than a traceback."""


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [
        "usage: realscale <command> [options]",
        "",
        "Fully asynchronous RL for large reasoning models on Megatron-core.",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'realscale <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        from realscale import __version__

        print(f"realscale {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        print(f"realscale: error: unknown command '{name}'{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"realscale {name}", description=help_)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except UserError as exc:  # config, usage, missing model or data, absent hardware, bad plan
        print(f"realscale: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

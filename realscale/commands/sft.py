"""``realscale sft``: supervised fine-tuning on the Megatron engine (realscale/sft.py).

Without ``sft.data``: the default recipe's warm start (a fresh tiny Qwen2 on the task's
answers). With it: any model (``sft.base_model``) on prompt/response or chat JSONL,
response tokens only, in the ``parallel`` layout; ``sft.stages`` runs a staged recipe.
Each stage's ranks are started like ``realscale train``'s trainer ranks
(``launch.backend``: local processes, or a Slurm job step inside an allocation).
"""

from __future__ import annotations

import argparse

from realscale.commands import recipe_and_overrides


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", default=None, help="YAML recipe (default: built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sft.steps=100 sft.output=/tmp/sft")


def run(args: argparse.Namespace) -> int:
    from realscale.cli import UsageError
    from realscale.config import load_config

    recipe, overrides = recipe_and_overrides(args)
    cfg = load_config(recipe, overrides)
    from realscale.errors import LaunchError
    from realscale.launcher import ranks_backend
    from realscale.sft import run_sft

    try:
        result = run_sft(cfg, ranks_backend)
    except ValueError as exc:  # bad task knobs or an unusable base model
        raise UsageError(str(exc)) from None
    except LaunchError as exc:  # a rank failed: its traceback is in its log
        print(f"realscale: {exc}", flush=True)
        return 1
    acc = "n/a" if result.heldout_accuracy is None else f"{result.heldout_accuracy:.3f}"
    for st in result.stages[:-1] if len(result.stages) > 1 else []:
        print(f"  stage {st['dir']}: {st['steps']} steps at max_seq_len {st['max_seq_len']}, nll "
              f"{st['first_loss']:.3f} -> {st['last_loss']:.3f}, {st['examples']} examples, refused {st['refused']}")
    print(f"realscale sft: {result.model_dir}: {result.steps} steps, nll {result.first_loss:.3f} -> "
          f"{result.last_loss:.3f} in {result.train_seconds:.1f} s; held-out accuracy {acc}")
    return 0

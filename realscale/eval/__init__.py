"""Evaluation.

- :mod:`realscale.eval.heldout`: accuracy of a model on a toy task's held-out split, in
  process (the RL run's before/after figure for ``task:`` recipes, and the SFT check).
- :mod:`realscale.eval.benchmark`: ``realscale eval`` on real benchmarks — pass@k, avg@n
  and maj@n through the generation servers the training run uses.
- :mod:`realscale.eval.metrics`: the estimators, pure functions.
"""

from realscale.eval.heldout import (EvalResult, evaluate, evaluate_heldout, generate_completions,
                                    write_result)

__all__ = ["EvalResult", "evaluate", "evaluate_heldout", "generate_completions", "write_result"]

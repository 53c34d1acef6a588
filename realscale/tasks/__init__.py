"""Procedural tasks with checkable answers: the default recipe's prompts.

- :mod:`~realscale.tasks.arith`: two-operand integer arithmetic (``"47+38="`` -> ``"85"``),
  deterministic train / held-out splits, JSONL export for :class:`PromptDataset`, and the
  token layout (chat-templated prompt, answer + EOS) shared by SFT, RL and evaluation.

A dataset source ``task:<name>`` names one of :data:`TASKS`; :func:`resolve_task_source`
turns it into a JSONL file that :class:`realscale.data.dataset.PromptDataset` reads.
"""

from __future__ import annotations

from realscale.tasks.arith import (TASK_PREFIX, TASKS, ArithTask, Problem, encode_example, is_correct,
                                   prompt_ids, resolve_task_source, task_from_config)

__all__ = ["TASK_PREFIX", "TASKS", "ArithTask", "Problem", "encode_example", "is_correct", "prompt_ids",
           "resolve_task_source", "task_from_config"]

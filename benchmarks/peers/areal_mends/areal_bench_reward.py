"""The reward of ``benchmarks/peers/areal_grpo.py``: realscale's verdict (``is_correct``) on
the completion decoded without special tokens, as TRL's and realscale's are. A module of
its own (on the run's ``PYTHONPATH``) so that AReaL's reward wrapper can import it by name
in whatever process it calls it from."""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _tokenizer():  # noqa: ANN202
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.environ["AREAL_BENCH_MODEL"])


def arith_reward(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int],
                 answer: str, **_: Any) -> float:
    """AReaL's reward signature (areal/workflow/rlvr.py ``_compute_rewards``): 1.0 if the
    final number of the completion equals ``answer`` (the row's own field), else 0.0."""
    from realscale.tasks.arith import is_correct

    text = _tokenizer().decode(completion_ids, skip_special_tokens=True)
    return 1.0 if is_correct(text, answer) else 0.0

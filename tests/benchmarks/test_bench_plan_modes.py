"""bench_plan_modes' planner workload: answer lengths from the long-tail task's law."""

from __future__ import annotations

import importlib.util
import itertools
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_plan_modes.py")
_spec = importlib.util.spec_from_file_location("bench_plan_modes", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_answer_lengths_are_the_laws_mean_and_expected_longest_of_a_step() -> None:
    from realscale.config import load_config
    from realscale.tasks.long_tail import LongTailTask

    cfg = load_config(None, ["data.source=task:long_tail", "data.task_min_steps=2", "data.task_max_steps=4",
                             "generate.max_new_tokens=17", "rollout.batch_size=1", "rollout.n_samples=3"])
    mean, longest = bench.answer_lengths(cfg)
    probs = LongTailTask.from_config(cfg.data).step_probs()
    lengths = [10, 15, 17]  # 5 tokens a step, cut at max_new_tokens
    assert mean == pytest.approx(sum(p * n for p, n in zip(probs, lengths)))
    # the longest of 3 answers, by enumerating every draw
    exact = sum(probs[a] * probs[b] * probs[c] * max(lengths[a], lengths[b], lengths[c])
                for a, b, c in itertools.product(range(3), repeat=3))
    assert longest == pytest.approx(exact)
    assert mean < longest < 17

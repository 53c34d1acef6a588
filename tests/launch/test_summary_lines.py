"""The run summary's held-out lines (``accuracy_lines``): before -> after with intervals, the
multi-turn calculator use, and the paired change read from the two evaluations' records."""

from __future__ import annotations

import json
from pathlib import Path

from realscale.launcher.supervisor import accuracy_lines


def _records(path: Path, correct: list[list[bool]]) -> None:
    path.mkdir(parents=True)
    path.joinpath("per_problem.jsonl").write_text(
        "".join(json.dumps({"uid": f"p{i}", "correct": c}) + "\n" for i, c in enumerate(correct)))


def test_task_scores_and_calculator_use_without_records(tmp_path: Path) -> None:
    start = {"greedy": 0.5, "sampled": 0.25, "tool_use_greedy": 0.1, "tool_use_sampled": 0.2}
    end = {"greedy": 0.75, "sampled": 0.5, "tool_use_greedy": 0.9, "tool_use_sampled": 0.8}
    assert accuracy_lines(start, end, str(tmp_path)) == {
        "held-out accuracy (greedy)": "50.0% -> 75.0%",
        "held-out calculator use (greedy)": "10.0% -> 90.0%",
        "held-out accuracy (sampled)": "25.0% -> 50.0%",
        "held-out calculator use (sampled)": "20.0% -> 80.0%",
    }
    assert accuracy_lines(start, None, str(tmp_path))["held-out accuracy (greedy)"] == "50.0% -> n/a"


def test_benchmark_scores_with_intervals_and_the_paired_change(tmp_path: Path) -> None:
    _records(tmp_path / "eval_start", [[False, False], [True, False], [False, False], [True, True]])
    _records(tmp_path / "eval_final", [[True, False], [True, True], [False, False], [True, True]])
    start = {"avg@2": 0.375, "avg@2_ci95": 0.2, "pass@2": 0.5}
    end = {"avg@2": 0.625, "avg@2_ci95": 0.25, "pass@2": 0.75}
    lines = accuracy_lines(start, end, str(tmp_path))
    assert lines["held-out avg@2"] == "37.5% ± 20.0 -> 62.5% ± 25.0"
    assert lines["held-out pass@2"] == "50.0% -> 75.0%"
    assert not any("ci95" in k for k in lines)
    # per-problem changes 0.5, 0.5, 0, 0: mean 0.25, sd 0.2887 -> 1.96 * 0.2887 / 2 = 0.283
    assert lines["held-out avg@2 change (paired)"] == "+25.0 ± 28.3 points (95%)"

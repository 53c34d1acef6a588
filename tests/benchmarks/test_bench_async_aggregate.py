"""bench_async's multi-seed verdict: geometric-mean throughput ratio and mean accuracy gaps."""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Any

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_async.py")
_spec = importlib.util.spec_from_file_location("bench_async", _PATH)
bench_async = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_async)


def _pair(seed: int, a_tokens: float, a_s: float, s_tokens: float, s_s: float,
          greedy: float, sampled: float) -> dict[str, Any]:
    return {"seed": seed, "eta": 4, "recipe": "configs/long_tail_cpu.yaml", "overrides": [],
            "throughput_ratio": (a_tokens / a_s) / (s_tokens / s_s), "trained_samples_per_s_ratio": s_s / a_s,
            "accuracy_gap_points": {"greedy": greedy, "sampled": sampled},
            "runs": {"async_eta4": {"trained_tokens": a_tokens, "rl_seconds": a_s},
                     "sync_eta0": {"trained_tokens": s_tokens, "rl_seconds": s_s}}}


def test_aggregate_judges_the_seeds_together() -> None:
    # seed 1: 4x and -3 points sampled (alone it misses the accuracy bar); seed 2: 1x and +1
    pairs = [_pair(1, 400.0, 10.0, 100.0, 10.0, 0.0, -3.0), _pair(2, 100.0, 10.0, 100.0, 10.0, 1.0, 1.0)]
    agg = bench_async.aggregate(pairs)
    assert agg["seeds"] == [1, 2]
    assert agg["throughput_ratio_geomean"] == pytest.approx(2.0)  # sqrt(4 * 1), not the mean 2.5
    assert agg["throughput_ratio_pooled"] == pytest.approx((500 / 20) / (200 / 20))
    assert (agg["throughput_ratio_min"], agg["throughput_ratio_max"]) == (pytest.approx(1.0), pytest.approx(4.0))
    assert agg["accuracy_gap_points"]["sampled"]["mean"] == pytest.approx(-1.0)
    assert agg["accuracy_gap_points"]["sampled"]["sd"] == pytest.approx(math.sqrt(8.0))
    assert agg["accuracy_gap_points"]["greedy"]["se"] == pytest.approx(math.sqrt(0.5) / math.sqrt(2))
    assert agg["throughput_at_least_2x"] and agg["accuracy_within_2_points"]


def test_aggregate_judges_task_accuracy_when_every_pair_has_it() -> None:
    pairs = [_pair(1, 300.0, 10.0, 100.0, 10.0, 0.0, -3.0), _pair(2, 300.0, 10.0, 100.0, 10.0, 0.0, -1.5)]
    assert bench_async.aggregate(pairs)["task_accuracy_within_2_points"] is None
    pairs[0]["task_accuracy_gap_points"] = {"greedy": -1.0, "sampled": -2.0}
    assert bench_async.aggregate(pairs)["task_accuracy_gap_points"] is None  # one pair lacks it
    pairs[1]["task_accuracy_gap_points"] = {"greedy": 0.0, "sampled": 1.0}
    agg = bench_async.aggregate(pairs)
    assert agg["task_accuracy_gap_points"]["sampled"]["mean"] == pytest.approx(-0.5)
    assert agg["task_accuracy_within_2_points"] and not agg["accuracy_within_2_points"]


def test_aggregate_fails_a_mean_gap_over_two_points() -> None:
    pairs = [_pair(1, 300.0, 10.0, 100.0, 10.0, 0.0, -3.0), _pair(2, 300.0, 10.0, 100.0, 10.0, 0.0, -1.5)]
    agg = bench_async.aggregate(pairs)
    assert agg["throughput_at_least_2x"]
    assert not agg["accuracy_within_2_points"]  # sampled mean -2.25


def test_aggregate_rejects_mixed_eta_and_empty_input() -> None:
    other = _pair(2, 100.0, 10.0, 100.0, 10.0, 0.0, 0.0)
    other["eta"] = 2
    with pytest.raises(ValueError, match="different eta"):
        bench_async.aggregate([_pair(1, 100.0, 10.0, 100.0, 10.0, 0.0, 0.0), other])
    with pytest.raises(ValueError, match="no pair results"):
        bench_async.aggregate([])


def test_seed_of_reads_older_results_from_their_overrides() -> None:
    old = _pair(0, 100.0, 10.0, 100.0, 10.0, 0.0, 0.0)
    del old["seed"]
    old["overrides"] = ["rollout.batch_size=4", "run.seed=3"]
    assert bench_async._seed_of(old) == 3


def test_aggregate_adds_the_colocated_baseline_when_every_pair_ran_it() -> None:
    pairs = [_pair(1, 400.0, 10.0, 100.0, 10.0, 0.0, 0.0), _pair(2, 300.0, 10.0, 100.0, 10.0, 0.0, 0.0)]
    assert "vs_colocated" not in bench_async.aggregate(pairs)
    for p, (ratio, gap) in zip(pairs, ((2.0, -1.0), (0.5, 3.0))):
        p["runs"]["colocated_eta0"] = {}
        p.update({"throughput_ratio_vs_colocated": ratio, "throughput_ratio_colocated_vs_sync": 4.0 / ratio,
                  "trained_samples_per_s_ratio_vs_colocated": ratio,
                  "accuracy_gap_vs_colocated_points": {"greedy": gap, "sampled": gap}})
    c = bench_async.aggregate(pairs)["vs_colocated"]
    assert c["throughput_ratio_geomean"] == pytest.approx(1.0)  # sqrt(2 * 0.5)
    assert c["colocated_vs_sync_geomean"] == pytest.approx(4.0)
    assert c["accuracy_gap_points"]["sampled"]["mean"] == pytest.approx(1.0)
    assert c["task_accuracy_gap_points"] is None
    assert "vs colocated eta=0" in bench_async._seeds_table(bench_async.aggregate(pairs), 4)


def test_colocated_plan_uses_the_cores_of_the_disaggregated_runs(tmp_path) -> None:
    from realscale.config import load_config
    from realscale.planner.apply import apply_plan

    cfg = load_config(os.path.join(os.path.dirname(_PATH), "..", "configs", "long_tail_cpu.yaml"))
    overrides = bench_async.colocated_plan(cfg, str(tmp_path / "plan.yaml"))
    placed = apply_plan(load_config(None, [*overrides, "model.path=tiny-qwen2", "rollout.max_staleness=0"]))
    cores = cfg.parallel.world_size + cfg.generate.num_servers * cfg.generate.tp
    assert placed.parallel.mode == "colocated" and placed.parallel.world_size == cores == 2
    assert placed.generate.num_servers * placed.generate.tp == cores

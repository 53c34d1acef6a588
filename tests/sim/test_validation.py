"""The simulator predicts our own measured CPU runs within ±20% (issue 19, item 2).

Inputs, all committed: the CPU profile measured by ``realscale profile``
(benchmarks/results/cpu_profile.json), bench_async's ten-seed results and a measured
default-recipe run. Nothing in the simulator or the profile is fitted to the two numbers
checked here (realscale/sim/validate.py says what is taken from the runs: their workload
statistics, never their timings). If the simulator, the cost model, the profile or the
committed measurements change so that a prediction drifts outside ±20%, this fails.
"""

from __future__ import annotations

import json
import os

import pytest

from realscale.planner.hardware import load_profile
from realscale.sim import validate as V

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(path: str) -> dict:
    with open(os.path.join(REPO, path), encoding="utf-8") as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def profile():  # noqa: ANN201
    return load_profile(os.path.join(REPO, V.CPU_PROFILE))


def test_the_profile_was_measured_not_assumed(profile) -> None:  # noqa: ANN001
    """The constants the CPU predictions rest on are measured or fitted to micro-measurements."""
    for key in ("gpu.peak_tflops", "gpu.hbm_tbps", "eff.mfu_train", "eff.decode_step_overhead_s",
                "eff.decode_seq_overhead_s", "eff.mfu_decode", "eff.weight_update_overhead_s"):
        assert profile.source(key).kind in ("measured", "fitted"), key
    m = profile.measurements
    assert len(m["decode"]) >= 10 and len(m["train"]) >= 4 and m["sync"]["seconds"] > 0


def test_bench_async_ratio_within_20_percent(profile, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(REPO)
    res = V.predict_bench_async(profile, _load(V.BENCH_ASYNC), seeds=4)
    assert res["measured_ratio"] == pytest.approx(2.275, abs=0.01)  # the committed ten-seed geometric mean
    assert abs(res["error"]) <= V.TOLERANCE, res


def test_default_recipe_step_time_within_20_percent(profile, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(REPO)
    res = V.predict_default_step(profile, _load(V.DEFAULT_RUN), seeds=3)
    assert abs(res["error"]) <= V.TOLERANCE, res


def test_workload_fit_reproduces_the_runs_statistics(monkeypatch) -> None:
    """What is taken from the runs (generated length, kept fraction, kept length) is reproduced."""
    monkeypatch.chdir(REPO)
    from realscale.config import load_config
    from realscale.sim.recipe import task_mix

    bench = _load(V.BENCH_ASYNC)
    stats = V.pooled_stats([r for p in bench["pairs"] for r in p["runs"].values()], 4)
    mix, accept, fit = V.fit_workload(task_mix(load_config("configs/long_tail_cpu.yaml")), stats, 4)
    assert mix.mean() == pytest.approx(stats.mean_generated_len, rel=0.01)
    assert fit["fit_accept"] == pytest.approx(stats.accept_fraction, rel=0.1)
    assert fit["fit_trained_len"] == pytest.approx(stats.mean_trained_len, rel=0.1)

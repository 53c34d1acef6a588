"""The simulator predicts our own measured CPU runs within ±20% (issue 19, item 2).

Inputs, all committed, each with the command that produced it: the CPU profile measured by
``realscale profile`` (benchmarks/results/cpu_profile.json), bench_async's ten-seed results
(benchmarks/results/async_vs_sync_seeds1-10.json) and a measured default-recipe run
(benchmarks/results/default_recipe_run.json: a `realscale train` run of the default recipe on a
quiet machine, recorded by ``python benchmarks/sim_validate.py --from-run``; ``--measure-default``
runs and records one). The measured numbers are recomputed here from the runs' own
summaries, never taken from the simulator. Nothing in the simulator or the profile is
fitted to the two numbers checked (realscale/sim/validate.py says what is taken from the
runs: their workload statistics, never their timings). If the simulator, the cost model,
the profile or the committed measurements change so that a prediction drifts outside
±20%, this fails; the last test shows the check has teeth.
"""

from __future__ import annotations

import dataclasses
import json
import math
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


def test_the_inputs_are_measured_runs_with_their_commands(profile) -> None:  # noqa: ANN001
    """The profile's constants the predictions rest on are measured or fitted to
    micro-measurements; the runs carry the command that produced them and their summaries."""
    for key in ("gpu.peak_tflops", "gpu.hbm_tbps", "eff.mfu_train", "eff.decode_step_overhead_s",
                "eff.decode_seq_overhead_s", "eff.mfu_decode", "eff.weight_update_overhead_s",
                "eff.request_overhead_s"):
        assert profile.source(key).kind in ("measured", "fitted"), key
    m = profile.measurements
    assert len(m["decode"]) >= 10 and len(m["train"]) >= 4 and m["sync"]["seconds"] > 0 and m["requests"]
    bench, run = _load(V.BENCH_ASYNC), _load(V.DEFAULT_RUN)
    assert "bench_async.py" in bench["command"] and len(bench["pairs"]) == 10
    assert all("bench_async.py" in p["command"] for p in bench["pairs"])
    assert ("sim_validate.py --measure-default" in run["command"] or "realscale train" in run["command"])
    assert run["summary"]["steps"] >= 10 and len(run["per_step"]) == run["summary"]["steps"]


def test_bench_async_ratio_within_20_percent(profile, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(REPO)
    bench = _load(V.BENCH_ASYNC)
    res = V.predict_bench_async(profile, bench, seeds=4)
    # measured from the ten pairs' own trained tokens/s, equal to the committed aggregate (2.28x)
    assert res["measured_ratio"] == pytest.approx(bench["aggregate"]["throughput_ratio_geomean"], rel=1e-9)
    assert res["measured_ratio"] == pytest.approx(2.275, abs=0.01)
    assert abs(res["error"]) <= V.TOLERANCE, res


def test_default_recipe_step_time_within_20_percent(profile, monkeypatch) -> None:  # noqa: ANN001
    """The default recipe's mean step (steps after the first) on a quiet machine. It failed
    at -41% against a run taken while other sessions' jobs shared the cores (nice does not
    order threads across Linux autogroups; BENCHMARKS.md) and at -27% with the trainer's
    share of the cores fixed when its step began, while the servers looked idle."""
    monkeypatch.chdir(REPO)
    run = _load(V.DEFAULT_RUN)
    assert run["cpu"]["updates"]["other_jobs_cpu_s"] < 0.1 * run["cpu"]["updates"]["wall_s"]  # a quiet machine
    res = V.predict_default_step(profile, run, seeds=3)
    s = run["summary"]
    assert res["measured_step_s"] == pytest.approx((s["rl_seconds"] - s["step1_seconds"]) / (s["steps"] - 1))
    assert abs(res["error"]) <= V.TOLERANCE, res


def test_the_check_fails_on_a_wrong_profile(profile, monkeypatch) -> None:  # noqa: ANN001
    """The same checks with the server's per-step overhead tripled (a profile measured while
    something else held the core) predict the ratio outside ±20%: the tolerance has teeth."""
    monkeypatch.chdir(REPO)
    slow = dataclasses.replace(profile, eff=dataclasses.replace(
        profile.eff, decode_step_overhead_s=3 * profile.eff.decode_step_overhead_s))
    res = V.predict_bench_async(slow, _load(V.BENCH_ASYNC), seeds=2)
    assert abs(res["error"]) > V.TOLERANCE and math.isfinite(res["predicted_ratio"])


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

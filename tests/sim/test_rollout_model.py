"""The rollout side in the simulator: the measured ingest cost of a rollout process, its
processes, and SGLang's abort-pause floor."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from realscale.planner.hardware import builtin_profile
from realscale.sim.build import MEASURED_ROLLOUT, SGLANG_ABORT_PAUSE_S, RunLayout, Scenario, sync_seconds
from realscale.parallel.mesh import Strategy
from realscale.parallel.model_spec import known_model
from realscale.sim.des import RolloutModel, ServerModel, SimConfig, SimError, TrainerModel, simulate
from realscale.sim.workload import Histogram, Workload

STEP, TRAIN, SYNC = 0.01, 0.5, 0.1
RESULT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results", "rollout_tier.json")


def _run(rollout: RolloutModel, servers: int = 1) -> float:
    """Step seconds of a synchronous run: one group of 4 answers of 50 tokens."""
    w = Workload(1, 4, 10, 1000, Histogram((50,), (1.0,)))
    server = ServerModel(lambda b, ctx: STEP, lambda tokens, reqs: 0.0)
    trainer = TrainerModel(lambda n, p, a: TRAIN, SYNC)
    return simulate(SimConfig(w, eta=0, n_servers=servers, steps=3, warmup=1, rollout=rollout), server,
                    trainer).step_seconds


def test_a_rollout_process_takes_answers_one_at_a_time() -> None:
    cost = RolloutModel(per_token_s=1e-3, per_answer_s=0.02)  # 0.07 s an answer
    assert _run(RolloutModel()) == pytest.approx(50 * STEP + TRAIN + SYNC)
    assert _run(cost) == pytest.approx(50 * STEP + 4 * 0.07 + TRAIN + SYNC)
    # two servers (two answers each), two processes (one server each): half the queue
    assert _run(dataclasses.replace(cost, processes=2), servers=2) == pytest.approx(50 * STEP + 2 * 0.07 + TRAIN + SYNC)


def test_the_load_says_when_the_rollout_side_binds() -> None:
    w = Workload(4, 4, 10, 1000, Histogram((50,), (1.0,)))
    server = ServerModel(lambda b, ctx: STEP, lambda tokens, reqs: 0.0)
    trainer = TrainerModel(lambda n, p, a: 0.01, 0.0)

    def load(per_token: float, processes: int = 1) -> float:
        cfg = SimConfig(w, eta=2, n_servers=4, steps=12, warmup=4, rollout=RolloutModel(per_token, 0.0, processes))
        return simulate(cfg, server, trainer).rollout_load

    light, heavy = load(1e-5), load(1e-3)
    assert 0 < light < 0.5 < heavy
    assert load(1e-3, processes=4) < heavy
    assert RolloutModel(1e-6, 0.0, 2).tokens_per_s(1000) == pytest.approx(2e6)
    with pytest.raises(SimError):
        RolloutModel(-1.0)


def test_the_measured_default_is_the_benchmarks() -> None:
    if not os.path.isfile(RESULT):
        pytest.skip("no benchmarks/results/rollout_tier.json")
    with open(RESULT, encoding="utf-8") as fh:
        derived = json.load(fh)["derived"]
    assert MEASURED_ROLLOUT.per_token_s == pytest.approx(derived["per_token_s"], rel=0.01)
    assert MEASURED_ROLLOUT.per_answer_s == pytest.approx(derived["per_answer_s"], rel=0.01, abs=1e-6)
    assert "bench_rollout_tier.py" in MEASURED_ROLLOUT.source


def test_sglang_abort_pauses_last_a_second_at_least() -> None:
    hw = builtin_profile("H100")
    quick = dataclasses.replace(hw, eff=dataclasses.replace(hw.eff, weight_update_overhead_s=0.05))
    layout = RunLayout(1, 8, Strategy(8, 1, 1))
    spec = known_model("qwen2-1.5b")
    base = sync_seconds(spec, quick, layout)
    assert sync_seconds(spec, quick, layout, pause_floor_s=SGLANG_ABORT_PAUSE_S) == pytest.approx(
        base - 0.05 + SGLANG_ABORT_PAUSE_S)
    w = Workload(8, 2, 16, 64, Histogram((32,), (1.0,)))
    assert Scenario(spec, quick, layout, w, 1, pause_floor_s=1.0).models()[1].sync_seconds == pytest.approx(
        base - 0.05 + 1.0)

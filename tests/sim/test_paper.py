"""The AReaL calibration as committed: its setting, its parameters, and that the simulator
still produces the figures it was fitted with."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from realscale.planner.hardware import builtin_profile
from realscale.sim import paper as P

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CAL = os.path.join(REPO, "benchmarks", "results", "sim_calibration.json")


@pytest.fixture(scope="module")
def committed() -> dict:
    with open(CAL, encoding="utf-8") as fh:
        return json.load(fh)


def test_layouts_follow_the_papers_allocation() -> None:
    """3/4 of the GPUs on SGLang servers, the rest training at the size's (tp, pp), as AReaL's
    benchmark script allocates them (sglang.d{3n/4/tp}m{tp} + d{n/4/tp/pp}m{tp}p{pp})."""
    lay = P.areal_layout(P.SETUPS["7b"], 64)
    assert (lay.gen_servers, lay.gen_tp, str(lay.train)) == (48, 1, "d4t1p4")
    lay = P.areal_layout(P.SETUPS["32b"], 512)
    assert (lay.gen_servers, lay.gen_tp, str(lay.train)) == (48, 8, "d8t2p8")
    v = P.verl_layout(P.SETUPS["1.5b"], 32)
    assert v.colocated and v.gen_servers == 32 and v.train.world == 32
    assert len(P.calibration_points()) == 16


def test_committed_calibration_is_what_its_parameters_give(committed: dict) -> None:
    cal = P.with_params(builtin_profile("H800"), np.array(committed["x"]))
    assert cal.lengths.median == pytest.approx(committed["lengths"]["median"])
    assert cal.lengths.sigma == pytest.approx(committed["lengths"]["sigma"])
    for k in ("hbm_decode", "decode_step_overhead_s", "mfu_train"):
        assert getattr(cal.profile.eff, k) == pytest.approx(committed["profile"]["eff"][k])
        assert cal.profile.source(f"eff.{k}").kind == "fitted"
    assert committed["calibrated_on"]["table1_1.5b"]["speedup"] == 2.77
    assert math.isfinite(committed["rms_log_error"]) and committed["rms_log_error"] < 0.25


def test_the_simulator_still_gives_the_calibrated_figure(committed: dict) -> None:
    """One calibration point re-simulated: if the simulator or the cost model changes the
    committed figures, the calibration (and the predictions made with it) must be redone."""
    cal = P.Calibrated.from_dict(committed)
    sim = P.throughput(cal, "1.5b", 32, 16384 - 1024, "verl", committed["sample"]).tokens_per_s
    assert sim == pytest.approx(committed["fit"]["verl@16k/32"]["simulated"], rel=0.02)

"""`realscale profile` end to end on the tiny recipe: a real server, a real rollout and a
real Megatron trainer are timed, the fit writes a profile whose every constant has a source,
and the planner and the simulator run on it. (The unit tests of the fit use synthetic
measurements; only this one runs the measurement path, which once handed the trainer a
whole batch where it takes mini-batches.)"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from realscale.launcher.calibrate import DECODE_BATCHES, DECODE_PROMPTS, REQUEST_BATCHES
from realscale.planner.hardware import GPU, Efficiency, load_profile

pytestmark = [pytest.mark.e2e, pytest.mark.multiproc, pytest.mark.timeout(1200)]  # ~3-5 min on 2 cores

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _realscale(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "realscale", *args], capture_output=True, text=True, cwd=REPO,
                         timeout=1100)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return out


def test_profile_measures_fits_and_feeds_the_planner_and_the_simulator(tmp_path: Path) -> None:
    path = str(tmp_path / "profile.json")
    window = 8.0  # of the rollout side (30 s by default)
    _realscale("profile", "--repeats", "1", "--rollout-seconds", str(window), "--recipe", "configs/tiny_cpu.yaml",
               "--work", str(tmp_path / "work"), "--out", path)
    prof = load_profile(path)
    m = prof.measurements
    assert len(m["decode"]) == len(DECODE_BATCHES) * len(DECODE_PROMPTS)  # one point per (batch, prompt)
    assert len(m["requests"]) == len(REQUEST_BATCHES) and len(m["train"]) > 0
    assert m["rollout"]["requests"] > 0 and m["sync"]["bytes"] > 0
    # The window ends at the first batch boundary past --rollout-seconds. With the recipe's
    # all-equal filter on, a random-weight model's groups were nearly all dropped and one
    # batch took ~90 s (104 s measured for a 30 s window); a batch takes seconds without it.
    assert window <= m["rollout"]["seconds"] < 2 * window + 10, m["rollout"]
    for f in dataclasses.fields(GPU):
        if f.name != "name":
            assert prof.sources[f"gpu.{f.name}"].kind == "measured", f.name
    for f in dataclasses.fields(Efficiency):
        value = getattr(prof.eff, f.name)
        assert f"eff.{f.name}" in prof.sources and math.isfinite(value) and value >= 0, f.name
    for key in ("mfu_train", "mfu_prefill", "mfu_decode"):
        assert 0 < getattr(prof.eff, key) <= 1, key
    assert prof.gpu.peak_tflops > 0 and prof.gpu.hbm_tbps > 0 and prof.gpu.host_cores == os.cpu_count()

    # the simulator and the planner run on the measured profile
    sim = json.loads(_realscale("simulate", "configs/tiny_cpu.yaml", "--profile", path, "--steps", "4",
                                "--warmup", "1", "--json").stdout)
    assert sim["profile"] == prof.name and len(sim["runs"]) == 2  # asynchronous and synchronous
    assert all(r["tokens_per_s"] > 0 and math.isfinite(r["step_seconds"]) for r in sim["runs"].values())
    plan = json.loads(_realscale("plan", "--profile", path, "--model", str(tmp_path / "work" / "model"), "--nodes",
                                 "1", "--gpus-per-node", "2", "--no-ref", "--json", "--iters", "200", "--batch", "4",
                                 "--n-samples", "4", "--prompt-len", "16", "--gen-len", "64").stdout)
    assert plan["cluster"]["gpu"] == prof.name and {"actor_gen", "actor_train"} <= set(plan["roles"])
    assert math.isfinite(plan["estimate"]["step_seconds"]) and plan["estimate"]["step_seconds"] > 0

"""Without Slurm: the same trainer ranks bootstrap under torchrun (2 gloo ranks, dp=2)
from the run spec, against a real embedded generation server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.multiproc, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]

@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH (it ships with torch)")
def test_two_ranks_under_torchrun(tmp_path: Path, tiny_run_args) -> None:
    from realscale.config import load_config
    from realscale.launcher import start_servers, stop_servers
    from realscale.launcher.spec import RunSpec, spec_path
    from realscale.models.tiny import resolve_model_path

    out = tmp_path / "run"
    cfg = load_config(None, [*tiny_run_args(2, 1, "parallel.dp=2"), f"run.output_dir={tmp_path}", "run.name=run"])
    model = resolve_model_path(cfg.model.path)
    servers = start_servers(model, 1, str(out / "logs"))
    try:
        spec = RunSpec(asdict(cfg), model, str(out), [s.url for s in servers]).save(spec_path(str(out)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1"}
        res = subprocess.run(["torchrun", "--standalone", "--nproc-per-node=2", "-m", "realscale", "rank", "--spec",
                              spec], env=env, capture_output=True, text=True, timeout=400)
    finally:
        stop_servers(servers)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "train/loss" in m] == [1, 2]
    assert (out / "latest_checkpoint").read_text().strip().endswith("step000002")
    # rank 0 drove the rollouts (one driver), both ranks trained (dp=2 shares the batch)
    assert all(m["rollout/trajectories"] == 4.0 for m in metrics if "train/loss" in m)


def test_rank_without_spec_is_a_one_line_error(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "realscale", "rank", "--spec", str(tmp_path / "none.json")],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2
    assert res.stderr.strip().startswith("realscale: error: run spec not found:"), res.stderr

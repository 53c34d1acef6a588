"""`realscale train` with two generation servers keeps training when one is SIGKILLed:
its requests are re-sent to the other, the weight-update group is rebuilt without it,
and every step still runs (the fault test of the RL-loop issue)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_train_resume import ARGS

pytestmark = [pytest.mark.e2e, pytest.mark.multiproc, pytest.mark.timeout(900)]  # a realscale train run


def _servers_of(pid: int) -> list[int]:
    """PIDs of the `realscale serve` processes started by the supervisor ``pid``."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if " serve " in line]


def _steps_done(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"train/loss"' in line)


def test_run_survives_a_killed_generation_server(tmp_path: Path) -> None:
    run = tmp_path / "r"
    args = [a for a in ARGS if not a.startswith("run.total_steps")] + ["run.total_steps=6", "generate.num_servers=2"]
    cmd = [sys.executable, "-m", "realscale", "train", f"run.output_dir={tmp_path}", "run.name=r", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while _steps_done(run) < 2:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no second step in time"
            time.sleep(0.3)
        servers = _servers_of(proc.pid)
        assert len(servers) == 2, servers
        os.kill(servers[1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out.decode()[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m["step"] for m in metrics if "train/loss" in m]
    assert steps == [1, 2, 3, 4, 5, 6], steps
    versions = {m["step"]: m["version"] for m in metrics if "version" in m}
    assert versions[6] == 6.0  # every step's weights reached the surviving server
    assert all(m.get("staleness/max", 0) <= 1 for m in metrics)

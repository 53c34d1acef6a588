"""The stop request without Slurm: SIGUSR1 to `realscale train` makes the ranks
checkpoint at the next step boundary and the run exit 0, before its last step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.multiproc, pytest.mark.timeout(900)]  # realscale train, stopped

REPO = Path(__file__).resolve().parents[2]

def test_sigusr1_checkpoints_and_exits(tmp_path: Path, tiny_run_args) -> None:
    run = tmp_path / "r"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "realscale", "train", f"run.output_dir={tmp_path}", "run.name=r",
                             *tiny_run_args(30, 100, "launch.backend=local")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 400
    while not metrics.exists() or metrics.read_text().count("train/loss") < 1:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no first step in time"
        time.sleep(0.3)
    os.kill(proc.pid, signal.SIGUSR1)
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the run did not stop after SIGUSR1")
    assert proc.returncode == 0, out[-3000:]
    assert "stopped on request" in out and "run the same command again" in out, out[-3000:]
    step = int((run / "latest_checkpoint").read_text().strip()[-6:])
    trained = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if "train/loss" in line]
    assert 1 <= step < 30 and trained == list(range(1, step + 1))
    assert not (run / "summary.json").exists()  # no final evaluation of an unfinished run


def test_stop_servers_kills_children_that_outlive_their_leader(tmp_path: Path) -> None:
    """A server whose child ignores SIGTERM (as vLLM's engine core can under load) leaves
    no orphan: stop_servers kills the rest of the process group once the leader is gone."""
    from realscale.launcher.local import ServerProc, stop_servers

    pid_file = tmp_path / "child.pid"
    script = ("import signal, subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    for _ in range(600):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.1)
    child = int(pid_file.read_text())
    stop_servers([ServerProc("http://127.0.0.1:1", proc, str(tmp_path / "log"))], grace=2.0)
    for _ in range(100):  # SIGKILL is sent; the kernel removes it at its pace
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"child {child} still runs after stop_servers")

"""A generation server that dies, or hangs, is started again and rejoins the run (issue
30, items 3 and 4).

`realscale train` with two embedded servers; after step 2 one is SIGKILLed, or SIGSTOPped
(it hangs: it answers nothing, the pause included). Its requests go to the other; a hung
server misses the next pause by ``generate.control_timeout_s`` and is retired for that
update instead of holding the other paused, and the launcher ends it. The launcher starts
it again (a new process, a new port) and lists it in the run's roster; trainer rank 0
adds it to the next weight update (the weight world is rebuilt with it) and then to the
rotation. The run finishes every step, loses no request, and the restarted server ends
holding exactly the trainer's last weights.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_records import HashWatch, assert_each_prompt_trained_once, hf_hashes, trained_steps

from test_train_resume import ARGS

pytestmark = [pytest.mark.e2e, pytest.mark.multiproc, pytest.mark.timeout(900)]  # a realscale train run


def _servers_of(pid: int) -> list[int]:
    """PIDs of the `realscale serve` processes started by the supervisor ``pid``."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if " serve " in line]


def _restarted_server(run: Path) -> str | None:
    """The URL of the first server the launcher started again (from the run's roster)."""
    entries = json.loads((run / "launch" / "servers" / "roster.json").read_text())["servers"]
    return next((e["url"] for e in entries if e["restarts"] > 0), None)


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_failed_server_restarts_and_rejoins(tmp_path: Path, fault: str) -> None:
    total = 8
    run = tmp_path / "r"
    args = [a for a in ARGS if not a.startswith("run.total_steps")] + [f"run.total_steps={total}",
                                                                        "generate.num_servers=2",
                                                                        "generate.control_timeout_s=5"]
    cmd = [sys.executable, "-m", "realscale", "train", f"run.output_dir={tmp_path}", "run.name=r", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    watch = HashWatch(lambda: _restarted_server(run))
    try:
        deadline = time.monotonic() + 400
        while len(trained_steps(run)) < 2:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no second step in time"
            time.sleep(0.3)
        servers = _servers_of(proc.pid)
        assert len(servers) == 2, servers
        os.kill(servers[1], getattr(signal, fault))
        out, _ = proc.communicate(timeout=600)
    finally:
        seen = watch.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.decode()
    assert proc.returncode == 0, text[-3000:]
    assert "starting it again (1 of launch.server_restarts=3)" in text, text[-3000:]
    why = "exited with code -9" if fault == "SIGKILL" else "was retired by the trainer"
    assert "generation server 1 (http://127.0.0.1:" in text and why in text, text[-3000:]
    assert_each_prompt_trained_once(run, total)  # the dead server's requests were resent, and counted once
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in metrics if "train/loss" in m]
    assert all(m["rollout/lost_requests"] == 0 for m in logged)  # every request finished somewhere
    assert logged[-1]["rollout/server_restarts"] == 1 and logged[-1]["rollout/servers_alive"] == 2, logged[-1]
    assert all(m.get("staleness/max", 0) <= 1 for m in metrics)
    # the restarted server took part in the last weight update: it holds the trainer's weights, bit for bit
    assert str(total) in seen, sorted(seen)
    want = hf_hashes(run / "final")
    assert seen[str(total)] == want, sorted(n for n in want if seen[str(total)].get(n) != want[n])


def test_two_rollout_processes_train_every_prompt_once(tmp_path: Path) -> None:
    """``rollout.processes=2`` (the rollout tier scaled out, realscale/rollout/sharded.py):
    two rollout processes, a server each, one staleness rule; every step trains a batch
    joined from both, no prompt twice, within the staleness bound."""

    total = 4
    run = tmp_path / "r"
    args = [a for a in ARGS if not a.startswith("run.total_steps")] + [f"run.total_steps={total}",
                                                                        "generate.num_servers=2",
                                                                        "rollout.processes=2"]
    out = subprocess.run([sys.executable, "-m", "realscale", "train", f"run.output_dir={tmp_path}", "run.name=r",
                          *args], capture_output=True, text=True, timeout=800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert trained_steps(run) == list(range(1, total + 1))
    assert_each_prompt_trained_once(run, total)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in metrics if "train/loss" in m]
    assert all(m["rollout/groups"] == 2 and m["rollout/servers_alive"] == 2 for m in logged), logged[-1]
    assert all(m.get("staleness/max", 0) <= 1 for m in metrics)


def test_every_server_killed_at_once_gets_the_weights_again(tmp_path: Path) -> None:
    """Both servers SIGKILLed at once (issue 30, "all servers down"): no rollout can come,
    so no step and no weight update would either. Trainer rank 0 sees that no server is in
    rotation while it waits for its batch; once the launcher has started them again it
    republishes the current weights (the same version) to them, every trainer rank taking
    part, and the run finishes. The launcher is held (SIGSTOP) until the trainer says it
    waits for it, so the outage is certain to fall into a wait for a batch."""
    import threading

    total = 5
    run = tmp_path / "r"
    # η = 0: at most one batch is ready ahead, so a later step must wait for the restarted servers
    args = [a for a in ARGS if not a.startswith(("run.total_steps", "rollout.max_staleness"))] + [
        f"run.total_steps={total}", "rollout.max_staleness=0", "generate.num_servers=2", "generate.control_timeout_s=5"]
    cmd = [sys.executable, "-m", "realscale", "train", f"run.output_dir={tmp_path}", "run.name=r", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines: list[bytes] = []

    def read() -> None:
        for line in iter(proc.stdout.readline, b""):
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    text = lambda: b"".join(lines).decode(errors="replace")  # noqa: E731
    try:
        deadline = time.monotonic() + 400
        while len(trained_steps(run)) < 2:
            assert proc.poll() is None, text()[-3000:]
            assert time.monotonic() < deadline, "no second step in time"
            time.sleep(0.3)
        servers = _servers_of(proc.pid)
        assert len(servers) == 2, servers
        os.kill(proc.pid, signal.SIGSTOP)  # the launcher: no restart yet
        for pid in servers:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while "waiting for the launcher to start again" not in text():
            assert proc.poll() is None and time.monotonic() < deadline, text()[-3000:]
            time.sleep(0.3)
        os.kill(proc.pid, signal.SIGCONT)
        proc.wait(timeout=600)
        reader.join(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = text()
    assert proc.returncode == 0, out[-3000:]
    assert out.count("starting it again (1 of launch.server_restarts=3)") == 2, out[-3000:]
    assert "no generation server in rotation; republishing the current weights" in out, out[-3000:]
    republished = [int(v) for v in re.findall(r"republished weight version (\d+) in", out)]
    assert republished and set(republished) <= set(range(2, total)), out[-3000:]  # the version trained last
    assert trained_steps(run) == list(range(1, total + 1))
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in metrics if "train/loss" in m]
    assert [m["version"] for m in logged] == [float(v) for v in range(1, total + 1)]
    assert logged[-1]["rollout/republishes"] >= 1 and logged[-1]["rollout/server_restarts"] == 2, logged[-1]
    assert logged[-1]["rollout/servers_alive"] >= 1, logged[-1]
    assert all(m.get("staleness/max", 0) <= 1 for m in metrics)

"""`sbatch launch/slurm/ppo_tiny.sh` on a real one-node Slurm cluster (.ci/slurm_up.sh):
one generation server step and one two-task trainer step under the Slurm backend.

- a job that gets the time-limit signal (USR1) checkpoints, requeues itself and, started
  again, resumes from that checkpoint: every step logged once, no prompt trained twice;
- a killed generation server (its job step, ``rs-server<i>``) is started again as a new
  step and rejoins at the next weight update; the job completes every step;
- one killed trainer task fails the job cleanly: non-zero exit, the other tasks and
  steps ended, no process left behind.

Skipped, with the reason, where no Slurm controller answers.
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

pytestmark = [pytest.mark.e2e, pytest.mark.multiproc, pytest.mark.usefixtures("slurm"), pytest.mark.timeout(900)]  # sbatch jobs

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "launch/slurm/ppo_tiny.sh"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "REALSCALE_PYTHON": sys.executable, "PYTHONPATH": path}


def _submit(out: Path, *overrides: str, wait: bool = True) -> tuple[subprocess.Popen, str]:
    """``sbatch [--wait]`` the CI script in the background; returns it and the job id."""
    cmd = ["sbatch", *(["--wait"] if wait else []), "--parsable", f"--output={out}/slurm-%j.out", SCRIPT,
           f"run.output_dir={out}", *overrides]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job = proc.stdout.readline().strip().split(";")[0]
    assert job.isdigit(), f"sbatch printed {job!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
    return proc, job


def _job(job: str) -> dict[str, str]:
    text = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S+)", text))


def _wait_for_step(run: Path, step: int, proc: subprocess.Popen, job: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(trained_steps(run)) < step:
        if (info := _job(job)).get("JobState") in ENDED:
            pytest.fail(f"job {job} ended before step {step}: {info}")
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job])
            pytest.fail(f"job {job} did not reach step {step} in {timeout:.0f} s")
        time.sleep(0.3)


def _ended(job: str, timeout: float) -> dict[str, str]:
    """Poll the job until it has ended (sbatch --wait polls only every few seconds)."""
    deadline = time.monotonic() + timeout
    while (info := _job(job)).get("JobState") not in ENDED:
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job])
            pytest.fail(f"job {job} did not end within {timeout:.0f} s: {info}")
        time.sleep(0.3)
    return info


def _finish(proc: subprocess.Popen, job: str, timeout: float = 300) -> int:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", job])
        pytest.fail(f"job {job} did not end within {timeout:.0f} s after the test's action: {_job(job)}")
    return proc.returncode


def _processes() -> list[tuple[int, str, list[bytes]]]:
    """(pid, command line, environment) of every process we may inspect (read from /proc:
    ps truncates command lines to the terminal's width)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours
            continue
        out.append((int(entry.name), args, env))
    return out


def _leftovers(marker: str) -> list[str]:
    """Processes whose command line names this run (its spec or run directory)."""
    return [f"{pid} {args}" for pid, args, _ in _processes() if marker in args]


@pytest.mark.slow  # the same USR1 -> checkpoint -> requeue -> resume runs across two nodes in e2e (test_multinode.py)
def test_time_limit_signal_checkpoints_requeues_and_resumes(tmp_path: Path) -> None:
    total = 12  # steps take ~1 s: the stop lands well before the end
    run = tmp_path / "ppo_tiny"
    proc, job = _submit(tmp_path, f"run.total_steps={total}", "run.checkpoint_every=100")
    _wait_for_step(run, 2, proc, job)
    # what Slurm does `--signal=B:USR1@secs` before the time limit
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    assert _finish(proc, job) == 0, (tmp_path / f"slurm-{job}.out").read_text()[-3000:]

    info = _job(job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", info
    log = (tmp_path / f"slurm-{job}.out").read_text()
    stopped = re.search(r"stopped on request \(requeue\); last checkpoint \S+step(\d+)", log)
    assert stopped, log[-3000:]
    assert 2 <= int(stopped[1]) < total  # checkpointed mid-run, at a step boundary
    assert "restart 1" in log
    # every step exactly once: the first run's steps up to its checkpoint, then the rest
    assert trained_steps(run) == list(range(1, total + 1))
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {m["step"]: m["version"] for m in metrics if "version" in m}[total] == float(total)
    assert_each_prompt_trained_once(run, total)
    # every role logged under the run directory
    for name in ("rank0.log", "rank1.log", "server0.log"):
        assert (run / "logs" / name).stat().st_size > 0, name
    assert "stopped on request" in (run / "logs" / f"batch-{job}.out").read_text()  # the supervisor's output
    assert json.loads((run / "summary.json").read_text())["accuracy_end"] is not None


def _rank_pid(run: Path, procid: str) -> int:
    """The pid of trainer task ``procid`` of this run (from its command line and environment)."""
    spec = f"{run}/launch/spec.json"
    for pid, args, env in _processes():
        if spec in args and "--server" not in args and " rank " in args and args.startswith(sys.executable) \
                and f"SLURM_PROCID={procid}".encode() in env:
            return pid
    raise AssertionError(f"no trainer task {procid} of {run} found: {_leftovers(str(run))}")


def test_a_killed_trainer_task_fails_the_job_cleanly(tmp_path: Path) -> None:
    """One killed task of the trainer step: the other tasks and the server steps are
    ended, the job fails, nothing is left running."""
    run = tmp_path / "ppo_tiny"
    proc, job = _submit(tmp_path, "run.total_steps=500", wait=False)
    _wait_for_step(run, 1, proc, job)
    os.kill(_rank_pid(run, "1"), 9)
    expect = "a process of the run failed"
    t0 = time.monotonic()
    info = _ended(job, timeout=120)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert time.monotonic() - t0 < 90, "the job took too long to fail"
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0" and info["Restarts"] == "0", info
    assert expect in log, log[-3000:]
    assert len(trained_steps(run)) < 500
    time.sleep(1)
    assert not _leftovers(str(run)), _leftovers(str(run))
    assert not subprocess.run(["squeue", "-h", "-s", "-j", job], capture_output=True, text=True).stdout.strip()


def test_a_killed_server_step_is_started_again(tmp_path: Path) -> None:
    """Issue 30, item 3 under Slurm: one of two server steps is SIGKILLed; the supervisor
    starts it again as a new job step within the job, it rejoins at the next weight update,
    and the job completes every step with no request lost."""
    total = 8
    run = tmp_path / "ppo_tiny"
    proc, job = _submit(tmp_path, f"run.total_steps={total}", "generate.num_servers=2")
    _wait_for_step(run, 2, proc, job)
    steps = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"], capture_output=True,
                           text=True).stdout.split("\n")
    victim = [s.split()[0] for s in steps if s.endswith(" rs-server1")]
    assert victim, steps
    subprocess.run(["scancel", "--signal=KILL", victim[0]], check=True)
    assert _finish(proc, job) == 0, (tmp_path / f"slurm-{job}.out").read_text()[-3000:]
    info = _job(job)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", info
    assert "generation server 1" in log and "starting it again (1 of" in log, log[-3000:]
    assert "generation server 1 is back on" in log, log[-3000:]
    assert_each_prompt_trained_once(run, total)  # the dead server's requests were resent, and counted once
    logged = [m for m in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()) if "train/loss" in m]
    assert all(m["rollout/lost_requests"] == 0 for m in logged)
    assert logged[-1]["rollout/server_restarts"] == 1 and logged[-1]["rollout/servers_alive"] == 2, logged[-1]
    time.sleep(1)
    assert not _leftovers(str(run)), _leftovers(str(run))


def _server_pid(run: Path, index: int) -> int:
    """The process of server ``index``'s step (``realscale rank --spec <run>/... --server
    --index i``; not the ``srun`` that started it, whose command line names the same)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if (entry.name.isdigit() and "--server" in args and args[-2:] == ["--index", str(index)]
                and any(str(run) in a for a in args) and not os.path.basename(args[0]).startswith("srun")):
            found.append(int(entry.name))
    assert len(found) == 1, f"server {index}'s process: {found}"
    return found[0]


def _stop_mid_update(log: Path, pid: int, tries: int, timeout: float = 240) -> int:
    """SIGSTOP server ``pid`` as soon as its log says a weight update has begun (``pausing
    generation``), then judge from the log, which it can no longer write: if it had already
    received that update's weights the stop came too late — SIGCONT, wait for the next
    update (at most ``tries``). Returns how many updates it let pass; the server is left
    stopped in the middle of one."""
    deadline = time.monotonic() + timeout
    seen = len(log.read_bytes())
    for late in range(tries):
        while b"pausing generation" not in (text := log.read_bytes())[seen:]:
            assert time.monotonic() < deadline, f"no weight update reached {log} in time"
            time.sleep(0.002)
        os.kill(pid, signal.SIGSTOP)
        begun = text.index(b"pausing generation", seen)
        time.sleep(1.0)  # what it printed before the stop reaches the log (srun relays it)
        after = log.read_bytes()[begun:]
        if b"received weights version" not in after:
            return late
        seen = len(after) + begun
        os.kill(pid, signal.SIGCONT)
    pytest.fail(f"in {tries} weight updates the stop never landed before the server had its weights")


def test_a_server_killed_mid_weight_update_is_started_again(tmp_path: Path) -> None:
    """Issue 30, item 3 under Slurm, mid-update: one of two server steps is stopped after a
    weight update has paused it and before it has received that update's weights (its log
    says where it stands), then SIGKILLed. The trainer retires it in that update and
    completes the update on the other (no step waits on it); the supervisor starts it
    again as a new step, it rejoins at a later update, the job completes every step,
    every prompt is trained once, no request is lost, and the restarted server holds the
    trainer's final weights bit for bit."""
    total = 10
    run = tmp_path / "ppo_tiny"
    proc, job = _submit(tmp_path, f"run.total_steps={total}", "generate.num_servers=2",
                        "generate.control_timeout_s=5")
    watch = HashWatch(lambda: _restarted_server(run))
    try:
        _wait_for_step(run, 2, proc, job)
        victim = _server_pid(run, 1)
        late = _stop_mid_update(run / "logs" / "server1.log", victim, tries=5)
        os.kill(victim, signal.SIGKILL)
        assert _finish(proc, job) == 0, (tmp_path / f"slurm-{job}.out").read_text()[-3000:]
    finally:
        seen = watch.close()
    print(f"server 1 stopped mid-update after {late} update(s) had gone by too fast")
    info = _job(job)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", info
    assert "generation server 1" in log and "starting it again (1 of" in log, log[-3000:]
    rank0 = (run / "logs" / "rank0.log").read_text()
    assert re.search(r"server http://\S+ (went away during a weight transfer|did not answer|does not answer)"
                     r".*retired", rank0), rank0[-3000:]
    assert_each_prompt_trained_once(run, total)
    logged = [m for m in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()) if "train/loss" in m]
    assert all(m["rollout/lost_requests"] == 0 for m in logged)
    assert logged[-1]["rollout/server_restarts"] == 1 and logged[-1]["rollout/servers_alive"] == 2, logged[-1]
    assert str(total) in seen, sorted(seen)  # the restarted server took part in the last update
    want = hf_hashes(run / "final")
    assert seen[str(total)] == want, sorted(n for n in want if seen[str(total)].get(n) != want[n])
    time.sleep(1)
    assert not _leftovers(str(run)), _leftovers(str(run))


def _restarted_server(run: Path) -> str | None:
    """The URL of the first server the launcher started again (from the run's roster)."""
    path = run / "launch" / "servers" / "roster.json"
    if not path.exists():
        return None
    entries = json.loads(path.read_text())["servers"]
    return next((e["url"] for e in entries if e["restarts"] > 0), None)

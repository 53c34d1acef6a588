"""Multi-node Slurm jobs through the real launcher, on the two-node cluster of
``.ci/cluster_up.sh 2`` (each node a network + UTS namespace: its own host name, address
and interface ``rs0`` on a private bridge; one filesystem, as a cluster shares its storage).

One script, rendered by ``realscale sweep`` from configs/ppo_tiny_slurm.yaml for two
nodes (``--ntasks-per-node=2``, servers on 0.0.0.0), submitted with ``sbatch``:

- (a) disaggregated across nodes: a CPU plan puts the generation server on rs-node1 and
  both trainer ranks on rs-node2; the run finishes and its logs name the two hosts;
- (b) data parallel across nodes (no plan: rank 0 on rs-node1, rank 1 on rs-node2): the
  weight world and the batch scatter cross nodes; every byte of each publish and each
  scatter arrives (the lower bounds), the server's log-probs match the trainer's, and the
  server's weights at the last version are the trainer's final weights;
- (c) a node whose view of the run directory differs (its slurmd restarted in a mount
  namespace of its own with a tmpfs over the run's parent) is refused at start, in one line;
- (d) a node lost mid-run (every process in rs-node2 killed): the job ends, is requeued
  on the remaining node (``--nodes=1-2``), resumes from its checkpoint and logs every
  step once, no prompt trained twice.

Skipped, with cluster_up.sh's reason, where namespaces or Slurm are unavailable.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
from run_records import HashWatch, assert_each_prompt_trained_once, hf_hashes, trained_steps

pytestmark = [pytest.mark.e2e, pytest.mark.multiproc, pytest.mark.timeout(420)]  # each test; the module: ~8 min

REPO = Path(__file__).resolve().parents[2]
STATE = os.environ.get("RS_CLUSTER_STATE", "/var/lib/realscale-cluster")
CONF = f"{STATE}/slurm.conf"
NET = os.environ.get("RS_CLUSTER_NET", "10.211.0")  # node i at NET.(10 + i), as cluster_lib.sh numbers them
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
# every run: the tiny model, a small held-out split, short answers
RUN = ["data.task_heldout=8", "rollout.batch_size=2", "rollout.n_samples=2", "generate.max_new_tokens=4"]
PLAN = """mode: disaggregated
roles:
  actor_gen: {mesh: "0:1", strategy: d1t1p1}
  actor_train: {mesh: "2:4", strategy: d2t1p1}
"""


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "SLURM_CONF": CONF, "REALSCALE_PYTHON": sys.executable, "PYTHONPATH": path}


def _sh(*cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO, timeout=timeout)


def _node(action: str, node: str, *cmd: str) -> str:
    res = _sh("bash", ".ci/cluster_node.sh", action, node, *cmd)
    assert res.returncode == 0, f"cluster_node.sh {action} {node}: {res.stderr}"
    return res.stdout


def _wait_idle(nodes: int = 2, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        states = _sh("sinfo", "-h", "-N", "-o", "%N %t").stdout.split("\n")
        if sum(line.endswith(" idle") for line in states) == nodes:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"cluster nodes not idle after {timeout:.0f} s: {states}")
        time.sleep(0.3)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """A two-node cluster for this module (its own state: the one-node cluster of
    .ci/slurm_up.sh may run beside it), torn down afterwards; SLURM_CONF points at it."""
    if "RS_CLUSTER_KEEP" not in os.environ or _sh("sinfo", "-h").returncode != 0:
        up = subprocess.run(["bash", ".ci/cluster_up.sh", "2"], capture_output=True, text=True, cwd=REPO,
                            timeout=600)
        if up.returncode == 3:
            pytest.skip(up.stderr.strip().splitlines()[-1])
        assert up.returncode == 0, f"cluster_up.sh 2 failed (exit {up.returncode}): {up.stderr[-2000:]}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", CONF)
        yield
    if "RS_CLUSTER_KEEP" not in os.environ:  # RS_CLUSTER_KEEP=1: leave it up (debugging)
        subprocess.run(["bash", ".ci/cluster_down.sh"], capture_output=True, cwd=REPO, timeout=300)


@pytest.fixture(scope="module")
def script(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The two-node job script, rendered by `realscale sweep` (as a user renders one)."""
    work = tmp_path_factory.mktemp("sweep")
    (work / "sweep.yaml").write_text(
        "name: multinode\njobs:\n  mn_tiny:\n    recipe: configs/ppo_tiny_slurm.yaml\n"
        "    overrides: [launch.nodes=2, launch.ntasks=4, generate.host=0.0.0.0]\n")
    res = _sh(sys.executable, "-m", "realscale", "sweep", str(work / "sweep.yaml"), "--out", str(work / "slurm"))
    assert res.returncode == 0, res.stderr
    text = (work / "slurm" / "mn_tiny.sh").read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=2" in text, text
    return str(work / "slurm" / "mn_tiny.sh")


def _submit(script: str, out: Path, *overrides: str, sbatch: tuple[str, ...] = ()) -> str:
    res = _sh("sbatch", "--parsable", f"--output={out}/slurm-%j.out", *sbatch, script, f"run.output_dir={out}",
              *RUN, *overrides)
    job = res.stdout.strip().split(";")[0]
    assert res.returncode == 0 and job.isdigit(), f"sbatch: {res.stdout} {res.stderr}"
    return job


def _job(job: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", _sh("scontrol", "show", "job", job).stdout))


def _ended(job: str, timeout: float) -> dict[str, str]:
    """Poll the job until it has ended (sbatch --wait polls only every few seconds)."""
    deadline = time.monotonic() + timeout
    while (info := _job(job)).get("JobState") not in ENDED:
        if time.monotonic() > deadline:
            _sh("scancel", job)
            pytest.fail(f"job {job} did not end within {timeout:.0f} s: {info}")
        time.sleep(0.3)
    return info


def _metrics(run: Path) -> list[dict]:
    return [m for line in (run / "metrics.jsonl").read_text().splitlines() if "train/loss" in (m := json.loads(line))]


def _first_line(log: Path, prefix: str) -> str:
    lines = [line for line in log.read_text().splitlines() if line.startswith(prefix)]
    assert lines, f"no '{prefix}' line in {log}: {log.read_text()[-2000:]}"
    return lines[0]


def _output(out: Path, job: str) -> str:
    return (out / f"slurm-{job}.out").read_text()


def _finished(out: Path, job: str, steps: int, timeout: float = 300) -> Path:
    info = _ended(job, timeout)
    run = out / "ppo_tiny"
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, _output(out, job)[-3000:])
    assert trained_steps(run) == list(range(1, steps + 1))
    return run


def _first_server(run: Path) -> str | None:
    """The run's server 0 (the server step writes its URL file once bound)."""
    found = sorted((run / "launch" / "servers").glob("*/0.url"))
    return found[-1].read_text().strip() if found else None


# ----------------------------------------------------------------------------- (a)


def test_disaggregated_server_and_trainer_on_different_nodes(script: str, tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    job = _submit(script, tmp_path, "run.total_steps=3", "run.checkpoint_every=100", f"parallel.plan={plan}")
    run = _finished(tmp_path, job, 3)
    logs = run / "logs"
    server = _first_line(logs / "server0.log", "realscale server 0")
    ranks = [_first_line(logs / f"rank{i}.log", f"realscale rank {i}/2") for i in (0, 1)]
    assert f" on rs-node1 (advertised {NET}.11, gloo interface rs0)" in server, server
    for i, line in enumerate(ranks):  # both trainer ranks on the other node, local ranks 0 and 1
        assert f"(local {i}/2) on rs-node2 (advertised {NET}.12, gloo interface rs0)" in line, line
        assert f"master {NET}.12:" in line, line
    assert all(m["perf/weight_sync_bytes"] == m["perf/weight_sync_bytes_lower_bound"] > 0 for m in _metrics(run))


# ----------------------------------------------------------------------------- (b)


def test_data_parallel_ranks_across_nodes(script: str, tmp_path: Path) -> None:
    steps = 4
    job = _submit(script, tmp_path, f"run.total_steps={steps}", "run.checkpoint_every=100")
    watch = HashWatch(lambda: _first_server(tmp_path / "ppo_tiny"))
    try:
        run = _finished(tmp_path, job, steps)
    finally:
        seen = watch.close()
    logs = run / "logs"
    for i, node in enumerate(("rs-node1", "rs-node2")):  # one rank per node: dp across nodes
        line = _first_line(logs / f"rank{i}.log", f"realscale rank {i}/2")
        assert f"(local 0/1) on {node} (advertised {NET}.{11 + i}, gloo interface rs0)" in line, line
        assert f"master {NET}.11:" in line, line
    for m in _metrics(run):
        # the weight world (2 trainer ranks on two nodes -> the server) and the batch
        # scatter (rank 0 -> rank 1 on the other node) move every byte they must, once
        assert m["perf/weight_sync_bytes"] == m["perf/weight_sync_bytes_lower_bound"] > 0, m
        assert m["perf/batch_bytes"] == m["perf/batch_bytes_lower_bound"] > 0, m
        # the server's log-probs are the trainer's (the same weights)
        assert abs(m["train/behav_kl"]) < 1e-4, m
    # the server's weights at the last version are the trainer's final weights
    assert str(steps) in seen, f"the server was not seen at version {steps} (seen: {sorted(seen)})"
    want = hf_hashes(run / "final")
    assert seen[str(steps)] == want, sorted(n for n in want if seen[str(steps)].get(n) != want[n])


# ----------------------------------------------------------------------------- (c)


def test_a_node_that_cannot_see_the_run_directory_is_refused(script: str, tmp_path: Path) -> None:
    """rs-node2's slurmd (and so every task it starts) gets a mount namespace of its own
    with an empty tmpfs over this test's directory: the node is up, the storage view differs."""
    _node("kill", "rs-node2")
    try:
        _node("exec", "rs-node2", "unshare", "--mount", "--propagation", "private", "sh", "-c",
              f"mount -t tmpfs rs-private {tmp_path} && exec slurmd -N rs-node2 -f {CONF}")
        _wait_idle()
        job = _submit(script, tmp_path, "run.total_steps=2")
        info = _ended(job, timeout=120)
        log = _output(tmp_path, job)
        assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", (info, log[-3000:])
        errors = [line for line in log.splitlines() if "is not on storage all nodes share" in line]
        assert len(errors) == 1 and "nodes rs-node2 cannot see it" in errors[0], log[-3000:]
        assert not (tmp_path / "ppo_tiny" / "logs" / "server0.log").exists()  # refused before any role started
    finally:
        _node("kill", "rs-node2")
        _node("start", "rs-node2")
        _wait_idle()


# ----------------------------------------------------------------------------- (d)


def test_a_lost_node_requeues_on_the_remaining_node_and_resumes(script: str, tmp_path: Path) -> None:
    total = 8
    job = _submit(script, tmp_path, f"run.total_steps={total}", "run.checkpoint_every=2")
    run = tmp_path / "ppo_tiny"
    deadline = time.monotonic() + 240
    while len(trained_steps(run)) < 3:
        assert _job(job).get("JobState") not in ENDED, (_job(job), _output(tmp_path, job)[-3000:])
        assert time.monotonic() < deadline, "no third step in 240 s"
        time.sleep(0.3)
    lost_at = len(trained_steps(run))
    _node("kill", "rs-node2")
    try:
        # Slurm marks the node DOWN, ends the job's steps and requeues it (JobRequeue); the
        # requeued job asks for what it had (2 nodes): fit it to the node that is left, as
        # an operator would (the run needs no plan change: no plan, dp=2 on one node)
        _requeued(job, timeout=120)
        _gone(str(run), timeout=60)  # the first run ended cleanly on the node that is left
        res = _sh("scontrol", "update", f"JobId={job}", "NumNodes=1-1", "NumTasks=2", "NumCPUs=2")
        assert res.returncode == 0, res.stderr
        info = _ended_after_restart(job, timeout=300)
        log = _output(tmp_path, job)
        assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, (info, log[-4000:])
        assert info["NodeList"] == "rs-node1", info
        assert "restart 1 on rs-node1" in log, log[-4000:]
        # resumed from the checkpoint before the loss: every step once, every prompt once
        assert trained_steps(run) == list(range(1, total + 1)), (lost_at, trained_steps(run))
        assert_each_prompt_trained_once(run, total)
    finally:
        _node("start", "rs-node2")
        _wait_idle()


def _leftovers(marker: str) -> list[str]:
    """Processes whose command line names this run (read from /proc: ps truncates them)."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # not a process, or gone
            continue
        if entry.name.isdigit() and marker in args:
            out.append(f"{entry.name} {args}")
    return out


def _gone(marker: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while left := _leftovers(marker):
        if time.monotonic() > deadline:
            pytest.fail(f"processes of the run still there {timeout:.0f} s after the job ended: {left}")
        time.sleep(0.5)


def _requeued(job: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ((info := _job(job)).get("JobState") == "PENDING" and info.get("Restarts") == "1"):
        if info.get("JobState") in ENDED:
            pytest.fail(f"job {job} ended instead of being requeued: {info}")
        if time.monotonic() > deadline:
            pytest.fail(f"job {job} was not requeued within {timeout:.0f} s of the node's loss: {info}")
        time.sleep(0.3)


def _ended_after_restart(job: str, timeout: float) -> dict[str, str]:
    """The job's final state once it ran again after a requeue."""
    deadline = time.monotonic() + timeout
    while True:
        info = _job(job)
        if info.get("JobState") in ENDED and int(info.get("Restarts", "0")) >= 1:
            return info
        if info.get("JobState") in ("FAILED", "CANCELLED", "TIMEOUT") and info.get("Restarts") == "0":
            return info  # ended for good without a requeue: the assertions say so
        if time.monotonic() > deadline:
            _sh("scancel", job)
            pytest.fail(f"job {job} did not run again and end within {timeout:.0f} s: {info}")
        time.sleep(0.5)

"""Multi-node Slurm jobs through the real launcher, on the two-node cluster of
``.ci/cluster_up.sh 2`` (each node a network + UTS namespace: its own host name, address
and interface ``rs0`` on a private bridge; one filesystem, as a cluster shares its storage).

One script, rendered by ``realscale sweep`` from configs/ppo_tiny_slurm.yaml for two
nodes (``--ntasks-per-node=2``, servers on 0.0.0.0), submitted with ``sbatch``:

- (a) disaggregated across nodes, submitted by ``realscale sweep --submit``: a CPU plan
  puts the generation server on rs-node1 and both trainer ranks on rs-node2; the run
  finishes and its logs name the two hosts;
- (b) data parallel across nodes (no plan: rank 0 on rs-node1, rank 1 on rs-node2): the
  weight world and the batch scatter cross nodes; every byte of each publish and each
  scatter arrives (the lower bounds), the server's log-probs match the trainer's, and the
  server's weights at the last version are the trainer's final weights;
- (b2) tp=2 within each node and pp=2 across the two, into a server: the weight world
  gathers both nodes' shards at the lower bound; after every update seen, the server holds
  the trainer's snapshot of that step bit for bit;
- (c) a node whose view of the run directory differs (its slurmd restarted in a mount
  namespace of its own with a tmpfs over the run's parent) is refused at start, in one line;
- (d) a node lost mid-run (every process in rs-node2 killed): the job ends, is requeued
  on the remaining node (fitted to it with ``scontrol update``, as an operator would:
  Slurm does not shrink a job by itself), resumes from its checkpoint and logs every step
  once, no prompt trained twice;
- (e) colocated, tp within each node and pp across the two: four ranks generate
  themselves, the weights move in place across nodes at the lower bound, on-policy;
- (f) Slurm's time-limit USR1 checkpoints both nodes' ranks, requeues and resumes; then
  ``scancel`` ends every step on both nodes;
- (g) without Slurm's launcher: one torchrun agent per node, c10d rendezvous.

Skipped, with cluster_up.sh's reason, where namespaces or Slurm are unavailable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
from run_records import HashWatch, assert_each_prompt_trained_once, hf_hashes, trained_steps

pytestmark = [pytest.mark.e2e, pytest.mark.multiproc, pytest.mark.timeout(420)]  # each test; the module: ~6 min

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
    """Submitted as a user submits a sweep: ``realscale sweep --submit`` renders the job
    (the plan and the overrides in its script) and sbatches it from the repository."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    overrides = ["launch.nodes=2", "launch.ntasks=4", "generate.host=0.0.0.0", f"run.output_dir={tmp_path}", *RUN,
                 "run.total_steps=3", "run.checkpoint_every=100", f"parallel.plan={plan}"]
    (tmp_path / "sweep.yaml").write_text("name: mn\njobs:\n  mn_plan:\n    recipe: configs/ppo_tiny_slurm.yaml\n"
                                         f"    overrides: [{', '.join(overrides)}]\n")
    res = subprocess.run([sys.executable, "-m", "realscale", "sweep", str(tmp_path / "sweep.yaml"), "--out",
                          str(tmp_path / "slurm"), "--submit"], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**_env(), "SBATCH_OUTPUT": f"{tmp_path}/slurm-%j.out"})  # (over the script's --output)
    found = re.search(r"^mn_plan: Submitted batch job (\d+)$", res.stdout, re.M)
    assert res.returncode == 0 and found, res.stdout + res.stderr
    job = found.group(1)
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


def _run_watching_server(script: str, out: Path, steps: int, *overrides: str) -> tuple[Path, dict]:
    """A finished run of ``steps`` steps, and what its server 0 held at each weight version
    it was seen at (:class:`HashWatch`)."""
    job = _submit(script, out, f"run.total_steps={steps}", "run.checkpoint_every=100", *overrides)
    watch = HashWatch(lambda: _first_server(out / "ppo_tiny"))
    try:
        run = _finished(out, job, steps)
    finally:
        seen = watch.close()
    return run, seen


def _assert_every_byte_moved_on_policy(run: Path) -> None:
    """Every step, the weight world (trainer ranks on both nodes -> the server) and the
    batch scatter (rank 0 -> the ranks of the other node) moved every byte they must, once,
    and the server's log-probs were the trainer's (the same weights)."""
    for m in _metrics(run):
        assert m["perf/weight_sync_bytes"] == m["perf/weight_sync_bytes_lower_bound"] > 0, m
        assert m["perf/batch_bytes"] == m["perf/batch_bytes_lower_bound"] > 0, m
        assert abs(m["train/behav_kl"]) < 1e-4, m


def test_data_parallel_ranks_across_nodes(script: str, tmp_path: Path) -> None:
    steps = 4
    run, seen = _run_watching_server(script, tmp_path, steps)
    logs = run / "logs"
    for i, node in enumerate(("rs-node1", "rs-node2")):  # one rank per node: dp across nodes
        line = _first_line(logs / f"rank{i}.log", f"realscale rank {i}/2")
        assert f"(local 0/1) on {node} (advertised {NET}.{11 + i}, gloo interface rs0)" in line, line
        assert f"master {NET}.11:" in line, line
    _assert_every_byte_moved_on_policy(run)
    # the server's weights at the last version are the trainer's final weights
    assert str(steps) in seen, f"the server was not seen at version {steps} (seen: {sorted(seen)})"
    want = hf_hashes(run / "final")
    assert seen[str(steps)] == want, sorted(n for n in want if seen[str(steps)].get(n) != want[n])


def test_tp_within_and_pp_across_nodes_into_a_server(script: str, tmp_path: Path) -> None:
    """Disaggregated, four trainer ranks: tp=2 within each node and pp=2 across the two
    (stage 0 on rs-node1, stage 1 on rs-node2), and a generation server: every update the
    weight world moves each rank's own shards, from both nodes, into the server at the
    lower bound; the batch scatter crosses nodes; after every update the server was seen
    at, its weights are the trainer's snapshot of that step, bit for bit."""
    steps = 3
    run, seen = _run_watching_server(script, tmp_path, steps, "run.export_every=1", "parallel.dp=1", "parallel.tp=2",
                                     "parallel.pp=2")
    logs = run / "logs"
    for i in range(4):  # ranks 0, 1 (tp pair, stage 0) on rs-node1; 2, 3 (stage 1) on rs-node2
        node, local = ("rs-node1", "rs-node2")[i // 2], i % 2
        line = _first_line(logs / f"rank{i}.log", f"realscale rank {i}/4")
        assert f"(local {local}/2) on {node} (advertised {NET}.{11 + i // 2}, gloo interface rs0)" in line, line
    _assert_every_byte_moved_on_policy(run)
    versions = sorted(int(v) for v in seen if int(v) > 0)
    print(f"server weights checked against the trainer's at versions {versions}")
    assert steps in versions, f"the server was not seen at version {steps} (seen: {sorted(seen)})"
    for v in versions:
        want = hf_hashes(run / "final" if v == steps else run / "exports" / f"step_{v:06d}")
        assert seen[str(v)] == want, (v, sorted(n for n in want if seen[str(v)].get(n) != want[n]))


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


# ----------------------------------------------------------------------------- (e)


def test_colocated_tp_within_and_pp_across_nodes(script: str, tmp_path: Path) -> None:
    """Four trainer ranks, tp=2 within each node and pp=2 across the two, generate
    themselves (no server steps): each node's tp pair is one generation replica (tp=2),
    its in-process server bound to the job's generate.host and advertised by its node's
    address, so rank 0's rollouts reach the other node's; the weights move in place from
    the (t2, p2) training layout to the (d2, t2) generation layout across nodes, at the
    lower bound, and generation is on-policy after every update."""
    steps = 2
    job = _submit(script, tmp_path, f"run.total_steps={steps}", "run.checkpoint_every=100", "parallel.mode=colocated",
                  "parallel.dp=1", "parallel.tp=2", "parallel.pp=2", "generate.num_servers=2", "generate.tp=2",
                  "rollout.max_staleness=0")
    run = _finished(tmp_path, job, steps)
    logs = run / "logs"
    assert not (logs / "server0.log").exists()  # no server steps: the ranks generate
    for i in range(4):  # ranks 0, 1 (tp pair, stage 0) on rs-node1; 2, 3 (stage 1) on rs-node2
        node, local = ("rs-node1", "rs-node2")[i // 2], i % 2
        line = _first_line(logs / f"rank{i}.log", f"realscale rank {i}/4")
        assert f"(local {local}/2) on {node} (advertised {NET}.{11 + i // 2}, gloo interface rs0)" in line, line
    for m in _metrics(run):
        assert abs(m["train/behav_kl"]) < 1e-5 and m["staleness/max"] == 0, m  # generated with the trained weights
        assert m["perf/weight_sync_bytes"] == m["perf/weight_sync_bytes_lower_bound"], m
        # rank 0's rollouts use the replicas on both nodes (neither was retired as unreachable)
        assert m["rollout/servers_alive"] == 2 and m["rollout_ctl/servers_in_rotation"] == 2, m


# ----------------------------------------------------------------------------- (f)


def test_usr1_requeues_and_scancel_ends_both_nodes(script: str, tmp_path: Path) -> None:
    """Slurm's time-limit notice (``--signal=B:USR1``) reaches the launcher on the first
    node: the ranks on both nodes checkpoint at a step boundary and exit, the job is
    requeued and resumes from that step; then ``scancel`` of the running job ends every
    step on both nodes: nothing of the run is left in either."""
    total = 30
    run = tmp_path / "ppo_tiny"
    job = _submit(script, tmp_path, f"run.total_steps={total}", "run.checkpoint_every=100")
    _wait_for_steps(run, job, 2)
    assert _sh("scancel", "--signal=USR1", "--batch", job).returncode == 0
    deadline = time.monotonic() + 180
    while not re.search(r"restart 1 on", _output(tmp_path, job)):  # stopped, requeued, running again
        assert _job(job).get("JobState") not in ENDED, (_job(job), _output(tmp_path, job)[-3000:])
        assert time.monotonic() < deadline, _output(tmp_path, job)[-3000:]
        time.sleep(0.3)
    stopped = re.search(r"stopped on request \(requeue\); last checkpoint \S+step(\d+)", _output(tmp_path, job))
    assert stopped, _output(tmp_path, job)[-3000:]
    at = int(stopped[1])
    assert 2 <= at < total
    _wait_for_steps(run, job, at + 1)  # resumed from the checkpoint on both nodes
    steps = trained_steps(run)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > at  # every step once so far
    assert _sh("scancel", job).returncode == 0
    info = _ended(job, timeout=120)
    assert info["JobState"] == "CANCELLED", info
    _gone(str(run), timeout=60)  # every role on either node, ended


def _wait_for_steps(run: Path, job: str, n: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while len(trained_steps(run)) < n:
        assert _job(job).get("JobState") not in ENDED, _job(job)
        assert time.monotonic() < deadline, f"fewer than {n} steps after {timeout:.0f} s"
        time.sleep(0.3)


# ----------------------------------------------------------------------------- (g)


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH (it ships with torch)")
def test_torchrun_rendezvous_across_nodes(cluster: None, tmp_path: Path, tiny_run_args) -> None:
    """Without Slurm's launcher: one torchrun agent per node, c10d rendezvous at rs-node1
    (as a user starts a multi-node job by hand), the trainer ranks from the run spec,
    against an embedded server on rs-node1. torchrun's MASTER_ADDR is the rank-0 agent's
    fully qualified host name (torch 2.13, torch/distributed/elastic/rendezvous/api.py:90,
    ``RendezvousStoreInfo.build``), which every node resolves; the ranks bind gloo to the interface that reaches it and train dp=2 across
    the nodes."""
    from dataclasses import asdict

    from realscale.config import load_config
    from realscale.launcher.local import ServerProc, wait_healthy
    from realscale.launcher.spec import RunSpec, spec_path
    from realscale.models.tiny import resolve_model_path

    out = tmp_path / "run"
    cfg = load_config(None, [*tiny_run_args(2, 1, "parallel.dp=2"), f"run.output_dir={tmp_path}", "run.name=run"])
    model = resolve_model_path(cfg.model.path)
    url = f"http://{NET}.11:31000"
    (out / "logs").mkdir(parents=True)
    log = out / "logs" / "server0.log"
    server = subprocess.Popen(["bash", ".ci/cluster_node.sh", "exec", "rs-node1", sys.executable, "-m", "realscale",
                               "serve", "--model", model, "--host", "0.0.0.0", "--port", "31000"], env=_env(),
                              cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    agents = []
    try:
        wait_healthy(ServerProc(url, server, str(log)), timeout=120, what="the server inside rs-node1")
        spec = RunSpec(asdict(cfg), model, str(out), [url]).save(spec_path(str(out)))
        env = {**_env(), "OMP_NUM_THREADS": "1"}
        for i, node in enumerate(("rs-node1", "rs-node2")):
            cmd = ["bash", ".ci/cluster_node.sh", "exec", node, "torchrun", "--nnodes=2", "--nproc-per-node=1",
                   "--rdzv-backend=c10d", "--rdzv-endpoint=rs-node1:29400", f"--rdzv-id=rs{os.getpid()}",
                   "-m", "realscale", "rank", "--spec", spec]
            agents.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           text=True, start_new_session=True))
        outputs = [a.communicate(timeout=300)[0] for a in agents]
    finally:
        for proc in (*agents, server):  # each with everything it started
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    for a, text in zip(agents, outputs):
        assert a.returncode == 0, text[-3000:]
    lines = [line for text in outputs for line in text.splitlines() if "realscale rank " in line]
    for i, node in enumerate(("rs-node1", "rs-node2")):  # torchrun may give either node rank 0
        line = next((x for x in lines if f"(local 0/1) on {node} " in x), "")
        assert f"on {node} (advertised {NET}.{11 + i}, gloo interface rs0)" in line, lines
    assert trained_steps(out) == [1, 2]
    record = json.loads((out / "final" / "export.json").read_text())
    assert record == {"step": 2, "world_size": 2, "backend": "gloo", "layout": {"tp": 1, "pp": 1, "dp": 2}}
    for m in _metrics(out):  # rank 0 -> rank 1 on the other node: every byte of the batch, once
        assert m["perf/batch_bytes"] == m["perf/batch_bytes_lower_bound"] > 0, m


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

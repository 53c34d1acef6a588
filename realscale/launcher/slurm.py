"""The Slurm backend: the roles of a run as job steps of the allocation it runs in.

``sbatch launch/slurm/ppo_7b.sh`` runs ``realscale train <recipe>`` as the batch step; the
supervisor (``realscale.launcher.supervisor.train``) sees the allocation and starts, through this
module:

1. a shared-storage check (multi-node: one task per node must read a nonce the batch
   host just wrote under the run directory, else a one-line error naming the nodes);
2. the generation servers: ONE step, one task per server (``realscale rank --server``),
   on the generation nodes of the plan's ``actor_gen`` mesh; each task binds a free port
   on its own node and writes its URL under ``<run>/launch/servers/``; the supervisor
   waits for every URL and its /health;
3. the trainer ranks: ONE step, one task per rank (one GPU each), ``realscale rank``,
   which derives RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR from Slurm's variables
   (rank 0 publishes a free port) and runs ``rank_main``; rank 0 also runs the rollout
   controller.

A colocated run (``parallel.mode: colocated``) has no step 2: its trainer ranks generate
too, so the whole run is the one trainer step, on the plan's ``actor_train`` nodes
(the ``actor_gen`` mesh is the same devices).

Both steps run with ``--kill-on-bad-exit``: one task failing ends its step, and the
supervisor then ends the other step and exits non-zero (the job fails, nothing hangs).
On CPU jobs the steps share the allocation's CPUs (``--overlap``); on GPU jobs they get
disjoint GPUs (``--exact``).

GPU paths (SGLang servers, NCCL over InfiniBand) are written but not run here: CI has a
real one-node CPU Slurm cluster (``.ci/slurm_up.sh``) and a two-node one whose nodes are
network namespaces (``.ci/cluster_up.sh 2``, tests/launch/test_multinode.py).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from realscale.errors import LaunchError
from realscale.inference.health import answers_health
from realscale.launcher.dist_env import slurm_hostnames
from realscale.launcher.restart import ServerKeeper
from realscale.launcher.spec import RunSpec, entry_name, launch_dir, spec_path
from realscale.planner.plan import Plan

if TYPE_CHECKING:
    from realscale.config import Config


def in_allocation(env: Mapping[str, str] = os.environ) -> bool:
    """True in a batch script or an salloc shell (a job, but not inside one of its steps)."""
    return "SLURM_JOB_ID" in env and "SLURM_STEP_ID" not in env


def job_nodes(env: Mapping[str, str] = os.environ) -> list[str]:
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise LaunchError("not in a Slurm allocation: SLURM_JOB_NODELIST is not set (submit with sbatch, "
                          "or use launch.backend=local)")
    return slurm_hostnames(nodelist)


# ----------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class Placement:
    """Which nodes run what. ``gpus_per_server`` / ``gpus_per_rank`` are 0 on CPU jobs."""

    server_nodes: list[str]
    servers: int
    gpus_per_server: int
    train_nodes: list[str]
    ranks: int
    gpus_per_rank: int

    @property
    def overlap(self) -> bool:
        """CPU steps share the allocation's CPUs; GPU steps must not share GPUs."""
        return self.gpus_per_rank == 0


def _too_few_nodes(need: int, nodes: list[str]) -> LaunchError:
    shown = ",".join(nodes[:4]) + (",..." if len(nodes) > 4 else "")
    return LaunchError(f"the plan needs {need} nodes, the job has {len(nodes)} ({shown}); submit with more "
                       "--nodes or re-plan with launch.nodes")


def _mesh_nodes(start: int, size: int, gpus_per_node: int, nodes: list[str]) -> list[str]:
    first, last = start // gpus_per_node, (start + size - 1) // gpus_per_node
    if last >= len(nodes):
        raise _too_few_nodes(last + 1, nodes)
    return nodes[first:last + 1]


def allocation_slots(cfg: Config, nodes: list[str], env: Mapping[str, str] = os.environ) -> tuple[int, str, bool]:
    """(slots, unit, gpus) of the job: nodes x GPUs per node, or on CPU jobs the CPUs
    Slurm gave the job on each node (``SLURM_CPUS_ON_NODE``) times its nodes."""
    if cfg.launch.gpus_per_node:
        return len(nodes) * cfg.launch.gpus_per_node, f"GPUs in the job ({len(nodes)} nodes)", True
    per_node = int(env.get("SLURM_CPUS_ON_NODE") or os.cpu_count() or 1)
    return len(nodes) * per_node, f"CPUs in the job ({len(nodes)} nodes)", False


def placement(cfg: Config, nodes: list[str], env: Mapping[str, str] = os.environ,
              ranks_only: bool = False) -> Placement:
    """Place servers and ranks on the job's nodes: from the plan on GPU jobs, everywhere
    (servers first) on CPU jobs, or from the plan on CPU jobs across nodes (its meshes
    over the job's CPUs, node by node). A plan must fit the allocation (the rule of
    :mod:`realscale.planner.validate`, the same as the local backend's). ``ranks_only``:
    a job of ranks and no servers (an SFT stage): on the plan's ``actor_train`` nodes, or
    without a plan on as many of the job's nodes as its ranks fill, one GPU each."""
    world = cfg.parallel.world_size
    # colocated: the ranks generate
    servers = 0 if cfg.parallel.mode == "colocated" or ranks_only else cfg.generate.num_servers
    if ranks_only and cfg.launch.gpus_per_node and not cfg.parallel.plan:
        need = -(-world // cfg.launch.gpus_per_node)
        if need > len(nodes):
            raise _too_few_nodes(need, nodes)
        return Placement([], 0, 0, nodes[:need], world, 1)
    if cfg.launch.gpus_per_node == 0:
        _check_fits(cfg, nodes, env)
        if cfg.parallel.plan and len(nodes) > 1 and cfg.parallel.mode != "colocated":
            return _cpu_plan_placement(cfg, nodes, env, servers, world)
        return Placement(nodes if servers else [], servers, 0, nodes, world, 0)
    if not cfg.parallel.plan:
        raise LaunchError("a GPU job (launch.gpus_per_node > 0) needs parallel.plan: render one with "
                          "`realscale sweep` or `realscale plan --out`")

    plan = Plan.load(cfg.parallel.plan)
    gpn = cfg.launch.gpus_per_node
    if plan.cluster is not None:
        if plan.cluster.gpus_per_node != gpn:
            raise LaunchError(f"{cfg.parallel.plan}: planned for {plan.cluster.gpus_per_node} GPUs per node, "
                              f"launch.gpus_per_node is {gpn}")
        if plan.cluster.nodes > len(nodes):
            raise _too_few_nodes(plan.cluster.nodes, nodes)
    gen, train = plan.roles["actor_gen"], plan.roles["actor_train"]
    if train.strategy.world != world:
        raise LaunchError(f"{cfg.parallel.plan}: actor_train has {train.strategy.world} GPUs but parallel "
                          f"dp*tp*pp = {world}")
    train_nodes = _mesh_nodes(train.mesh.start, train.mesh.size, gpn, nodes)
    if servers:
        place = Placement(_mesh_nodes(gen.mesh.start, gen.mesh.size, gpn, nodes), gen.strategy.dp, gen.strategy.tp,
                          train_nodes, world, 1)
    else:
        place = Placement([], 0, 0, train_nodes, world, 1)
    _check_fits(cfg, nodes, env)
    return place


def _cpu_plan_placement(cfg: Config, nodes: list[str], env: Mapping[str, str], servers: int,
                        world: int) -> Placement:
    """A CPU job across nodes with a plan: the plan's meshes number the job's CPUs node by
    node (``SLURM_CPUS_ON_NODE`` each, as GPU meshes number GPUs), so ``actor_gen`` on
    CPUs 0:2 and ``actor_train`` on 2:4 of two 2-CPU nodes put the servers on the first
    node and the trainer ranks on the second. A plan larger than the job's CPUs
    (``launch.oversubscribe``) runs everywhere, as without a plan."""
    per_node = int(env.get("SLURM_CPUS_ON_NODE") or os.cpu_count() or 1)
    plan = Plan.load(cfg.parallel.plan)
    gen, train = plan.roles["actor_gen"], plan.roles["actor_train"]
    if max(gen.mesh.end, train.mesh.end) > per_node * len(nodes):
        return Placement(nodes if servers else [], servers, 0, nodes, world, 0)
    return Placement(_mesh_nodes(gen.mesh.start, gen.mesh.size, per_node, nodes) if servers else [], servers, 0,
                     _mesh_nodes(train.mesh.start, train.mesh.size, per_node, nodes), world, 0)


def _check_fits(cfg: Config, nodes: list[str], env: Mapping[str, str]) -> None:
    """A plan's ranks must fit the allocation (the rule of realscale.planner.validate)."""
    if not cfg.parallel.plan:
        return
    from realscale.config import ConfigError
    from realscale.planner.validate import check_capacity

    slots, unit, gpus = allocation_slots(cfg, nodes, env)
    try:
        check_capacity(cfg, slots, unit, "parallel.plan", gpus)
    except ConfigError as exc:
        raise LaunchError(str(exc)) from None


# ----------------------------------------------------------------------------- srun


def srun_command(role: str, nodes: list[str], ntasks: int, log_pattern: str, argv: list[str], *,
                 gpus_per_task: int = 0, overlap: bool = True, cpus_per_task: int = 0,
                 tasks_per_node: int = 0) -> list[str]:
    """One job step: ``ntasks`` tasks of ``argv`` on ``nodes``, each task logging to
    ``log_pattern`` (``%t`` = task id), ended as a whole when any task fails."""
    cmd = ["srun", f"--job-name={role}", f"--nodes={len(nodes)}", f"--ntasks={ntasks}",
           f"--nodelist={','.join(nodes)}", "--kill-on-bad-exit=1", f"--output={log_pattern}",
           "--open-mode=append",  # a requeued job appends to the logs of its first run
           "--overlap" if overlap else "--exact"]
    if tasks_per_node:
        cmd.append(f"--ntasks-per-node={tasks_per_node}")
    if gpus_per_task:
        cmd.append(f"--gpus-per-task={gpus_per_task}")
    if cpus_per_task:
        cmd.append(f"--cpus-per-task={cpus_per_task}")
    return cmd + argv


def server_cpus(cfg: Config) -> int:
    """CPUs of one server task: a trainer task's (``launch.cpus_per_task``, one GPU's
    share) per server rank, so a TP-8 SGLang server gets eight ranks' worth — its
    scheduler processes, tokenizer and detokenizer — not Slurm's default of one CPU per
    task (since Slurm 22.05 srun does not inherit the batch step's --cpus-per-task).
    0 (Slurm's default) when ``launch.cpus_per_task`` is."""
    return cfg.launch.cpus_per_task * cfg.generate.tp


def _abs_if_dir(path: str) -> str:
    """Steps on other nodes may start elsewhere than the batch step's directory."""
    return os.path.abspath(path) if os.path.isdir(path) else path


def _rank_argv(spec: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "realscale", "rank", "--spec", spec, *extra]


@dataclass
class Step:
    name: str
    proc: subprocess.Popen
    log: str

    def poll(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        """SIGTERM srun (it forwards the signal to every task)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def end(self, grace: float) -> None:
        """SIGTERM srun, then SIGKILL it after ``grace`` seconds."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_step(name: str, cmd: list[str], log: str, env: Mapping[str, str]) -> Step:
    """srun in its own session (Ctrl-C of the supervisor is handled by the supervisor)."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True)
    return Step(name, proc, log)


# ----------------------------------------------------------------------------- storage


def check_shared_storage(out_dir: str, nodes: list[str], env: Mapping[str, str], timeout: float = 120.0) -> None:
    """Every node must see the run directory as the batch host does: checkpoints, the run
    spec, server URLs and the rank rendezvous all live there."""
    if len(nodes) <= 1:
        return
    nonce = secrets.token_hex(8)
    probe = os.path.join(launch_dir(out_dir), f"shared-check-{env.get('SLURM_JOB_ID', 'x')}")
    with open(probe, "w", encoding="utf-8") as fh:
        fh.write(nonce)
    cmd = ["srun", "--job-name=shared-check", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}",
           "--ntasks-per-node=1", "--overlap", sys.executable, "-m", "realscale.launcher.roles", "shared-check",
           probe, nonce]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(env))
    except subprocess.TimeoutExpired:
        raise LaunchError(f"shared-storage check of {out_dir} did not finish in {timeout:.0f} s") from None
    finally:
        os.remove(probe)
    blind = [line.split()[1] for line in res.stdout.splitlines() if line.startswith("MISSING ")]
    if blind or res.returncode != 0:
        who = ", ".join(blind) or f"(srun failed: {res.stderr.strip()[-300:]})"
        raise LaunchError(f"run.output_dir: {os.path.abspath(out_dir)} is not on storage all nodes share: "
                          f"nodes {who} cannot see it; use a shared file system (NFS, Lustre, GPFS)")


# ----------------------------------------------------------------------------- backend


def _wait_url(url_dir: str, i: int, step: Step, timeout: float) -> str:
    """Server ``i``'s URL once it answers /health; LaunchError when its step exits first
    or the time runs out."""
    deadline = time.monotonic() + timeout
    path = os.path.join(url_dir, f"{i}.url")
    while True:
        if step.poll() is not None:
            raise LaunchError(f"generation server {i}'s step exited with code {step.poll()} before it was up; "
                              f"see {step.log} and logs/server{i}.log next to it")
        if time.monotonic() > deadline:
            raise LaunchError(f"generation server {i} not healthy after {timeout:.0f} s; see {step.log}")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                url = fh.read().strip()
            if answers_health(url):
                return url
        time.sleep(0.25)


def server_node(i: int, nodes: list[str], servers: int, per_node: int) -> str:
    """The node of server ``i``: ``per_node`` servers a node in order (GPU jobs), else the
    servers spread evenly over ``nodes`` (one a node when there are no more than nodes)."""
    if per_node:
        return nodes[min(i // per_node, len(nodes) - 1)]
    return nodes[i * len(nodes) // servers]


class SlurmBackend:
    """Servers and ranks as job steps of the current allocation."""

    def __init__(self, cfg: Config, out_dir: str, env: Mapping[str, str] | None = None,
                 ranks_only: bool = False) -> None:
        """``ranks_only``: a job step of ranks and no servers (an SFT stage, :func:`placement`)."""
        self.cfg, self.out_dir = cfg, os.path.abspath(out_dir)
        self.env = dict(os.environ if env is None else env)
        self.env.update(cfg.launch.nccl)
        self.env.update(cfg.launch.env)
        # srun inherits the batch step's CPU binding and task count; the steps say their own
        for key in ("SLURM_CPU_BIND", "SLURM_NTASKS_PER_NODE"):
            self.env.pop(key, None)
        if shutil.which("srun") is None:
            raise LaunchError("launch.backend=slurm but srun is not on PATH")
        self.nodes = job_nodes(self.env)
        self.place = placement(cfg, self.nodes, self.env, ranks_only)
        if self.place.servers and len(self.nodes) > 1 and cfg.generate.host in ("127.0.0.1", "localhost"):
            raise LaunchError(f"generate.host={cfg.generate.host} is reachable only on its own node; a "
                              f"{len(self.nodes)}-node job needs generate.host=0.0.0.0")
        self.logs = os.path.join(self.out_dir, "logs")
        self.key = f"{self.env.get('SLURM_JOB_ID', 'job')}.{self.env.get('SLURM_RESTART_COUNT', '0')}"
        self.servers: list[Step] = []  # one job step a server: one that dies alone is started again
        self.ranks: Step | None = None
        self.keeper: ServerKeeper | None = None
        self._server_cmd: list[str] = []
        self._url_dir = ""

    def prepare(self) -> None:
        os.makedirs(self.logs, exist_ok=True)
        os.makedirs(launch_dir(self.out_dir), exist_ok=True)
        self._link_batch_log()
        if self.cfg.launch.check_shared_storage:
            check_shared_storage(self.out_dir, self.nodes, self.env)

    def _link_batch_log(self) -> None:
        """The supervisor's own output (sbatch --output, wherever it is) appears in the
        run's logs/ too, as batch-<job id>.out, so that every role's log is in one place."""
        job = self.env.get("SLURM_JOB_ID")
        if not job or not shutil.which("scontrol"):  # a convenience: no link where Slurm's tools are absent
            return
        res = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=60)
        stdout = [f.split("=", 1)[1] for f in res.stdout.split() if f.startswith("StdOut=")]
        link = os.path.join(self.logs, f"batch-{job}.out")
        if stdout and os.path.isfile(stdout[0]) and not os.path.lexists(link):
            os.symlink(os.path.abspath(stdout[0]), link)

    def start_servers(self, model_dir: str, cfg_dict: dict[str, Any], wait: bool = True) -> list[str]:
        """The server steps; returns once each has written its URL (host and port are the
        node's, known only then), so ``wait`` changes nothing here: the trainer step starts
        after the servers answer (the local backend overlaps the two)."""
        url_dir = self._url_dir = os.path.join(launch_dir(self.out_dir), "servers", self.key)
        shutil.rmtree(url_dir, ignore_errors=True)
        os.makedirs(url_dir)
        spec = RunSpec(cfg_dict, _abs_if_dir(model_dir), self.out_dir, [], url_dir).save(
            spec_path(self.out_dir, "servers"))
        self._server_cmd = _rank_argv(spec, "--server")
        self.servers = [self._server_step(i) for i in range(self.place.servers)]
        urls = [_wait_url(url_dir, i, step, self.cfg.launch.health_timeout) for i, step in enumerate(self.servers)]
        self.keeper = ServerKeeper(self.out_dir, urls, self.cfg.launch.server_restarts, self)
        return urls

    def servers_ready(self) -> None:
        """Nothing left to wait for: :meth:`start_servers` waited for every URL."""

    def _server_step(self, i: int) -> Step:
        """Server ``i`` as a job step of its own (``rs-server<i>``) on its node."""
        p = self.place
        per_node = self.cfg.launch.gpus_per_node // p.gpus_per_server if p.gpus_per_server else 0
        node = server_node(i, p.server_nodes[:p.servers], p.servers, per_node)
        cmd = srun_command(f"rs-server{i}", [node], 1, os.path.join(self.logs, f"server{i}.log"),
                           [*self._server_cmd, "--index", str(i)], gpus_per_task=p.gpus_per_server,
                           overlap=p.overlap, cpus_per_task=server_cpus(self.cfg))
        return start_step(f"server{i}", cmd, os.path.join(self.logs, f"srun-server{i}.log"), self.env)

    # ServerHooks (realscale/launcher/restart.py)
    def server_exit_code(self, i: int) -> int | None:
        return self.servers[i].poll()

    def respawn_server(self, i: int) -> None:
        """A new step on the same node; the server picks a port other than its
        predecessor's (roles.generation_server), whose URL file it replaces."""
        self.servers[i].end(grace=5.0)
        self.servers[i] = self._server_step(i)

    def server_ready(self, i: int) -> str:
        old = os.path.join(self._url_dir, f"{i}.url")
        with open(old, encoding="utf-8") as fh:
            dead = fh.read().strip()
        deadline = time.monotonic() + self.cfg.launch.health_timeout
        while True:  # the new server writes its own URL over the dead one's
            url = _wait_url(self._url_dir, i, self.servers[i], max(1.0, deadline - time.monotonic()))
            if url != dead:
                return url
            time.sleep(0.25)

    def start_ranks(self, fn: Callable[..., Any], world: int, args: tuple, name: str = "trainer") -> None:
        """One step ``rs-<name>`` of ``world`` tasks, each ``realscale rank``, which calls
        ``fn`` (``rank_main``, or ``sft_rank`` for ``name="sft"``; named in the spec) with
        ``args`` (config, model dir, server URLs, out dir), handed over in the run spec.
        The trainer's tasks log to ``logs/rank<i>.log``, another job's to ``logs/<name>-rank<i>.log``."""
        cfg_dict, model_dir, urls, out_dir = args
        spec = RunSpec(cfg_dict, _abs_if_dir(model_dir), self.out_dir, list(urls), entry=entry_name(fn)).save(
            spec_path(self.out_dir, "" if name == "trainer" else name))
        p = self.place
        log = "rank%t.log" if name == "trainer" else f"{name}-rank%t.log"
        cmd = srun_command(f"rs-{name}", p.train_nodes[:world], world, os.path.join(self.logs, log),
                           _rank_argv(spec), gpus_per_task=p.gpus_per_rank, overlap=p.overlap,
                           cpus_per_task=self.cfg.launch.cpus_per_task,
                           tasks_per_node=self.cfg.launch.gpus_per_node if p.gpus_per_rank else 0)
        self.ranks = start_step(name, cmd, os.path.join(self.logs, f"srun-{name}.log"), self.env)

    def wait(self, poll: float = 0.5) -> int:
        """Until the trainer step ends: its exit code. A server step that dies is started
        again (:class:`~realscale.launcher.restart.ServerKeeper`); the run goes on."""
        assert self.ranks is not None
        while True:
            code = self.ranks.poll()
            if code is not None:
                return code
            if self.keeper is not None:
                self.keeper.check()
            time.sleep(poll)

    def stop(self, grace: float = 15.0) -> None:
        steps = [s for s in [self.ranks, *self.servers] if s is not None]
        for step in steps:  # every step told at once: a cluster's servers are not ended one by one
            step.terminate()
        deadline = time.monotonic() + grace
        for step in steps:
            step.end(max(0.1, deadline - time.monotonic()))

    def requeue(self) -> None:
        """Put this job back in the queue; it starts again from the batch script and the
        run resumes from its last checkpoint."""
        job = self.env.get("SLURM_JOB_ID")
        res = subprocess.run(["scontrol", "requeue", str(job)], capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            raise LaunchError(f"scontrol requeue {job} failed: {res.stderr.strip()} (is the job --requeue-able? "
                              "JobRequeue / --requeue)")

"""Who am I in the job? The torch.distributed environment of one trainer rank, derived
from whatever started it: ``srun`` (Slurm), ``torchrun``, ``mpirun`` (Open MPI, or MPICH /
Intel MPI through PMI), or nothing (one process).

:func:`derive` is a pure function of the environment (tested with each launcher's
variables). Slurm and MPI say who the ranks are but not which port rank 0 listens on, so
:func:`rendezvous` completes the address: rank 0 picks a free port on its own node and
publishes ``host:port`` (a file on the run directory's shared storage, or an MPI
broadcast when mpi4py is installed); the other ranks wait for it.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Mapping

from realscale.parallel.net import free_port


class DistEnvError(RuntimeError):
    """The environment does not say who this rank is, or says it inconsistently."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None  # None: not known yet (see rendezvous)
    master_port: int | None
    source: str              # torchrun | slurm | openmpi | pmi | single

    def exported(self) -> dict[str, str]:
        """The variables ``torch.distributed.init_process_group("env://")`` reads."""
        if self.master_addr is None or self.master_port is None:
            raise DistEnvError(f"rank {self.rank}: master address not known yet; call rendezvous() first")
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


# ----------------------------------------------------------------------------- hostlists


_BRACKET = re.compile(r"^(?P<prefix>[^\[\]]*)\[(?P<body>[^\[\]]+)\](?P<rest>.*)$")


def _split_top(text: str) -> list[str]:
    """Split a hostlist on commas that are not inside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise DistEnvError(f"malformed Slurm hostlist {text!r}: unbalanced brackets")
    return parts + [cur] if cur else parts


def expand_hostlist(text: str) -> list[str]:
    """``"gpu[01-03,7],login1"`` -> ``["gpu01", "gpu02", "gpu03", "gpu7", "login1"]``.

    Slurm's own expansion is ``scontrol show hostnames``; this pure version is used when
    scontrol is not on PATH (a rank started by a foreign launcher) and in unit tests.
    Zero-padding of a range is kept (``[08-10]`` -> 08, 09, 10).
    """
    hosts: list[str] = []
    for item in _split_top(text.strip()):
        m = _BRACKET.match(item)
        if not m:
            hosts.append(item)
            continue
        for rng in m["body"].split(","):
            lo, sep, hi = rng.partition("-")
            if not lo.isdigit() or (sep and not hi.isdigit()):
                raise DistEnvError(f"malformed Slurm hostlist {text!r}: range {rng!r} is not N or N-M")
            width = len(lo)
            for i in range(int(lo), int(hi if sep else lo) + 1):
                hosts.extend(f"{m['prefix']}{i:0{width}d}{tail}" for tail in expand_hostlist(m["rest"]) or [""])
    return hosts


def slurm_hostnames(nodelist: str) -> list[str]:
    """The hosts of a Slurm nodelist, as Slurm itself expands them."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=30)
        except OSError:  # found on PATH but not runnable: our parser knows Slurm's syntax
            return expand_hostlist(nodelist)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()
    return expand_hostlist(nodelist)


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Slurm's compact ``"4(x2),3"`` (4 tasks on each of 2 nodes, then 3) at ``node_id``."""
    nodes: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise DistEnvError(f"malformed SLURM_STEP_TASKS_PER_NODE {tasks_per_node!r}")
        nodes += [int(m[1])] * int(m[2] or 1)
    if node_id >= len(nodes):
        raise DistEnvError(f"SLURM_NODEID={node_id} but SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r} "
                           f"covers {len(nodes)} nodes")
    return nodes[node_id]


# ----------------------------------------------------------------------------- derivation


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise DistEnvError(f"{key}={env[key]!r} is not an integer") from None


def _port(env: Mapping[str, str]) -> int | None:
    return _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else None


def derive(env: Mapping[str, str]) -> DistEnv:
    """This rank's place in the job, from the launcher's variables (first match wins).

    torch's own variables come first: torchrun sets them, and a user who sets them by
    hand means them, even inside a Slurm job. Slurm counts only inside a job *step*
    (``SLURM_STEP_ID``): the batch script's environment also has SLURM_PROCID=0 and
    SLURM_NTASKS, which describe the allocation, not this process.
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        return DistEnv(_int(env, "RANK"), world, int(env.get("LOCAL_RANK", "0")),
                       int(env.get("LOCAL_WORLD_SIZE", str(world))), env.get("MASTER_ADDR") or None, _port(env),
                       "torchrun")
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        world = _int(env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS")
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise DistEnvError("a Slurm step without SLURM_STEP_NODELIST / SLURM_JOB_NODELIST")
        local_world = (_tasks_on_node(env["SLURM_STEP_TASKS_PER_NODE"], int(env.get("SLURM_NODEID", "0")))
                       if "SLURM_STEP_TASKS_PER_NODE" in env else world)
        # Slurm's default block distribution puts task 0 on the step's first node
        return DistEnv(_int(env, "SLURM_PROCID"), world, int(env.get("SLURM_LOCALID", "0")), local_world,
                       env.get("MASTER_ADDR") or slurm_hostnames(nodelist)[0], _port(env), "slurm")
    if "OMPI_COMM_WORLD_RANK" in env:
        world = _int(env, "OMPI_COMM_WORLD_SIZE")
        return DistEnv(_int(env, "OMPI_COMM_WORLD_RANK"), world, int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")),
                       int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", str(world))), env.get("MASTER_ADDR") or None,
                       _port(env), "openmpi")
    if "PMI_RANK" in env and "PMI_SIZE" in env:  # MPICH / Intel MPI (Hydra)
        world = _int(env, "PMI_SIZE")
        return DistEnv(_int(env, "PMI_RANK"), world, int(env.get("MPI_LOCALRANKID", "0")),
                       int(env.get("MPI_LOCALNRANKS", str(world))), env.get("MASTER_ADDR") or None, _port(env), "pmi")
    return DistEnv(0, 1, 0, 1, env.get("MASTER_ADDR") or "127.0.0.1", _port(env), "single")


def job_key(env: Mapping[str, str]) -> str:
    """A name for this launch of the ranks, the same on every rank and new on each launch
    (a requeued Slurm job keeps its id but not its restart count), so a rendezvous file
    of an earlier launch is never read."""
    if "SLURM_JOB_ID" in env and "SLURM_STEP_ID" in env:
        return f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_RESTART_COUNT', '0')}.{env['SLURM_STEP_ID']}"
    for key in ("TORCHELASTIC_RUN_ID", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_JOBID"):
        if env.get(key):
            return f"{key.lower()}-{env[key]}"
    return "default"


# ----------------------------------------------------------------------------- rendezvous


def rendezvous(denv: DistEnv, path: str, timeout: float = 300.0) -> DistEnv:
    """``denv`` with master address and port filled in.

    Rank 0 picks a free port on its node and publishes ``host:port``: over MPI when the
    ranks came from mpirun and mpi4py is importable, else in the file ``path`` (atomic
    rename; it must be on storage all ranks share). The others wait up to ``timeout``.
    """
    if denv.master_addr is not None and denv.master_port is not None:
        return denv
    if denv.world_size == 1:
        return DistEnv(**{**denv.__dict__, "master_addr": denv.master_addr or "127.0.0.1",
                          "master_port": denv.master_port or free_port("")})
    if denv.source in ("openmpi", "pmi"):
        try:
            from mpi4py import MPI  # optional: without it the file below is used
        except ImportError:
            MPI = None
        if MPI is not None:
            mine = None
            if denv.rank == 0:
                mine = (denv.master_addr or socket.gethostname(), denv.master_port or free_port(""))
            addr, port = MPI.COMM_WORLD.bcast(mine, root=0)
            return DistEnv(**{**denv.__dict__, "master_addr": addr, "master_port": port})
    if denv.rank == 0:
        addr = denv.master_addr or socket.gethostname()
        port = denv.master_port or free_port("")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(f"{addr}:{port}\n")
        os.replace(tmp, path)
        return DistEnv(**{**denv.__dict__, "master_addr": addr, "master_port": port})
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise DistEnvError(f"rank {denv.rank}: rank 0 did not publish its address in {path} within "
                               f"{timeout:.0f} s (is the run directory on storage every node shares?)")
        time.sleep(0.1)
    with open(path, encoding="utf-8") as fh:
        addr, _, port = fh.read().strip().rpartition(":")
    return DistEnv(**{**denv.__dict__, "master_addr": addr, "master_port": int(port)})

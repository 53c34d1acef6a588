"""The local backend: start and watch the processes of a run on this machine (generation
servers and trainer ranks). Everything started here is stopped here — on success, on
error, on Ctrl-C or SIGTERM — so a run leaves no orphan processes and frees its ports.

:class:`LocalBackend` and :class:`realscale.launcher.slurm.SlurmBackend` offer the same
calls to the supervisor (start_servers, start_ranks, servers_ready, wait, stop); only how
the processes are started differs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlsplit

from realscale.errors import LaunchError
from realscale.inference.health import answers_health
from realscale.inference.sglang_launcher import check_sglang_version, sglang_command, sglang_env
from realscale.inference.vllm_server import check_model, require_vllm, vllm_command, vllm_env
from realscale.launcher.restart import ServerKeeper
from realscale.parallel.device import cuda_usable, devices_of_server
from realscale.parallel.net import free_port
from realscale.parallel.spawn import die_with_parent

if TYPE_CHECKING:
    from realscale.config import Config, GenerateConfig


@dataclass
class ServerProc:
    url: str
    proc: subprocess.Popen
    log_path: str


def start_servers(model_dir: str, num: int, log_dir: str, *, host: str = "127.0.0.1", threads: int = 1,
                  max_running: int = 32, context_length: int = 2048, seed: int = 0, tp: int = 1,
                  timeout: float = 180.0, first_gpu: int | None = None) -> list[ServerProc]:
    """``num`` embedded generation servers (``realscale serve``) of ``tp`` ranks each (one
    torch thread per rank unless ``threads``), each on a free port, logging to
    ``log_dir/server<i>.log``; returns once every one answers /health. ``first_gpu``: on a
    GPU machine, server i's ranks use GPUs ``first_gpu + i*tp`` onwards
    (``CUDA_VISIBLE_DEVICES`` of its process); None: the CPU."""

    servers = spawn_servers(model_dir, num, log_dir, host=host, threads=threads, max_running=max_running,
                            context_length=context_length, seed=seed, tp=tp, first_gpu=first_gpu)
    wait_all_healthy(servers, timeout)
    return servers


def spawn_servers(model_dir: str, num: int, log_dir: str, *, host: str = "127.0.0.1", threads: int = 1,
                  max_running: int = 32, context_length: int = 2048, seed: int = 0, tp: int = 1,
                  first_gpu: int | None = None) -> list[ServerProc]:
    """The servers of :func:`start_servers`, started, not waited for."""
    os.makedirs(log_dir, exist_ok=True)
    return [spawn_embedded_server(model_dir, i, log_dir, host=host, threads=threads, max_running=max_running,
                                  context_length=context_length, seed=seed, tp=tp, first_gpu=first_gpu)
            for i in range(num)]


def wait_all_healthy(servers: list[ServerProc], timeout: float, what: str = "generation server") -> None:
    """Every one of ``servers`` answers /health within ``timeout`` seconds, or all are
    stopped and a one-line :class:`LaunchError` names the first that did not."""
    try:
        for s in servers:
            wait_healthy(s, timeout, what=what)
    except BaseException:
        stop_servers(servers)
        raise


def spawn_embedded_server(model_dir: str, i: int, log_dir: str, *, host: str = "127.0.0.1", threads: int = 1,
                          max_running: int = 32, context_length: int = 2048, seed: int = 0, tp: int = 1,
                          first_gpu: int | None = None, avoid_port: int = 0) -> ServerProc:
    """Embedded server ``i`` of :func:`start_servers`, not waiting for it (a restart
    passes the dead one's port as ``avoid_port``: a new URL is a new server to the trainer)."""
    port = free_port(host, avoid=avoid_port)
    cmd = [sys.executable, "-m", "realscale", "serve", "--model", model_dir, "--host", host, "--port", str(port),
           "--threads", str(threads), "--max-running", str(max_running), "--context-length",
           str(context_length), "--seed", str(seed + i)]
    if tp > 1:
        cmd += ["--tp", str(tp)]
    env = dict(os.environ)
    if first_gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices_of_server(first_gpu + i * tp, tp)
        cmd += ["--device", "cuda"]
    log = open(os.path.join(log_dir, f"server{i}.log"), "ab")  # noqa: SIM115 - lives with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=die_with_parent, env=env)
    return ServerProc(f"http://{host}:{port}", proc, log.name)


def start_engine_servers(model_dir: str, gen: GenerateConfig, log_dir: str, *, seed: int = 0,
                         dtype: str = "float32", timeout: float = 900.0,
                         first_gpu: int | None = None, routed_experts: bool = False) -> list[ServerProc]:
    """``gen.num_servers`` vLLM or SGLang servers (``gen.backend``), each on a free port
    with ``gen.tp`` ranks, logging to ``log_dir/server<i>.log``; returns once every one
    answers /health within ``timeout`` seconds, else a one-line :class:`LaunchError`
    naming the failed server's log. ``first_gpu``: on a GPU machine, server i's ranks use
    GPUs ``first_gpu + i*tp`` onwards; None: the CPU."""

    servers = spawn_engine_servers(model_dir, gen, log_dir, seed=seed, dtype=dtype, first_gpu=first_gpu,
                                   routed_experts=routed_experts)
    wait_all_healthy(servers, timeout, what=engine_name(gen))
    return servers


def engine_name(gen: GenerateConfig) -> str:
    return {"vllm": "vLLM server", "sglang": "SGLang server"}[gen.backend]


def spawn_engine_servers(model_dir: str, gen: GenerateConfig, log_dir: str, *, seed: int = 0,
                         dtype: str = "float32", first_gpu: int | None = None,
                         routed_experts: bool = False) -> list[ServerProc]:
    """The servers of :func:`start_engine_servers`, checked (one-line :class:`LaunchError`)
    and started, not waited for."""
    try:
        check_engine(model_dir, gen, on_gpu=first_gpu is not None, routed_experts=routed_experts)
    except (RuntimeError, ValueError) as exc:
        raise LaunchError(str(exc)) from None
    os.makedirs(log_dir, exist_ok=True)
    return [spawn_engine_server(model_dir, gen, os.path.join(log_dir, f"server{i}.log"), seed=seed + i, dtype=dtype,
                                routed_experts=routed_experts,
                                gpus=None if first_gpu is None else devices_of_server(first_gpu + i * gen.tp, gen.tp))
            for i in range(gen.num_servers)]


def spawn_engine_server(model_dir: str, gen: GenerateConfig, log_path: str, *, seed: int = 0,
                        dtype: str = "float32", gpus: str | None = None, avoid_port: int = 0,
                        routed_experts: bool = False) -> ServerProc:
    """Start one vLLM or SGLang server process (``gen.backend``; on the CPU, or on the
    GPUs ``gpus`` names), not waiting for it. Dies with this process — with the calling
    *thread*, in fact (PR_SET_PDEATHSIG): call it from a thread that outlives the server.
    ``avoid_port``: a restart's dead predecessor's (a new URL is a new server to the trainer)."""

    port = free_port(gen.host, avoid=avoid_port)
    cmd, env = engine_command(model_dir, port, gen, seed=seed, dtype=dtype, on_gpu=gpus is not None,
                              routed_experts=routed_experts)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    log = open(log_path, "ab")  # noqa: SIM115 - lives with the process
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=die_with_parent)
    return ServerProc(f"http://{gen.host}:{port}", proc, log_path)


def check_engine(model_dir: str, gen: GenerateConfig, *, on_gpu: bool, routed_experts: bool = False) -> None:
    """Refuse, before anything starts, an engine that is missing or outside its supported
    versions, and (vLLM-CPU) a model or a feature it cannot serve: RuntimeError /
    ValueError, one line."""
    if gen.backend == "vllm" and routed_experts and not on_gpu:
        # vLLM 0.32 reports routing only through Model Runner V2 (its aux-output connector
        # refuses V1), and Model Runner V2 refuses to start without Triton: on the CPU the
        # server would exit at start-up
        raise ValueError("algo.routing_replay with vLLM-CPU: vLLM 0.32 reports routed experts only with "
                         "VLLM_USE_V2_MODEL_RUNNER=1, which needs Triton (GPUs); use the embedded server or SGLang")
    if gen.backend == "vllm":
        require_vllm()
        check_model(model_dir, on_gpu)
    else:
        check_sglang_version()


def engine_command(model_dir: str, port: int, gen: GenerateConfig, *, seed: int, dtype: str,
                   on_gpu: bool, routed_experts: bool = False) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of one vLLM or SGLang server (``gen.backend``): what the
    local spawner runs and what the Slurm server step execs. ``routed_experts``: the
    server reports every position's experts (``algo.routing_replay``)."""
    if gen.backend == "vllm":
        return (vllm_command(model_dir, port, gen, seed=seed, dtype=dtype, on_gpu=on_gpu, routed_experts=routed_experts),
                vllm_env(gen, on_gpu=on_gpu, routed_experts=routed_experts))
    return (sglang_command(model_dir, port, gen, seed=seed, dtype=dtype, on_gpu=on_gpu, routed_experts=routed_experts),
            sglang_env(gen, on_gpu=on_gpu))


def wait_healthy(server: ServerProc, timeout: float, what: str = "generation server") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise LaunchError(f"{what} {server.url} exited with code {server.proc.returncode} before it was "
                              f"ready; see {server.log_path}")
        if answers_health(server.url):
            return
        time.sleep(0.25)
    raise LaunchError(f"{what} {server.url} not healthy after {timeout:.0f} s; see {server.log_path}")


def stop_servers(servers: list[ServerProc], grace: float = 5.0) -> None:
    """SIGTERM each server's process group, then SIGKILL what is left of it: also children
    that outlive their leader (vLLM's engine-core and worker processes can miss a SIGTERM
    under load and would be orphaned, holding memory)."""
    for s in servers:
        if s.proc.poll() is None:
            try:
                os.killpg(s.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for s in servers:
        try:
            s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        while _group_alive(s.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            os.killpg(s.proc.pid, signal.SIGKILL)  # the group keeps the leader's id after it exits
        except ProcessLookupError:
            pass
        s.proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _rank_entry(rank: int, world: int, port: int, threads: int, fn: Callable[..., Any], args: tuple) -> None:
    die_with_parent()
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch

    torch.set_num_threads(threads)
    fn(*args)


def rank_threads(world: int, busy_cores: int = 0) -> int:
    """Torch threads per local rank: the cores not taken by colocated servers, shared out.
    Oversubscribed cores cost far more than an idle one (a first policy update measured
    25.6 s with 2 threads per rank next to a 1-thread server on 2 cores, 6.7 s with 1)."""
    return max(1, ((os.cpu_count() or 1) - busy_cores) // world)


@dataclass
class RankGroup:
    """Trainer ranks as local processes (torch.distributed env set for each)."""

    procs: list[Any] = field(default_factory=list)

    def start(self, fn: Callable[..., Any], world: int, args: tuple, threads: int | None = None,
              name: str = "trainer") -> None:
        threads = rank_threads(world) if threads is None else threads
        ctx = mp.get_context("spawn")
        port = free_port()
        for rank in range(world):
            proc = ctx.Process(target=_rank_entry, args=(rank, world, port, threads, fn, args), name=f"{name}-rank{rank}")
            proc.start()
            self.procs.append(proc)

    def wait(self, poll: float = 0.5, tick: Callable[[], None] | None = None) -> int:
        """Block until all ranks exit; if one fails, stop the others. Returns the worst exit
        code. ``tick`` runs at every poll (the servers' keeper)."""
        while True:
            if tick is not None:
                tick()
            codes = [p.exitcode for p in self.procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                self.stop()
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll)

    def stop(self, grace: float = 10.0) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + grace
        for p in self.procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()


class LocalBackend:
    """Servers as ``realscale serve`` subprocesses, ranks as spawned processes."""

    def __init__(self, cfg: Config, out_dir: str) -> None:
        self.cfg, self.out_dir = cfg, out_dir
        self.servers: list[ServerProc] = []
        self.ranks = RankGroup()
        self.keeper: ServerKeeper | None = None
        self.model_dir = ""
        self._first_gpu: int | None = None

    def prepare(self) -> None:
        """A plan must fit this machine (:func:`realscale.planner.validate.check_capacity`):
        its ConfigError reaches the command line as a user error (one line, status 2)."""
        from realscale.planner.validate import check_capacity, local_slots

        if self.cfg.parallel.plan:
            slots, unit, gpus = local_slots()
            check_capacity(self.cfg, slots, unit, "parallel.plan", gpus)
        os.makedirs(os.path.join(self.out_dir, "logs"), exist_ok=True)

    def start_servers(self, model_dir: str, cfg_dict: dict[str, Any], wait: bool = True) -> list[str]:
        """Start the run's servers; their URLs (each process picks its port here, so they
        are known at once). ``wait=False``: return without waiting for them to answer; the
        supervisor starts the trainer ranks meanwhile (their imports and engine build
        overlap the servers' start-up) and then calls :meth:`servers_ready`."""
        g = self.cfg.generate
        # on GPUs trainer rank r has GPU r (LOCAL_RANK); the servers take the GPUs after them
        first_gpu = self._first_gpu = self.cfg.parallel.world_size if cuda_usable() else None
        self.model_dir = model_dir
        logs = os.path.join(self.out_dir, "logs")
        if g.backend != "embedded":
            self.servers = spawn_engine_servers(model_dir, g, logs, seed=self.cfg.run.seed, dtype=self.cfg.model.dtype,
                                                first_gpu=first_gpu, routed_experts=self.cfg.algo.routing_replay)
        else:
            self.servers = spawn_servers(model_dir, g.num_servers, logs, host=g.host, seed=self.cfg.run.seed,
                                         context_length=g.context_length, max_running=g.max_running_requests,
                                         tp=g.tp, first_gpu=first_gpu)
        if wait:
            self.servers_ready()
        urls = [s.url for s in self.servers]
        self.keeper = ServerKeeper(self.out_dir, urls, self.cfg.launch.server_restarts, self)
        return urls

    def servers_ready(self) -> None:
        """Every server answers /health within ``launch.health_timeout``, else all are
        stopped and a one-line :class:`LaunchError` names the one that did not (its log)."""
        g = self.cfg.generate
        wait_all_healthy(self.servers, self.cfg.launch.health_timeout,
                         what="generation server" if g.backend == "embedded" else engine_name(g))

    # ServerHooks (realscale/launcher/restart.py)
    def server_exit_code(self, i: int) -> int | None:
        return self.servers[i].proc.poll()

    def respawn_server(self, i: int) -> None:
        g, logs, dead = self.cfg.generate, os.path.join(self.out_dir, "logs"), self.servers[i]
        stop_servers([dead], grace=1.0)  # what is left of it (vLLM's engine core, SGLang's scheduler)
        old_port = urlsplit(dead.url).port or 0
        if g.backend == "embedded":
            self.servers[i] = spawn_embedded_server(self.model_dir, i, logs, host=g.host, seed=self.cfg.run.seed,
                                                    context_length=g.context_length, max_running=g.max_running_requests,
                                                    tp=g.tp, first_gpu=self._first_gpu, avoid_port=old_port)
            return
        gpus = None if self._first_gpu is None else devices_of_server(self._first_gpu + i * g.tp, g.tp)
        self.servers[i] = spawn_engine_server(self.model_dir, g, os.path.join(logs, f"server{i}.log"),
                                              seed=self.cfg.run.seed + i, dtype=self.cfg.model.dtype, gpus=gpus,
                                              avoid_port=old_port, routed_experts=self.cfg.algo.routing_replay)

    def server_ready(self, i: int) -> str:
        server = self.servers[i]
        wait_healthy(server, self.cfg.launch.health_timeout)
        return server.url

    def start_ranks(self, fn: Callable[..., Any], world: int, args: tuple, name: str = "trainer") -> None:
        """``world`` processes running ``fn(*args)`` with the torch.distributed variables of
        rank r of ``world`` (LOCAL_RANK r: on GPUs, GPU r); ``name``: the trainer, or an SFT stage."""
        # each embedded server rank runs one torch thread (start_servers' default); each vLLM
        # or SGLang server rank generate.cpu_threads
        g = self.cfg.generate
        busy = len(self.servers) * g.tp * (1 if g.backend == "embedded" else g.cpu_threads)
        self.ranks.start(fn, world, args, threads=rank_threads(world, busy_cores=busy), name=name)

    def wait(self) -> int:
        return self.ranks.wait(tick=self.keeper.check if self.keeper is not None else None)

    def stop(self) -> None:
        self.ranks.stop()
        stop_servers(self.servers)

    def requeue(self) -> None:
        """Nothing requeues a local run: started again in the same directory, it resumes."""
        print("realscale: run the same command again to resume from the checkpoint", flush=True)

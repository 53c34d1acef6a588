"""Run a function in N local torch.distributed processes and collect the results.

Used by the tests (N gloo processes compared against one) and by benchmarks. Each rank
runs ``fn(*args)`` after ``init_process_group``; its return value (picklable) comes back
in rank order. A rank that raises, dies, or outlives ``timeout`` makes
:func:`run_distributed` raise :class:`DistributedError` carrying that rank's traceback,
and every other rank is killed: no orphans, no hung test.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
from typing import Any, Callable


class DistributedError(RuntimeError):
    """A rank failed; the message holds its traceback."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, backend: str, env: dict[str, str],
            fn: Callable[..., Any], args: tuple, conn: Any) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        try:
            result = fn(*args)
        finally:
            dist.destroy_process_group()
        conn.send(("ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report anything, including SystemExit
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class DistributedJob:
    """N spawned ranks running ``fn(*args)``; :meth:`wait` collects their results, and
    :meth:`kill` ends them (another job they talk to failed)."""

    def __init__(self, fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                 env: dict[str, str] | None = None) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        port = free_port()
        self.world_size = world_size
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            # Not daemonic: ranks may start processes of their own (megatron's checkpoint
            # writer does); wait()/kill() end any rank still alive.
            proc = ctx.Process(target=_worker, args=(rank, world_size, port, backend, dict(env or {}), fn, args,
                                                     child))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    def wait(self, timeout: float = 300.0) -> list[Any]:
        """Every rank's result, in rank order; a rank that fails, dies or outlives
        ``timeout`` raises :class:`DistributedError` and every rank is ended."""
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        try:
            while pending:
                if time.monotonic() > deadline:
                    raise DistributedError(f"ranks {sorted(pending)} of {self.world_size} did not finish within "
                                           f"{timeout:.0f} s")
                for rank in sorted(pending):
                    conn = self.conns[rank]
                    if conn.poll(0.05):
                        try:
                            status, payload = conn.recv()
                        except EOFError:
                            raise DistributedError(f"rank {rank} died (exit code {self.procs[rank].exitcode})") from None
                        if status == "error":
                            raise DistributedError(f"rank {rank} of {self.world_size} failed:\n{payload}")
                        results[rank] = pickle.loads(payload)
                        pending.discard(rank)
                    elif not self.procs[rank].is_alive() and not conn.poll(0):
                        raise DistributedError(f"rank {rank} died (exit code {self.procs[rank].exitcode}) "
                                               "without a result")
        finally:
            self._end(grace=5 if not pending else 0)
        return results

    def kill(self) -> None:
        self._end(grace=0)

    def _end(self, grace: float) -> None:
        for proc in self.procs:
            proc.join(timeout=grace)
            if proc.is_alive():
                proc.kill()
                proc.join()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0,
                    backend: str = "gloo", env: dict[str, str] | None = None) -> list[Any]:
    """``[fn(*args) on rank r for r in range(world_size)]``, each in its own process.

    ``fn`` must be importable (a module-level function) because ranks are spawned.
    """
    return DistributedJob(fn, world_size, *args, backend=backend, env=env).wait(timeout)

"""Run a function in N local torch.distributed processes and collect the results.

Used by the tests (N gloo processes compared against one) and by benchmarks. Each rank
runs ``fn(*args)`` after ``init_process_group``; its return value (picklable) comes back
in rank order. A rank that raises, dies, or outlives ``timeout`` makes
:func:`run_distributed` raise :class:`DistributedError` carrying that rank's traceback,
and every other rank is killed: no orphans, no hung test.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

from realscale.parallel import net
from realscale.parallel.device import init_distributed

# How long a rank's failure waits for news of a peer's death that caused it.
DEATH_GRACE_S = 1.0


class DistributedError(RuntimeError):
    """A rank failed; the message holds its traceback."""


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies, so that even a
    SIGKILLed supervisor leaves no generation server or trainer rank behind."""
    if not sys.platform.startswith("linux"):
        return
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def exit_with_parent(poll_s: float = 1.0) -> None:
    """Have this process exit once the process that started it is gone, watched from a
    daemon thread (``getppid`` changes when the parent process exits). For a process whose
    start an other library owns and that a parent's *thread* starts, where
    :func:`die_with_parent` would not do: the kernel's parent-death signal follows the
    creating thread, not its process."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _worker(rank: int, world_size: int, port: int, backend: str, env: dict[str, str],
            fn: Callable[..., Any], args: tuple, conn: Any, collective_timeout_s: float | None = None) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        init_distributed(backend, collective_timeout_s)  # as a trainer rank does (the device contract too)
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
                 env: dict[str, str] | None = None, collective_timeout_s: float | None = None) -> None:
        ctx = mp.get_context("spawn")
        port = net.free_port()
        self.world_size = world_size
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            # Not daemonic: ranks may start processes of their own (megatron's checkpoint
            # writer does); wait()/kill() end any rank still alive.
            proc = ctx.Process(target=_worker, args=(rank, world_size, port, backend, dict(env or {}), fn, args,
                                                     child, collective_timeout_s))
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
                    message = self._receive(rank, wait=0.05)
                    if message is None:
                        continue
                    status, payload = message
                    if status == "died":
                        raise DistributedError(self._death(rank))
                    if status == "error":
                        raise self._root_cause(rank, payload, pending)
                    results[rank] = pickle.loads(payload)
                    pending.discard(rank)
        finally:
            self._end(grace=5 if not pending else 0)
        return results

    def _receive(self, rank: int, wait: float) -> tuple[str, Any] | None:
        """What ``rank`` sent: ("ok", pickled result) or ("error", traceback); ("died", None)
        when it closed its pipe or exited without sending; None when nothing came yet."""
        conn = self.conns[rank]
        if conn.poll(wait):
            try:
                return conn.recv()
            except EOFError:
                return ("died", None)
        if not self.procs[rank].is_alive() and not conn.poll(0):
            return ("died", None)
        return None  # alive, or exited with a message still to read (the next call reads it)

    def _root_cause(self, rank: int, payload: str, pending: set[int]) -> DistributedError:
        """The error to report when ``rank`` failed with ``payload``.

        A rank that dies takes its sockets with it, and its peers then fail on
        "Connection reset by peer" (rank 0 holds the TCPStore); those peers' tracebacks
        can reach us before the death is seen. So look, for a moment, for another rank
        that died without a result: that death is the cause, and is reported first.
        """
        failed = f"rank {rank} of {self.world_size} failed:\n{payload}"
        silent = pending - {rank}  # ranks that have not reported; one that reports is no death
        deadline = time.monotonic() + DEATH_GRACE_S
        while True:
            for other in sorted(silent):
                message = self._receive(other, wait=0)
                if message is None:
                    continue
                if message[0] == "died":
                    return DistributedError(f"{self._death(other)}; then {failed}")
                silent.discard(other)
            if time.monotonic() > deadline:
                return DistributedError(failed)
            time.sleep(0.05)

    def _death(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(timeout=1.0)  # its pipe can close a moment before it is reaped
        return f"rank {rank} died (exit code {proc.exitcode}) without a result"

    def kill(self) -> None:
        self._end(grace=0)

    def _end(self, grace: float) -> None:
        for proc in self.procs:
            proc.join(timeout=grace)
            if proc.is_alive():
                proc.kill()
                proc.join()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0,
                    backend: str = "gloo", env: dict[str, str] | None = None,
                    collective_timeout_s: float | None = None) -> list[Any]:
    """``[fn(*args) on rank r for r in range(world_size)]``, each in its own process.

    ``fn`` must be importable (a module-level function) because ranks are spawned.
    ``collective_timeout_s``: the default group's timeout (None: torch's default).
    """
    return DistributedJob(fn, world_size, *args, backend=backend, env=env,
                          collective_timeout_s=collective_timeout_s).wait(timeout)

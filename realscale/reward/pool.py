"""A process pool that survives its workers: hung ones are killed, dead ones replaced.

``multiprocessing.Pool`` and ``concurrent.futures.ProcessPoolExecutor`` cannot do this: a
worker stuck in C code (sympy expanding ``9^(9^9)``) never returns, and a dead worker
breaks the whole executor. Here each worker slot has a driver thread that owns one child
process and one pipe:

1. it takes a batch of items off a shared queue (batches amortise pickling and IPC),
2. sends it, then waits, watching a shared progress cell in which the child writes which
   item it is on and since when,
3. if an item runs past ``hard_timeout`` the child is killed; that item fails with
   :class:`WorkerTimeout`, the batch's other items go back to the front of the queue, and
   a fresh child is started for the next batch. A child that dies fails its current item
   with :class:`WorkerCrashed` the same way.

Results come back as ``concurrent.futures.Future`` objects, so callers can wait on them
from threads or await them from asyncio (``asyncio.wrap_future``). Children are started
with ``spawn``: forking a parent that runs threads (and maybe torch) is unsafe.
"""

from __future__ import annotations

import collections
import math
import multiprocessing as mp
import os
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any, Callable

_IDLE = 0.0
_POLL_S = 0.01
_MAX_ATTEMPTS = 3  # an item whose batch lost its worker this often fails instead of retrying


class WorkerTimeout(Exception):
    """The item ran past the pool's hard timeout; its worker was killed."""


class WorkerCrashed(Exception):
    """The worker process died while running the item."""


def _worker_main(conn: Connection, progress: Any, fn: Callable[[Any], Any],
                 init: Callable[..., None] | None, init_args: tuple[Any, ...]) -> None:
    """Child process: run ``fn`` on each item of each batch; report progress; reply per batch."""
    if init is not None:
        init(*init_args)
    conn.send("ready")
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):  # the parent went away
            return
        if batch is None:
            return
        results = []
        for i, item in enumerate(batch):
            progress[1] = time.monotonic()  # when this item started ...
            progress[0] = float(i)  # ... and which one it is
            results.append(fn(item))
        progress[1] = _IDLE
        conn.send(results)


class _Slot:
    """One child process with its pipe and progress cell (owned by one driver thread)."""

    def __init__(self, ctx: Any, fn: Callable[[Any], Any], init: Callable[..., None] | None,
                 init_args: tuple[Any, ...]) -> None:
        self.progress = ctx.RawArray("d", 2)
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, daemon=True,
                                args=(child_conn, self.progress, fn, init, init_args))
        self.proc.start()
        child_conn.close()
        self.ready = False

    def wait_ready(self, timeout: float) -> None:
        if self.ready:
            return
        if not self.conn.poll(timeout):
            self.kill()
            raise WorkerCrashed(f"reward worker did not start within {timeout:.0f} s")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(timeout=5)
            raise WorkerCrashed(
                f"reward worker failed to start (exit code {self.proc.exitcode}); a script that "
                "creates a reward pool must guard its main code with `if __name__ == '__main__':`") from None
        if msg != "ready":
            raise WorkerCrashed(f"reward worker sent {msg!r} instead of 'ready'")
        self.ready = True

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class WatchdogPool:
    """Run ``fn(item)`` in up to ``workers`` processes; kill and replace any that hangs or dies.

    ``fn`` (and ``init``) must be module-level functions (they are pickled by name).
    ``hard_timeout`` bounds one item's run time; ``max_batch`` bounds items per message.
    A worker process starts when its driver thread first takes work, and a driver without
    one takes work only while every started worker is busy (none starting, none idle): a
    pool whose items come one at a time (a math reward's few symbolic checks) runs one
    process, not ``workers`` (each imports sympy: ~0.4 CPU-seconds, which a run's start-up
    paid for nothing, BENCHMARKS.md); under load all ``workers`` start, the second once the
    first is up.
    """

    def __init__(self, fn: Callable[[Any], Any], workers: int, hard_timeout: float, *,
                 init: Callable[..., None] | None = None, init_args: tuple[Any, ...] = (),
                 max_batch: int = 64, start_timeout: float = 120.0) -> None:
        if workers < 1:
            raise ValueError(f"WatchdogPool: workers must be >= 1, got {workers}")
        if hard_timeout <= 0:
            raise ValueError(f"WatchdogPool: hard_timeout must be > 0, got {hard_timeout}")
        if max_batch < 1:
            raise ValueError(f"WatchdogPool: max_batch must be >= 1, got {max_batch}")
        self._fn, self._init, self._init_args = fn, init, init_args
        self._workers, self._hard_timeout, self._max_batch = workers, hard_timeout, max_batch
        self._start_timeout = start_timeout
        self._ctx = mp.get_context("spawn")
        self._queue: collections.deque[tuple[Any, Future, int]] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._waiting: set[int] = set()  # drivers waiting in _take
        self.restarts = 0  # workers replaced after a hang or a crash
        self._slots: list[_Slot | None] = [None] * workers  # started on a driver's first batch (_ready_slot)
        self._threads = [threading.Thread(target=self._drive, args=(i,), daemon=True,
                                          name=f"reward-pool-{i}") for i in range(workers)]
        for t in self._threads:
            t.start()

    # ---------------------------------------------------------------- public

    def submit(self, item: Any) -> Future:
        """Queue one item; the future resolves to ``fn(item)`` or a Worker* exception."""
        return self.submit_many([item])[0]

    def submit_many(self, items: list[Any]) -> list[Future]:
        futures: list[Future] = [Future() for _ in items]
        with self._cond:
            if self._closed:
                raise RuntimeError("WatchdogPool is closed")
            self._queue.extend((item, fut, 0) for item, fut in zip(items, futures))
            self._cond.notify_all()
        return futures

    def pids(self) -> list[int]:
        """Process ids of the live workers (for tests and monitoring)."""
        return [s.proc.pid for s in self._slots if s is not None and s.proc.pid is not None and s.proc.is_alive()]

    def close(self) -> None:
        """Stop the workers; queued items that never ran fail with RuntimeError."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for _, fut, _ in pending:
            fut.set_exception(RuntimeError("WatchdogPool closed before the item ran"))
        for t in self._threads:
            t.join(timeout=self._hard_timeout + 10)
        for slot in self._slots:
            if slot is not None:
                try:
                    slot.conn.send(None)
                except OSError:
                    pass
                slot.proc.join(timeout=2)
                slot.kill()

    # ---------------------------------------------------------------- driver

    def _new_slot(self) -> _Slot:
        return _Slot(self._ctx, self._fn, self._init, self._init_args)

    def _take(self, index: int) -> list[tuple[Any, Future, int]] | None:
        """Next batch for driver ``index``: a fair share of the queue, at most ``max_batch``;
        left to a driver with a started worker while one waits for work (:meth:`_defers`)."""
        with self._cond:
            self._waiting.add(index)
            try:
                while not self._closed and (not self._queue or self._defers(index)):
                    self._cond.wait()
            finally:
                self._waiting.discard(index)
            if self._closed:
                return None
            n = min(self._max_batch, max(1, math.ceil(len(self._queue) / self._workers)))
            batch = [self._queue.popleft() for _ in range(min(n, len(self._queue)))]
            if self._queue:
                self._cond.notify_all()  # the rest: for the other drivers, started or not
            return batch

    def _defers(self, index: int) -> bool:
        """Driver ``index`` has no worker yet, and another's worker is still starting or
        waiting for work (so a second process starts only while the first one is busy)."""
        if self._slots[index] is not None:
            return False
        for i, slot in enumerate(self._slots):
            if i != index and slot is not None and (not slot.ready or i in self._waiting):
                return True
        return False

    def _requeue(self, entries: list[tuple[Any, Future, int]]) -> None:
        """Put a lost batch's other items back at the front, or fail them after too many tries."""
        retry = []
        for item, fut, attempts in entries:
            if attempts + 1 >= _MAX_ATTEMPTS:
                fut.set_exception(WorkerCrashed(f"item lost its worker {attempts + 1} times"))
            else:
                retry.append((item, fut, attempts + 1))
        with self._cond:
            self._queue.extendleft(reversed(retry))
            self._cond.notify_all()

    def _drive(self, index: int) -> None:
        while True:
            batch = self._take(index)
            if batch is None:
                return
            try:
                self._run_batch(index, batch)
            except Exception as exc:  # noqa: BLE001 - a driver must never die with items in hand
                for _, fut, _ in batch:
                    if not fut.done():
                        fut.set_exception(exc)

    def _ready_slot(self, index: int) -> _Slot:
        slot = self._slots[index]
        if slot is None or not slot.proc.is_alive():
            if slot is not None:  # died while idle: replacing it is a restart too
                slot.kill()
                self.restarts += 1
            slot = self._slots[index] = self._new_slot()
        if not slot.ready:
            slot.wait_ready(self._start_timeout)
            with self._cond:
                self._cond.notify_all()  # drivers deferring to this start may take the rest now
        return slot

    def _run_batch(self, index: int, batch: list[tuple[Any, Future, int]]) -> None:
        slot = self._ready_slot(index)
        slot.progress[0], slot.progress[1] = -1.0, _IDLE
        slot.conn.send([item for item, _, _ in batch])
        sent = time.monotonic()
        # A backstop for a child stuck outside any item (e.g. while unpickling the batch).
        backstop = sent + self._hard_timeout * (len(batch) + 1) + self._start_timeout
        while True:
            if slot.conn.poll(_POLL_S):
                try:
                    results = slot.conn.recv()
                except (EOFError, OSError):
                    self._lose_worker(index, slot, batch, WorkerCrashed("reward worker died"))
                    return
                for (_, fut, _), res in zip(batch, results):
                    fut.set_result(res)
                return
            now = time.monotonic()
            started, current = slot.progress[1], int(slot.progress[0])
            if started != _IDLE and now - started > self._hard_timeout:
                self._lose_worker(index, slot, batch, WorkerTimeout(
                    f"check ran past {self._hard_timeout:.1f} s; worker killed"), current)
                return
            if not slot.proc.is_alive() and not slot.conn.poll(0):
                code = slot.proc.exitcode
                self._lose_worker(index, slot, batch, WorkerCrashed(f"reward worker died (exit code {code})"), current)
                return
            if now > backstop:
                self._lose_worker(index, slot, batch, WorkerTimeout("reward worker stopped responding"), current)
                return

    def _lose_worker(self, index: int, slot: _Slot, batch: list[tuple[Any, Future, int]],
                     exc: Exception, current: int = -1) -> None:
        """Kill the child, fail the item it was on, requeue the rest of its batch."""
        slot.kill()
        self._slots[index] = None
        self.restarts += 1
        others = batch
        if 0 <= current < len(batch):
            batch[current][1].set_exception(exc)
            others = batch[:current] + batch[current + 1 :]
        self._requeue(others)
        if os.environ.get("REALSCALE_DEBUG_POOL"):
            print(f"reward pool: worker {index} replaced ({exc})", flush=True)

"""The rollout controller in its own process, so that trainer rank 0 trains like the others.

Trainer rank 0 (the driver) used to run the controller on a thread of its own process:
its event loop, HTTP client, workflow and reward scoring shared rank 0's interpreter
(the GIL) and cores with the training step, and rank 0 built every batch from Python
lists. Here the controller lives in a child process (:class:`ControllerProcess`) and
rank 0 calls it over a pipe by name (:data:`OPERATIONS`):

- ``next_batch(n, version, timeout, poll_s, waited_s)`` -> :class:`RolloutBatch`: the
  child takes the ``n`` groups (waiting at most the recipe's batch limit,
  :func:`wait_for_groups`; with ``poll_s``, None after that many seconds: rank 0 waits in
  slices and looks at the servers between them) and packs them into flat numpy arrays
  (:func:`pack_groups_raw`: no torch); the arrays cross the pipe as raw bytes behind a
  small pickled header (token lists are never pickled), and rank 0 turns them into the
  trainer's ``PackedBatch``, computing the advantages (:meth:`RawRolloutBatch.packed`);
- ``pause()`` / ``resume()`` (no new prompts, and the request clocks of the controller's
  client held, while the servers are paused for a weight update), ``set_version(v)``,
  ``retire(urls)``, ``admit(urls)`` (restarted servers, once a weight update reached them),
  ``rotation()`` (the servers in rotation), ``stats()``, ``reward_pool_stats()`` (the code-reward pools live in
  the child), ``state_dict()``; ``stop()`` ends the child.

:class:`LocalRollouts` is the same interface around a controller on a thread of this
process (``rollout.controller_process=false``: the former arrangement, kept to measure
what the process saves, and for debugging). Server control does not go through the
controller: :class:`realscale.publish.control.ServerControl` keeps its own client in
rank 0 for pauses and weight updates, and tells the controller which servers a weight
update retired (``retire``) so that generation stops using them.

What runs where: the child never imports torch (1.1 CPU-seconds that were on the critical
path of a run's start-up; ``tests/rollout/test_process.py`` checks it): its packing is
numpy (:mod:`realscale.data.raw_batch`), and everything that needs torch (the tensors,
the advantages, for GAE the token rewards: :func:`realscale.train.actor.raw_to_batch`)
runs in rank 0 on the received arrays, which the tensors share without a copy.

Failures: an exception in the child is raised again in rank 0 with its type and message
(``RolloutError``, ``TimeoutError``, a config error at start-up; its traceback goes to
the child's stderr); a child that dies is a :class:`RolloutError` naming its exit code;
the child exits when rank 0 goes away (the pipe closes; on Linux the kernel's
parent-death signal as well).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from realscale.config import config_from_dict
from realscale.data.raw_batch import RawBatch, pack_raw
from realscale.inference.health import wait_until_serving
from realscale.parallel.spawn import die_with_parent
from realscale.rollout.controller import RolloutError
from realscale.rollout.factory import build_controller
from realscale.rollout.rewards import reward_pool_stats

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from realscale.config import AlgoConfig, Config
    from realscale.data.groups import Group
    from realscale.rollout.controller import RolloutController
    from realscale.train.batch import PackedBatch

log = logging.getLogger(__name__)

OPERATIONS = ("next_batch", "pause", "resume", "set_version", "retire", "admit", "rotation", "stats", "reward_pool_stats",
              "state_dict")
POLL_S = 1.0  # how often a waiting rank 0 checks that the child is alive
BATCH_POLL_S = 30.0  # how often a wait for a batch re-reads its limit


@dataclass
class RolloutBatch:
    """One step's rollouts, packed: the batch, its rollout statistics, and the uids of the
    prompts it trains on (for ``trained_uids.jsonl``)."""

    batch: "PackedBatch"
    stats: dict[str, float] = field(default_factory=dict)
    uids: list[str] = field(default_factory=list)


@dataclass
class RawRolloutBatch:
    """One step's rollouts as the rollout process packs them, torch-free: flat numpy
    arrays (:class:`~realscale.data.raw_batch.RawBatch`), statistics, uids."""

    raw: RawBatch
    stats: dict[str, float] = field(default_factory=dict)
    uids: list[str] = field(default_factory=list)

    def packed(self, algo: "AlgoConfig") -> RolloutBatch:
        """The trainer's batch (tensors on the arrays' memory, advantages from ``algo``)."""
        from realscale.train.actor import raw_to_batch

        return RolloutBatch(raw_to_batch(self.raw, algo), self.stats, self.uids)


def pack_groups_raw(groups: list["Group"], algo: "AlgoConfig", version: int) -> RawRolloutBatch:
    """Groups -> flat arrays (no advantages yet), plus rollout and staleness statistics."""
    raw, stats = pack_raw(groups, algo)
    lags = [version - g.min_version for g in groups]
    stats.update({"staleness/mean": sum(lags) / len(lags), "staleness/max": float(max(lags)),
                  "perf/trained_tokens": float(raw.loss_mask.sum(dtype="float64"))})
    return RawRolloutBatch(raw, stats, [g.uid for g in groups])


def pack_groups(groups: list["Group"], algo: "AlgoConfig", version: int) -> RolloutBatch:
    """Groups -> packed batch with advantages, plus rollout and staleness statistics
    (:func:`pack_groups_raw`, then rank 0's conversion, in this process)."""
    return pack_groups_raw(groups, algo, version).packed(algo)


def wait_for_groups(controller: "RolloutController", cfg: "Config", num_groups: int, poll_s: float | None = None,
                    waited_s: float = 0.0) -> list["Group"] | None:
    """``num_groups`` groups from the controller, raising TimeoutError once no group has
    finished (trained or filtered out) for the batch limit that follows from the recipe's
    generation length and the measured decode rate (none while the request limit is none;
    realscale/inference/timeouts.py). The limit is re-read while waiting, as rates get
    measured. It counts from the later of the wait's start and the last finished group:
    with the all-equal filter rejecting most groups (an untrained policy), a healthy batch
    takes many rounds of generation, which a limit on the whole wait would end (it did, on
    a slow CI machine: SGLang-on-CPU, ~100 s for one batch). ``poll_s``: return None after
    that many seconds without a batch (the caller waits in slices; ``waited_s``: what
    earlier slices of the same wait counted towards the limit)."""
    r, g = cfg.rollout, cfg.generate
    now = time.monotonic()
    start, until = now - waited_s, None if poll_s is None else now + poll_s
    while True:
        limit = controller.client.timeouts.batch_limit(
            g.max_new_tokens, num_groups * r.n_samples, g.num_servers * g.max_running_requests)
        idle = time.monotonic() - max(start, controller.last_group_at)
        left = BATCH_POLL_S if limit is None else min(BATCH_POLL_S, limit - idle)
        if until is not None:
            left = min(left, until - time.monotonic())
        try:
            return controller.get_batch(num_groups, timeout=max(left, 0.0))
        except TimeoutError as exc:
            idle = time.monotonic() - max(start, controller.last_group_at)
            if limit is not None and idle >= limit:
                raise TimeoutError(f"{exc}; no group finished for {idle:.0f} s, past the batch limit of "
                                   f"{limit:.0f} s (generate.request_timeout, generate.timeout_slack)") from None
            if until is not None and time.monotonic() >= until:
                return None


class LocalRollouts:
    """The rollout interface around a controller in this process (a thread runs its loop)."""

    def __init__(self, controller: "RolloutController", cfg: "Config") -> None:
        self.controller, self.cfg = controller, cfg

    @classmethod
    def build(cls, cfg: "Config", model_dir: str, server_urls: list[str], out_dir: str,
              state: dict[str, Any] | None = None, shard: tuple[int, int] = (0, 1)) -> "LocalRollouts":
        """The run's controller (resumed from ``state``), started paused: generation waits
        until the servers hold this run's weights. ``shard`` (i, k): the prompts of
        rollout process i of k (realscale/rollout/sharded.py)."""

        controller = build_controller(cfg, model_dir, server_urls, out_dir, rank=shard[0], world=shard[1])
        controller.outages_handled = True  # every server down: the driver republishes or fails (publish/outage.py)
        if state is not None:
            controller.load_state_dict(state)
        controller.pause()
        controller.start()
        return cls(controller, cfg)

    def next_batch(self, num_groups: int, version: int, timeout: float | None = None, poll_s: float | None = None,
                   waited_s: float = 0.0) -> RolloutBatch | None:
        """The next ``num_groups`` groups, packed; staleness measured against ``version``
        (the trainer's). ``timeout``: seconds, or None for the recipe's batch limit.
        ``poll_s`` (with the batch limit): None once that many seconds passed without a
        batch; ``waited_s`` of the limit were used by earlier calls (:func:`wait_for_groups`)."""
        raw = self.next_raw_batch(num_groups, version, timeout, poll_s, waited_s)
        return None if raw is None else raw.packed(self.cfg.algo)

    def next_raw_batch(self, num_groups: int, version: int, timeout: float | None = None,
                       poll_s: float | None = None, waited_s: float = 0.0) -> RawRolloutBatch | None:
        """:meth:`next_batch` before the conversion to tensors (what the child answers with)."""
        if timeout is None:
            groups = wait_for_groups(self.controller, self.cfg, num_groups, poll_s, waited_s)
            if groups is None:
                return None
        else:
            groups = self.controller.get_batch(num_groups, timeout=timeout)
        return pack_groups_raw(groups, self.cfg.algo, version)

    def rotation(self) -> list[list[str]]:
        """Per rollout shard (here: one), the servers in rotation."""
        return [self.controller.rotation()]

    def pause(self) -> None:
        """No new prompts; the servers are being paused, so requests held there do not
        run out of time (the controller's client keeps its own request clocks). Both from
        this thread, never a round trip through the controller's loop: a loop ingesting at
        full speed ran such a call 32-61 s late and held up rank 0's weight update
        (BENCHMARKS.md, the rollout tier)."""
        self.controller.pause()
        self.controller.client.timeouts.pause()

    def resume(self) -> None:
        self.controller.client.timeouts.resume()
        self.controller.resume()

    def set_version(self, version: int) -> None:
        self.controller.set_version(version)

    def retire(self, urls: list[str]) -> None:
        self.controller.retire_servers(urls)

    def admit(self, urls: list[str]) -> None:
        self.controller.admit_servers(urls)

    def stats(self) -> dict[str, Any]:
        return self.controller.stats()

    def reward_pool_stats(self) -> dict[str, float]:
        return reward_pool_stats()

    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict()

    def stop(self) -> None:
        self.controller.stop()


class ControllerProcess:
    """The rollout interface of :class:`LocalRollouts`, served by a child process. The
    constructor starts the child and returns; :meth:`ready` (and the first call) waits
    until its controller is built and started (paused, or generating with ``go``), or
    raises its start-up error. Several are started at once by starting them all first."""

    def __init__(self, cfg: "Config", model_dir: str, server_urls: list[str], out_dir: str,
                 state: dict[str, Any] | None = None, shard: tuple[int, int] = (0, 1), *, go: bool = False) -> None:
        ctx = mp.get_context("spawn")
        self._algo = cfg.algo  # the received arrays become the batch here (advantages and all)
        self._conn, child = ctx.Pipe()
        # Not daemonic: reward scoring may start processes of its own.
        self._proc = ctx.Process(target=_serve,
                                 args=(child, asdict(cfg), model_dir, server_urls, out_dir, state, shard, go),
                                 name=f"rollout-controller{shard[0] if shard[1] > 1 else ''}")
        self._proc.start()
        child.close()
        self._lock = threading.Lock()
        self._stopped = False
        self._built = False

    def ready(self) -> None:
        """Wait until the child's controller is built and started; its start-up error, raised."""
        with self._lock:
            self._ensure_built()

    def _ensure_built(self) -> None:
        if not self._built:
            self._reply()
            self._built = True

    def _call(self, op: str, *args: Any) -> Any:
        if self._stopped:
            raise RolloutError(f"rollout controller process: {op}() after stop()")
        with self._lock:
            self._ensure_built()
            self._conn.send((op, args))
            return self._reply()

    def _reply(self) -> Any:
        while not self._conn.poll(POLL_S):
            if not self._proc.is_alive() and not self._conn.poll(0):
                raise RolloutError(f"the rollout controller process died (exit code {self._proc.exitcode})")
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):  # the child closed its end, or died with it
            self._proc.join(5)
            raise RolloutError(f"the rollout controller process died (exit code {self._proc.exitcode})") from None
        if kind == "error":
            raise payload
        if kind == "batch":
            return _recv_batch(self._conn, payload).packed(self._algo)
        return payload

    def next_batch(self, num_groups: int, version: int, timeout: float | None = None, poll_s: float | None = None,
                   waited_s: float = 0.0) -> RolloutBatch | None:
        return self._call("next_batch", num_groups, version, timeout, poll_s, waited_s)

    def rotation(self) -> list[list[str]]:
        return self._call("rotation")

    def pause(self) -> None:
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")

    def set_version(self, version: int) -> None:
        self._call("set_version", version)

    def retire(self, urls: list[str]) -> None:
        self._call("retire", list(urls))

    def admit(self, urls: list[str]) -> None:
        self._call("admit", list(urls))

    def stats(self) -> dict[str, Any]:
        return self._call("stats")

    def reward_pool_stats(self) -> dict[str, float]:
        return self._call("reward_pool_stats")

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the controller and end the child (killed if it does not end in time)."""
        if self._stopped:
            return
        try:
            if self._proc.is_alive():
                self._call("stop")
        except Exception as exc:  # noqa: BLE001 - a dead child, or its start-up error not yet collected
            log.warning("rollout controller process did not stop cleanly: %r", exc)
        finally:
            self._stopped = True
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
            self._conn.close()


Rollouts = LocalRollouts | ControllerProcess  # what the trainer's driver holds


def start_rollouts(cfg: "Config", model_dir: str, server_urls: list[str], out_dir: str,
                   state: dict[str, Any] | None = None, *, go: bool = False) -> Rollouts:
    """The run's rollouts, in a process of their own unless ``rollout.controller_process``
    is false; started paused, or with ``go`` generating at once. ``go`` returns before the
    process is built (its start-up error comes with the first call): a fresh run's
    servers already hold its weights (version 0), so its driver starts the rollouts
    first and builds its engine while the first batch generates."""
    if cfg.rollout.controller_process:
        proc = ControllerProcess(cfg, model_dir, server_urls, out_dir, state, go=go)
        if not go:
            proc.ready()
        return proc
    rollouts = LocalRollouts.build(cfg, model_dir, server_urls, out_dir, state)
    if go:
        wait_until_serving(server_urls, cfg.launch.health_timeout)
        rollouts.resume()
    return rollouts


# ---------------------------------------------------------------------- the child


def _serve(conn: "Connection", cfg_dict: dict[str, Any], model_dir: str, server_urls: list[str], out_dir: str,
           state: dict[str, Any] | None, shard: tuple[int, int], go: bool) -> None:
    """The child: build and start the controller (generating at once with ``go``), then
    answer rank 0 until stop or EOF."""

    die_with_parent()  # no torch here: packing is numpy (module docstring)
    try:
        cfg = config_from_dict(cfg_dict)
        rollouts = LocalRollouts.build(cfg, model_dir, server_urls, out_dir, state, shard)
        if go:  # a fresh run: its servers may still be starting (the supervisor overlaps the two)
            wait_until_serving(server_urls, cfg.launch.health_timeout)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, which raises it
        _send_error(conn, exc)
        return
    if go:
        rollouts.resume()
    conn.send(("ok", None))
    try:
        _answer(conn, rollouts)
    finally:
        rollouts.stop()


def _answer(conn: "Connection", rollouts: LocalRollouts) -> None:
    while True:
        try:
            op, args = conn.recv()
        except EOFError:  # rank 0 is gone
            return
        if op == "stop":
            rollouts.stop()
            conn.send(("ok", None))
            return
        try:
            if op not in OPERATIONS:
                raise ValueError(f"rollout controller process: unknown operation {op!r}")
            # a batch leaves as arrays; rank 0 makes the tensors (and the advantages)
            result = (rollouts.next_raw_batch if op == "next_batch" else getattr(rollouts, op))(*args)
        except Exception as exc:  # noqa: BLE001 - raised again in rank 0
            _send_error(conn, exc)
            continue
        if isinstance(result, RawRolloutBatch):
            _send_batch(conn, result)
        else:
            conn.send(("ok", result))


def _send_error(conn: "Connection", exc: BaseException) -> None:
    if not isinstance(exc, (RolloutError, TimeoutError)):
        log.error("rollout controller process: %s", exc, exc_info=exc)
    try:
        pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - an exception that does not pickle goes as its text
        exc = RolloutError(f"{type(exc).__name__}: {exc}")
    conn.send(("error", exc))


# ---------------------------------------------------------------------- batches over the pipe


def _send_batch(conn: "Connection", rb: RawRolloutBatch, extra: dict[str, Any] | None = None) -> None:
    """Header (stats, uids, per array: name, dtype, shape; ``extra``), then each array's raw bytes."""
    arrays = rb.raw.arrays()
    spec = [(k, v.dtype.str, v.shape) for k, v in arrays.items()]
    conn.send(("batch", {**(extra or {}), "stats": rb.stats, "uids": rb.uids, "spec": spec}))
    for arr in arrays.values():
        conn.send_bytes(_bytes(arr))


def _recv_batch(conn: "Connection", header: dict[str, Any]) -> RawRolloutBatch:
    """What :func:`_send_batch` sent, into fresh arrays (which the batch's tensors then share)."""
    arrays = {}
    for key, dtype, shape in header["spec"]:
        arr = np.empty(shape, dtype=np.dtype(dtype))
        got = conn.recv_bytes_into(_bytes(arr))
        if got != arr.nbytes:
            raise RolloutError(f"rollout controller process: batch array {key!r} came as {got} bytes, "
                               f"expected {arr.nbytes}")
        arrays[key] = arr
    return RawRolloutBatch(RawBatch(**arrays), header["stats"], header["uids"])


def _bytes(arr: np.ndarray) -> np.ndarray:
    """A C-contiguous array's memory as one flat run of bytes (no copy)."""
    return arr.reshape(-1).view("uint8")

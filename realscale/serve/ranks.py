"""The ranks of one embedded generation server (``realscale serve --tp N``).

Processes: the server process is **rank 0** (HTTP + scheduler, :class:`ServerRanks`); it
spawns ranks ``1..N-1`` (:func:`_worker_main`: the same :class:`RankWorker` code, in a
loop) which die with it (``die_with_parent``: the kernel kills them when the thread that
built the :class:`ServerRanks` ends, so build it on the main thread). Workers sit in their
own process group; rank 0 stops them when it shuts down. The ranks form their own two process
groups from a ``TCPStore`` that rank 0 hosts on 127.0.0.1 (never the default group: a
rank can still join any other group, e.g. a trainer's weight group):

- ``ctl`` (gloo, CPU): the control plane. Each scheduler step rank 0 broadcasts a small
  header and the step's inputs (token ids, start positions, last indices and the KV-slot
  moves since the last step); collective RPCs travel here too. Workers idle in a
  broadcast on this group, so it has a long timeout.
- ``tp`` (gloo on CPU, NCCL on GPUs; :mod:`realscale.parallel.device` picks): the
  decoder's ``all_reduce`` / ``all_gather`` (:class:`~realscale.serve.decoder.TPComm`).

Every rank runs the same forward (:class:`~realscale.serve.decoder.ShardedDecoder`)
on its Megatron shard; only rank 0 samples. With ``N = 1`` nothing is spawned and the
very same :class:`RankWorker` runs in the server process: one code path.

**Running code on every rank** (how other components plug in): rank 0 calls
``server.ranks.call_all(method, *args)`` *on the scheduler thread* (``server.engine.call
(lambda: ...)``, i.e. between forward passes). ``method`` is either the name of a public
:class:`RankWorker` method, or ``"package.module:function"``, which every rank imports
and calls as ``function(worker, *args)``. It returns the results in rank order; if any
rank raised, :class:`RankCallError` names each failing rank and its error (vLLM's
``collective_rpc``). Arguments and results are pickled over the ``ctl`` group, so pass
small things (addresses, names), not weights.

**Where the weights live**: ``worker.weights`` (:class:`~realscale.serve.weights.
RankWeights`): ``.flat`` is the rank's one flat buffer in
``shard_index(spec, worker.weights.layout, worker.tp_rank)`` order, ``.spec`` /
``.index`` / ``.layout`` describe it, ``.copy_flat(buf)`` replaces it whole, and writing
into ``.flat`` in place is all a weight update has to do (the decoder reads views of it).
``worker.device`` is the rank's device; ``worker.extras`` is a dict where a component
may keep per-rank state between calls (a joined weight group, a plan).

Failure: a watchdog thread on rank 0 waits on the workers' process sentinels; a worker
that dies sets :attr:`ServerRanks.failure` and calls ``on_failure`` (the server turns
unhealthy and exits). A failed step on any rank is fatal for the same reason (the ranks'
collectives are out of step). On GPUs, the ``ctl`` group keeps idle workers off the GPU
(a pending NCCL broadcast would spin); that path has not been run here.
"""

from __future__ import annotations

import datetime
import importlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import threading
import time
from typing import Any, Callable

import torch

from realscale.inference.weight_sync import WeightReceiver
from realscale.parallel.device import rank_device, store_group
from realscale.parallel.spawn import die_with_parent
from realscale.serve.decoder import ShardedDecoder, TPComm
from realscale.serve.weights import RankWeights, model_spec, read_hf_config

log = logging.getLogger(__name__)

OP_STEP, OP_CALL, OP_STOP = 1, 2, 3
HEADER = 6  # op, slot0, batch, width, moves, payload length
IDLE_TIMEOUT = datetime.timedelta(days=365)  # workers wait for the next step on ctl
STEP_TIMEOUT = datetime.timedelta(minutes=30)


class RankCallError(RuntimeError):
    """A collective RPC failed on at least one rank (the message names each)."""


class RankWorker:
    """What every rank of a server holds, and the methods :meth:`ServerRanks.call_all`
    runs on each (module docstring)."""

    def __init__(self, model_dir: str, tp: int, tp_rank: int, comm: TPComm, *, dtype: torch.dtype,
                 device: torch.device, max_slots: int, max_len: int, load: bool = True) -> None:
        """``load=False``: the weights stay zero until something writes ``weights.flat``
        (a colocated trainer's resharder, :mod:`realscale.serve.colocated`). ``hf_dict``
        is the model's ``config.json``; transformers' config object (:meth:`hf_config`)
        is built only where it is needed (a scaled RoPE: ``realscale/serve/decoder.py``)."""
        self.model_dir, self.tp, self.tp_rank, self.device = model_dir, tp, tp_rank, device
        self.hf_dict = read_hf_config(model_dir)
        self._hf_config: Any = None
        self.weights = RankWeights.allocate(self.hf_dict, tp, tp_rank, dtype, device)
        if load:
            self.weights.load_dir(model_dir)
        self.decoder = ShardedDecoder(self.weights, self.hf_config, comm, max_slots, max_len)
        self.receiver = WeightReceiver()
        self.loader = self.weights.loader()  # spans the buckets of one distributed update
        self.extras: dict[str, Any] = {}

    def hf_config(self) -> Any:
        """transformers' ``AutoConfig`` of the model, loaded on first use."""
        if self._hf_config is None:
            from transformers import AutoConfig

            self._hf_config = AutoConfig.from_pretrained(self.model_dir)
        return self._hf_config

    def step(self, slot0: int, ids: torch.Tensor, start: torch.Tensor, last: torch.Tensor,
             moves: list[tuple[int, int, int]]) -> torch.Tensor:
        """Apply the slot moves, then one forward pass (logits on every rank)."""
        for src, dst, length in moves:
            self.decoder.move_slot(src, dst, length)
        dev = self.decoder.device
        return self.decoder.forward(slot0, ids.to(dev), start.to(dev), last.to(dev))

    # ------------------------------------------------------------------ call_all targets

    def ping(self) -> int:
        return self.tp_rank

    def init_weights_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                           group_name: str, backend: str) -> int:
        """Join a weight group (SGLang's protocol) at ``rank_offset + tp_rank``; returns that rank."""
        rank = rank_offset + self.tp_rank
        self.receiver.init_group(master_address, master_port, rank, world_size, group_name, backend, self.device)
        return rank

    def destroy_weights_group(self, group_name: str) -> None:
        self.receiver.destroy_group(group_name)

    def receive_weights(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                        load_format: str | None = None) -> int:
        """Receive one broadcast bucket of full HF tensors (SGLang's ``load_format``) and
        keep this rank's shards; returns how many spec tensors it completed."""
        named = self.receiver.receive(names, dtypes, shapes, group_name, load_format)
        try:
            return self.loader.add(named)
        except (KeyError, ValueError):
            self.loader.pending.clear()
            raise

    def end_weight_update(self) -> None:
        """An update session ends: a fused tensor sent only in part is an error."""
        self.loader.end_update()

    def load_weights_from_disk(self, model_dir: str) -> int:
        """Load this rank's shard from an HF directory, all or nothing."""
        fresh = RankWeights.allocate(read_hf_config(model_dir), self.tp, self.tp_rank, self.weights.flat.dtype,
                                     self.device)
        if fresh.index.numel != self.weights.index.numel:
            raise ValueError(f"{model_dir}: a different model (its shard has {fresh.index.numel} elements, "
                             f"this server's {self.weights.index.numel})")
        n = fresh.load_dir(model_dir)
        self.weights.copy_flat(fresh.flat)
        return n

    def weight_hashes(self) -> dict[str, str]:
        """A hash per tensor of this rank's flat buffer."""
        return self.weights.hashes()


def _invoke(worker: RankWorker | None, startup_error: str | None, method: str, args: tuple) -> tuple[bool, Any]:
    """Run one RPC on this rank: ``(True, result)`` or ``(False, one-line error)``."""
    if worker is None:
        return False, f"rank failed to start: {startup_error}"
    try:
        if ":" in method:
            mod, _, name = method.partition(":")
            fn: Callable[..., Any] = getattr(importlib.import_module(mod), name)
            return True, fn(worker, *args)
        if method.startswith("_") or not callable(getattr(worker, method, None)):
            raise AttributeError(f"no rank method {method!r}")
        return True, getattr(worker, method)(*args)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises
        log.exception("rank %d: %s failed", worker.tp_rank, method)
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        return False, f"{type(exc).__name__}: {msg}"


# ---------------------------------------------------------------------- wire format (ctl group)


def _broadcast_header(ctl: Any, values: list[int] | None) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64) if values is not None else torch.empty(HEADER, dtype=torch.int64)
    ctl.broadcast(t, 0).wait()
    return t.tolist()


def _broadcast_tensor(ctl: Any, t: torch.Tensor | None, numel: int, dtype: torch.dtype) -> torch.Tensor:
    buf = t.contiguous() if t is not None else torch.empty(numel, dtype=dtype)
    ctl.broadcast(buf, 0).wait()
    return buf


def _to_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _from_bytes(t: torch.Tensor) -> Any:
    return pickle.loads(t.numpy().tobytes())


def _allgather_objects(ctl: Any, obj: Any, size: int) -> list[Any]:
    data = _to_bytes(obj)
    lengths = torch.empty(size, dtype=torch.int64)
    ctl._allgather_base(lengths, torch.tensor([data.numel()], dtype=torch.int64)).wait()
    width = int(lengths.max())
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[:data.numel()] = data
    out = torch.empty(size * width, dtype=torch.uint8)
    ctl._allgather_base(out, padded).wait()
    return [_from_bytes(out[r * width:r * width + int(n)]) for r, n in enumerate(lengths.tolist())]


def _step_payload(ids: torch.Tensor, start: torch.Tensor, last: torch.Tensor,
                  moves: list[tuple[int, int, int]]) -> torch.Tensor:
    parts = [ids.reshape(-1).cpu(), start.cpu(), last.cpu(), torch.tensor(moves, dtype=torch.int64).reshape(-1)]
    return torch.cat([p.to(torch.int64) for p in parts])


def _split_payload(buf: torch.Tensor, bsz: int, width: int, n_moves: int) -> tuple[Any, ...]:
    ids, start, last, moves = buf.split([bsz * width, bsz, bsz, 3 * n_moves])
    return ids.view(bsz, width), start, last, [tuple(m) for m in moves.view(n_moves, 3).tolist()]


def _groups(store: Any, rank: int, tp: int, device: torch.device) -> tuple[Any, Any]:
    """The server's control (gloo) and tensor-parallel (device's backend) groups."""

    prefix = torch.distributed.PrefixStore
    ctl = store_group(prefix("realscale-server/ctl", store), rank, tp, "gloo", IDLE_TIMEOUT)
    backend = "nccl" if device.type == "cuda" else "gloo"
    comp = store_group(prefix("realscale-server/tp", store), rank, tp, backend, STEP_TIMEOUT)
    return ctl, comp


def _worker_main(port: int, rank: int, tp: int, model_dir: str, dtype: torch.dtype, device: str, max_slots: int,
                 max_len: int, threads: int, timeout_s: float) -> None:
    """Ranks 1..N-1: join the groups, load the shard, then follow rank 0 until told to stop."""

    die_with_parent()
    # Out of the server's process group: Ctrl-C or a launcher's SIGTERM to the group reach
    # rank 0 only, which stops us in order (a worker killed first would look like a failure).
    os.setpgid(0, 0)
    torch.set_num_threads(threads)
    dev = rank_device(device, rank)
    store = torch.distributed.TCPStore("127.0.0.1", port, tp, is_master=False,
                                       timeout=datetime.timedelta(seconds=timeout_s))
    ctl, comp = _groups(store, rank, tp, dev)
    worker, error = None, None
    try:
        worker = RankWorker(model_dir, tp, rank, TPComm(comp), dtype=dtype, device=dev, max_slots=max_slots,
                            max_len=max_len)
    except Exception as exc:  # noqa: BLE001 - reported at rank 0's readiness call
        error = f"{type(exc).__name__}: {exc}"
    _follow(ctl, worker, error, tp)


def follow(ctl: Any, worker: RankWorker, tp: int) -> None:
    """Rank ``1..tp-1`` of a server whose rank 0 runs elsewhere: run its forward passes and
    collective RPCs until it sends a stop (:meth:`ServerRanks.stop_followers`)."""
    _follow(ctl, worker, None, tp)


def _follow(ctl: Any, worker: RankWorker | None, error: str | None, tp: int) -> None:
    while True:
        op, slot0, bsz, width, n_moves, length = _broadcast_header(ctl, None)
        if op == OP_STOP:
            return
        payload = _broadcast_tensor(ctl, None, length, torch.int64 if op == OP_STEP else torch.uint8)
        if op == OP_STEP:
            assert worker is not None, "a step reached a rank that failed to start"
            worker.step(slot0, *_split_payload(payload, bsz, width, n_moves))
        elif op == OP_CALL:
            method, args = _from_bytes(payload)
            _allgather_objects(ctl, _invoke(worker, error, method, args), tp)


# ---------------------------------------------------------------------- rank 0


class ServerRanks:
    """Rank 0's handle on the server's ranks (module docstring). ``forward``,
    ``move_slot`` and ``call_all`` must be called from one thread (the scheduler's)."""

    def __init__(self, model_dir: str, tp: int = 1, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 max_slots: int = 32, max_len: int = 2048, threads: int = 1, timeout_s: float = 300.0) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")

        model_spec(read_hf_config(model_dir), tp, dtype)  # refuse a bad model or tp before spawning
        self._init_state(tp, max_len)
        dev = rank_device(device, 0)
        comp = None
        if tp > 1:
            comp = self._start_workers(model_dir, dtype, device, dev, max_slots, max_len, threads, timeout_s)
        self.worker: RankWorker | None = None
        try:
            self.worker = RankWorker(model_dir, tp, 0, TPComm(comp), dtype=dtype, device=dev, max_slots=max_slots,
                                     max_len=max_len)
        except Exception as exc:  # noqa: BLE001 - the workers must hear of it too
            if tp == 1:
                raise
            self._startup_error = f"{type(exc).__name__}: {exc}"
        if tp > 1:
            self._check_ready()

    def _init_state(self, tp: int, max_len: int) -> None:
        self.tp, self.max_len = tp, max_len
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self.procs: list[Any] = []
        self.ctl: Any = None
        self._moves: list[tuple[int, int, int]] = []
        self._closing = False
        self._startup_error: str | None = None
        self._lock = threading.Lock()
        self._fail_lock = threading.Lock()

    @classmethod
    def of_running(cls, worker: RankWorker, ctl: Any, max_len: int) -> "ServerRanks":
        """Rank 0's handle on ranks that are already running processes of their own (the
        trainer ranks of a colocated run: ranks ``1..tp-1`` call :func:`follow` for a
        generation phase and return at :meth:`stop_followers`). Nothing is spawned or killed."""
        self = cls.__new__(cls)
        self._init_state(worker.tp, max_len)
        self.worker, self.ctl = worker, ctl
        return self

    def _check_ready(self) -> None:
        """Every rank loaded its shard (or the server stops them all and says why not)."""
        try:
            self.call_all("ping")
        except Exception as exc:  # noqa: BLE001 - a rank's load error, or a rank that died
            self.shutdown()
            raise ValueError(f"the server's ranks failed to start: {exc}") from None
        threading.Thread(target=self._watch, name="realscale-rank-watchdog", daemon=True).start()

    def _start_workers(self, model_dir: str, dtype: torch.dtype, device: str, dev: torch.device, max_slots: int,
                       max_len: int, threads: int, timeout_s: float) -> Any:
        """Spawn ranks 1..N-1 and form the groups; returns the tensor-parallel group."""

        timeout = datetime.timedelta(seconds=timeout_s)
        store = torch.distributed.TCPStore("127.0.0.1", 0, self.tp, is_master=True, timeout=timeout,
                                           wait_for_workers=False)
        ctx = mp.get_context("spawn")
        for rank in range(1, self.tp):
            # daemon: an interpreter exit terminates them; die_with_parent covers a kill
            proc = ctx.Process(target=_worker_main, name=f"realscale-tp-rank{rank}", daemon=True,
                               args=(store.port, rank, self.tp, model_dir, dtype, device, max_slots, max_len,
                                     threads, timeout_s))
            proc.start()
            self.procs.append(proc)
        groups = self._while_workers_live(lambda: _groups(store, 0, self.tp, dev), timeout_s)
        self.ctl = groups[0]
        return groups[1]

    def _while_workers_live(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        """``fn()`` (a blocking rendezvous), giving up as soon as a worker dies."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                box["error"] = exc

        thread = threading.Thread(target=run, name="realscale-rank-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            dead = [(r, p) for r, p in enumerate(self.procs, 1) if p.exitcode is not None]
            if dead:
                self.shutdown()
                r, p = dead[0]
                raise ValueError(f"tensor-parallel rank {r} exited (code {p.exitcode}) while the server started; "
                                 "its error is in the output above")
        if "error" in box:
            self.shutdown()
            raise ValueError(f"the server's ranks could not connect within {timeout_s:.0f} s: {box['error']}")
        return box["value"]

    # ------------------------------------------------------------------ the runner interface

    @property
    def device(self) -> torch.device:
        assert self.worker is not None
        return self.worker.device

    @property
    def vocab_size(self) -> int:
        assert self.worker is not None
        return self.worker.weights.arch.vocab_size

    @property
    def has_experts(self) -> bool:
        assert self.worker is not None
        return self.worker.weights.arch.moe is not None

    def last_routing(self) -> torch.Tensor | None:
        """The experts the last forward routed each fed token to, ``[B, T, layers, top_k]``
        (rank 0's: the router is replicated, every rank chooses alike); None for a dense model."""
        assert self.worker is not None
        return self.worker.decoder.last_routing

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Queue a KV-slot move; every rank applies it before the next forward pass."""
        self._moves.append((src, dst, length))

    def forward(self, slot0: int, ids: torch.Tensor, start: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """One forward pass on every rank; the logits ``[B, V]`` (float32) on rank 0."""
        assert self.worker is not None
        if int(start.max()) + ids.shape[1] > self.max_len:
            raise ValueError(f"sequence of {int(start.max()) + ids.shape[1]} tokens exceeds the KV cache length "
                             f"{self.max_len}")
        moves, self._moves = self._moves, []
        if self.tp == 1:
            return self.worker.step(slot0, ids, start, last, moves)
        with self._lock:
            self._check()
            try:
                payload = _step_payload(ids, start, last, moves)
                _broadcast_header(self.ctl, [OP_STEP, slot0, ids.shape[0], ids.shape[1], len(moves), payload.numel()])
                _broadcast_tensor(self.ctl, payload, payload.numel(), torch.int64)
                return self.worker.step(slot0, ids, start, last, moves)
            except BaseException as exc:
                self._collective_failed("a forward pass", exc)
                raise

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """Run ``method`` on every rank (module docstring); results in rank order."""
        if self.tp == 1:
            results = [_invoke(self.worker, None, method, args)]
        else:
            with self._lock:
                self._check()
                payload = _to_bytes((method, args))
                try:
                    _broadcast_header(self.ctl, [OP_CALL, 0, 0, 0, 0, payload.numel()])
                    _broadcast_tensor(self.ctl, payload, payload.numel(), torch.uint8)
                    results = _allgather_objects(self.ctl, _invoke(self.worker, self._startup_error, method, args),
                                                 self.tp)
                except BaseException as exc:
                    self._collective_failed(method, exc)
                    raise
        errors = [f"rank {r}: {value}" for r, (ok, value) in enumerate(results) if not ok]
        if errors:
            raise RankCallError(f"{method}: " + "; ".join(errors))
        return [value for _, value in results]

    # ------------------------------------------------------------------ failure and shutdown

    def pids(self) -> list[int]:
        return [os.getpid(), *(p.pid for p in self.procs)]

    def _check(self) -> None:
        if self.failure is not None:
            raise RankCallError(f"the server's ranks failed: {self.failure}")

    def _fail(self, reason: str) -> None:
        with self._fail_lock:  # the watcher thread and a failed collective can race here
            if self.failure is not None or self._closing:
                return
            self.failure = reason
        log.error("tensor-parallel server: %s", reason)
        if self.on_failure is not None:
            self.on_failure(reason)

    def _dead_rank(self, timeout: float | None) -> str | None:
        """Which follower exited (waiting up to ``timeout`` for one to), as the failure's reason."""
        if not self.procs:  # ranks of_running: not our processes to watch
            return None
        sentinels = {p.sentinel: (r, p) for r, p in enumerate(self.procs, 1)}
        ready = multiprocessing.connection.wait(list(sentinels), timeout)
        if not ready:
            return None
        r, p = sentinels[ready[0]]
        # The sentinel (a pipe) closes as the kernel tears the process down, a moment before it
        # can be reaped: join() alone can return with no exit code yet.
        deadline = time.monotonic() + 5.0
        while p.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"

    def _collective_failed(self, what: str, exc: BaseException) -> None:
        """A collective with the followers failed. Most often a follower died and gloo saw the
        closed socket before the watcher saw the exit: wait a moment for the exit so the
        reason names the dead rank, not gloo's generic message."""
        log.error("tensor-parallel server: %s failed on rank 0 (%s: %s)", what, type(exc).__name__, exc)
        dead = self._dead_rank(timeout=2.0)
        self._fail(dead or f"{what} failed on rank 0 ({type(exc).__name__}: {exc}); the ranks are out of step")

    def _watch(self) -> None:
        reason = self._dead_rank(timeout=None)
        assert reason is not None
        self._fail(reason)

    def alive(self) -> bool:
        return self.failure is None

    def stop_followers(self, grace: float = 10.0) -> None:
        """Tell ranks ``1..tp-1`` to leave their loop (between forward passes)."""
        self._moves.clear()  # KV-slot moves are for the cache the followers are about to drop
        if self.ctl is None or not self._lock.acquire(timeout=grace):
            return
        try:
            _broadcast_header(self.ctl, [OP_STOP, 0, 0, 0, 0, 0])
        finally:
            self._lock.release()

    def shutdown(self, grace: float = 10.0) -> None:
        """Stop the workers (told to, then killed if they linger) and leave rank 0's weight
        groups (their names are free again for a later server in this process)."""
        if self._closing:
            return
        self._closing = True
        if self.worker is not None:
            self.worker.receiver.close()
        if self.failure is None and self.procs:  # (ranks of_running are not ours to stop)
            try:
                self.stop_followers(grace)
            except Exception:  # noqa: BLE001 - a worker already gone; killed below
                pass
        for p in self.procs:
            p.join(grace if self.failure is None else 0.1)
            if p.is_alive():
                p.kill()
                p.join()

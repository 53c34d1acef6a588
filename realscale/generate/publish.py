"""Weight publishing: how a new policy version reaches every generation server.

One object, :class:`WeightPublisher`, whose :meth:`~WeightPublisher.publish` is the
protocol (every trainer rank calls it after the optimizer step, in the same order):

1. **pause** (rank 0): the rollout controller stops submitting; the servers pause in
   ``generate.pause_mode`` (abort: in-flight requests return their partial output and the
   workflow resubmits them; retract / in_place: they wait).
2. **move**: the :class:`WeightTransport` moves the weights; every trainer rank takes
   part (exports and reshards are collectives). The transport tags the new weights with
   the new version on the servers only once all of them have arrived, so no token is
   ever labelled with a version whose weights are half loaded.
3. **version** (rank 0): the controller's staleness accounting moves to the new version.
4. **resume** (rank 0): servers, then the controller.

Transports (how step 2 happens) are chosen by :func:`transport_for` from the config:

- :class:`BroadcastTransport` — SGLang's ``/update_weights_from_distributed``: HF-named
  full tensors gathered to trainer rank 0 and broadcast to every server rank.
- :class:`VllmEngineTransport` — vLLM servers: vLLM's own trainer-side weight-transfer
  engine (``nccl`` on GPUs, realscale's ``gloo`` on CPU: :mod:`realscale.generate.vllm_gloo`)
  over every rank of every server.
- :class:`DiskTransport` — an HF directory on shared storage, then
  ``/update_weights_from_disk`` (vLLM: ``reload_weights``) (the fallback; any server).

Only rank 0 talks to the servers. It does so through a :class:`ServerControl` (the
rollout controller's event loop and its HTTP client); the other ranks get ``None``.
"""

from __future__ import annotations

import abc
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

if TYPE_CHECKING:
    from realscale.config import Config
    from realscale.generate.client import InferenceClient
    from realscale.rollout.controller import RolloutController
    from realscale.train.engine import MegatronEngine


@dataclass(frozen=True)
class ServerEndpoint:
    """One generation server: its URL and how many ranks (tensor-parallel workers) it has.
    Every rank of a server joins the weight groups it is told to join."""

    url: str
    ranks: int = 1


@dataclass
class SyncStats:
    """What one publish moved. ``bytes`` counts every byte that left a trainer rank for a
    server rank (summed over trainer ranks); ``lower_bound`` is what the destinations had
    to receive at least (each server rank's shard, once)."""

    bytes: int = 0
    lower_bound: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        out = {"perf/weight_sync_s": self.seconds, "perf/weight_sync_bytes": float(self.bytes),
               "perf/weight_sync_bytes_lower_bound": float(self.lower_bound)}
        out.update(self.extra)
        return out


Coro = Callable[["InferenceClient"], Awaitable[Any]]


class ServerControl:
    """Rank 0's handle on the servers: the rollout controller's loop and HTTP client."""

    def __init__(self, controller: "RolloutController", servers: list[ServerEndpoint]) -> None:
        self.controller = controller
        self.servers = servers

    def run(self, fn: Coro, timeout: float | None = 600.0) -> Any:
        """``await fn(client)`` on the controller's loop; wait for the result."""
        return self.controller.call(fn, timeout=timeout)

    def submit(self, fn: Coro) -> "Future[Any]":
        """``await fn(client)`` on the controller's loop; return at once (a future)."""
        return self.controller.submit(fn)

    def pause(self, mode: str) -> None:
        self.controller.pause()
        self.run(lambda c: c.pause(mode))

    def resume(self, version: int) -> None:
        self.controller.set_version(version)
        self.run(lambda c: c.resume())
        self.controller.resume()


class WeightTransport(abc.ABC):
    """Moves the trainer's current weights into every server. Every trainer rank holds one
    and calls each method collectively; ``control`` is rank 0's :class:`ServerControl`,
    ``None`` elsewhere."""

    @abc.abstractmethod
    def connect(self, engine: "MegatronEngine", control: ServerControl | None) -> None:
        """Once, before the first :meth:`send` (weight groups, plans)."""

    @abc.abstractmethod
    def send(self, engine: "MegatronEngine", version: int, control: ServerControl | None) -> SyncStats:
        """Move the weights; the servers carry ``version`` once every byte has arrived."""

    def close(self) -> None:
        """Release groups and files."""


def _sum_over_ranks(values: list[int]) -> list[int]:
    """Element-wise sum of small counters over the trainer's ranks (gloo or NCCL)."""
    import torch
    import torch.distributed as dist

    from realscale.parallel.device import to_comm

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = to_comm(torch.tensor(values, dtype=torch.int64), dist.get_backend())
    dist.all_reduce(t)
    return [int(x) for x in t.cpu().tolist()]


def flush_after_update(pause_mode: str) -> bool:
    """Whether a weight update asks the servers to flush their cache. After an ``abort``
    pause nothing holds KV and the prefix cache of the old weights must go; after
    ``retract`` / ``in_place`` requests still wait or hold KV, and the pinned SGLang fails
    an update whose flush it has to refuse (``flush_cache`` defaults to true there)."""
    return pause_mode == "abort"


class BroadcastTransport(WeightTransport):
    """SGLang's protocol (the pinned version's, see :mod:`realscale.generate.weight_sync`):
    rank 0 hosts a weight group of 1 + every rank of every server (server i's tp rank r at
    ``rank_offset_i + r``) and, inside a begin/end update session, broadcasts HF-named full
    tensors bucket by bucket (gathered from the trainer's shards over TP and down the
    pipeline first); the version goes with the last bucket."""

    def __init__(self, backend: str, bucket_bytes: int = 64 << 20, group_name: str = "realscale-weights",
                 pause_mode: str = "abort") -> None:
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.group_name = group_name
        self.flush_cache = flush_after_update(pause_mode)
        self.sender: Any = None

    def connect(self, engine: "MegatronEngine", control: ServerControl | None) -> None:
        if control is None:
            return
        from realscale.generate.weight_sync import WeightSender
        from realscale.launcher import advertise_host
        from realscale.parallel.spawn import free_port

        ranks = {s.url: s.ranks for s in control.servers}
        self.sender = WeightSender(advertise_host(), free_port(), world_size=1 + sum(ranks.values()),
                                   group_name=self.group_name, backend=self.backend)
        control.run(lambda c: c.init_weights_update_group(self.sender, ranks))

    def send(self, engine: "MegatronEngine", version: int, control: ServerControl | None) -> SyncStats:
        buckets = engine.export_hf_weights(bucket_bytes=self.bucket_bytes)
        if control is None:
            for _ in buckets:  # take part in the gathers; only rank 0 sends
                pass
            _sum_over_ranks([0, 0])
            return SyncStats()
        sent = control.run(lambda c: c.update_weights(self.sender, buckets, weight_version=version,
                                                      flush_cache=self.flush_cache))
        receivers = sum(s.ranks for s in control.servers)
        # every server rank receives every tensor whole; the least a server as a whole
        # needs is one full copy (its ranks could split it)
        delivered, bound = _sum_over_ranks([sent * receivers, engine.hf_weight_bytes() * len(control.servers)])
        return SyncStats(bytes=delivered, lower_bound=bound)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


class VllmEngineTransport(WeightTransport):
    """vLLM's weight-transfer protocol, driven by vLLM's own trainer-side engine.

    Every trainer rank builds the engine (``WeightTransferTrainerFactory.trainer_init``) and
    calls ``send_weights`` each step: rank 0 hosts a group of 1 + every worker of every
    server (server *i*'s workers join at ``1 + ranks of servers before it + their rank``)
    and broadcasts HF-named full tensors; the other ranks replay the export (its gathers
    are collectives). The control calls (init, start, update concurrently with the
    broadcast, finish with the new version) go through
    :class:`realscale.generate.vllm_dialect.VllmSyncClient`. ``engine_name`` is ``nccl`` on
    GPUs and ``gloo`` on CPU: the same code path, only the group differs. A server that
    stopped answering is retired by the client and the group rebuilt among the others
    before the next round (a collective with a dead member never completes)."""

    def __init__(self, engine_name: str, bucket_bytes: int = 64 << 20) -> None:
        self.engine_name = engine_name
        self.bucket_bytes = bucket_bytes
        self.source: Any = None
        self.client: Any = None
        self.trainer_engine: Any = None

    def connect(self, engine: "MegatronEngine", control: ServerControl | None) -> None:
        from realscale.generate.vllm_dialect import VllmSyncClient
        from realscale.generate.vllm_plugin import register
        from realscale.generate.vllm_source import MegatronWeightSource

        register()
        self.source = MegatronWeightSource(engine, self.bucket_bytes)
        if control is not None:
            self.client = VllmSyncClient(control, {s.url: s.ranks for s in control.servers})
            self._open(control.run(lambda c: c.update_targets()))
        else:
            self.trainer_engine = self._trainer_init(rank=_rank(), world_size=0, port=0)

    def _trainer_init(self, rank: int, world_size: int, port: int) -> Any:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from realscale.launcher import advertise_host

        info = _trainer_init_info(self.engine_name, rank=rank, master_address=advertise_host(),
                                  master_port=port, world_size=world_size)
        return WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=self.source)

    def _open(self, urls: list[str]) -> None:
        """Rank 0: a new weight group among the servers at ``urls``."""
        from realscale.parallel.spawn import free_port

        self.client.members = list(urls)
        self.trainer_engine = self._trainer_init(rank=0, world_size=self.client.world_size(urls),
                                                 port=free_port())

    def _regroup(self, urls: list[str]) -> None:
        import logging

        logging.getLogger(__name__).warning("vLLM weight group %s -> %s: rebuilding it", self.client.members, urls)
        survivors = [u for u in self.client.members if u in urls]
        self.client.members = survivors
        try:
            self.client.shutdown_weight_transfer_engine()
        except Exception:  # noqa: BLE001 - a survivor that never joined has nothing to shut down
            pass
        self.trainer_engine.shutdown()
        self._open(urls)

    def send(self, engine: "MegatronEngine", version: int, control: ServerControl | None) -> SyncStats:
        if control is not None:
            urls = control.run(lambda c: c.update_targets())
            if urls != self.client.members:
                self._regroup(urls)
            self.client.version = version
        self.trainer_engine.send_weights()
        if control is None:
            _sum_over_ranks([0, 0])
            return SyncStats()
        receivers = self.client.world_size(self.client.members) - 1
        delivered, bound = _sum_over_ranks([self.source.nbytes() * receivers,
                                            engine.hf_weight_bytes() * len(self.client.members)])
        return SyncStats(bytes=delivered, lower_bound=bound)

    def close(self) -> None:
        if self.trainer_engine is not None:
            self.trainer_engine.shutdown()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _trainer_init_info(engine_name: str, *, rank: int, master_address: str, master_port: int,
                       world_size: int) -> Any:
    """vLLM's trainer init info for ``engine_name`` (rank 0 is the sender)."""
    if engine_name == "gloo":
        from realscale.generate.vllm_gloo import GlooTrainerInitInfo

        return GlooTrainerInitInfo(master_address=master_address, master_port=master_port,
                                   world_size=world_size, rank=rank)
    if engine_name == "nccl":  # GPU only; not run on the CPU machine
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(master_address=master_address, master_port=master_port,
                                   world_size=world_size, rank=rank)
    raise ValueError(f"vLLM weight-transfer engine {engine_name!r}: expected 'gloo' (CPU) or 'nccl' (GPU)")


class DiskTransport(WeightTransport):
    """An HF directory per version under ``<run>/weights/``, loaded by every server.
    Only the newest two versions are kept (a server may still be reading the previous
    one when the next is written)."""

    def __init__(self, out_dir: str, keep: int = 2, pause_mode: str = "abort") -> None:
        self.root = os.path.join(out_dir, "weights")
        self.keep = keep
        self.flush_cache = flush_after_update(pause_mode)

    def connect(self, engine: "MegatronEngine", control: ServerControl | None) -> None:
        os.makedirs(self.root, exist_ok=True)

    def send(self, engine: "MegatronEngine", version: int, control: ServerControl | None) -> SyncStats:
        path = os.path.join(self.root, f"v{version}")
        engine.save_hf(path)
        written = 0
        if control is not None:
            control.run(lambda c: c.update_weights_from_disk(path, weight_version=version,
                                                             flush_cache=self.flush_cache))
            written = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
            self._prune(version)
        return SyncStats(bytes=written, lower_bound=written)

    def _prune(self, version: int) -> None:
        import shutil

        for name in os.listdir(self.root):
            if name.startswith("v") and name[1:].isdigit() and int(name[1:]) <= version - self.keep:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)


class WeightPublisher:
    """pause -> move -> version -> resume (the module docstring). Every trainer rank holds
    one; ``control`` only on rank 0."""

    def __init__(self, transport: WeightTransport, control: ServerControl | None, pause_mode: str) -> None:
        self.transport = transport
        self.control = control
        self.pause_mode = pause_mode
        self.connected = False

    def publish(self, engine: "MegatronEngine", version: int) -> dict[str, float]:
        start = time.perf_counter()
        if not self.connected:
            self.transport.connect(engine, self.control)
            self.connected = True
        if self.control is not None:
            self.control.pause(self.pause_mode)
        stats = self.transport.send(engine, version, self.control)
        if self.control is not None:
            self.control.resume(version)
        stats.seconds = time.perf_counter() - start
        return stats.metrics()

    def close(self) -> None:
        self.transport.close()


def transport_for(cfg: "Config", out_dir: str) -> WeightTransport:
    """The transport ``generate.weight_update`` names."""
    from realscale.parallel.device import backend

    if cfg.generate.weight_update == "disk":
        return DiskTransport(out_dir, pause_mode=cfg.generate.pause_mode)
    if cfg.generate.backend == "vllm":
        from realscale.generate.vllm_server import weight_engine

        return VllmEngineTransport(weight_engine(backend(cfg.parallel.backend) == "nccl"))
    return BroadcastTransport(backend(cfg.parallel.backend), pause_mode=cfg.generate.pause_mode)

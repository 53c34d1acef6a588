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
- :class:`DiskTransport` — an HF directory on shared storage, then
  ``/update_weights_from_disk`` (the fallback; any server).

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


class BroadcastTransport(WeightTransport):
    """SGLang's protocol: rank 0 hosts a weight group with every server rank and
    broadcasts HF-named full tensors, bucket by bucket (gathered from the trainer's shards
    over TP and down the pipeline first)."""

    def __init__(self, backend: str, bucket_bytes: int = 64 << 20, group_name: str = "realscale-weights") -> None:
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.group_name = group_name
        self.sender: Any = None

    def connect(self, engine: "MegatronEngine", control: ServerControl | None) -> None:
        if control is None:
            return
        from realscale.generate.weight_sync import WeightSender
        from realscale.launcher import advertise_host
        from realscale.parallel.spawn import free_port

        ranks = sum(s.ranks for s in control.servers)
        self.sender = WeightSender(advertise_host(), free_port(), world_size=ranks + 1,
                                   group_name=self.group_name, backend=self.backend)
        control.run(lambda c: c.init_weights_update_group(self.sender))

    def send(self, engine: "MegatronEngine", version: int, control: ServerControl | None) -> SyncStats:
        buckets = engine.export_hf_weights(bucket_bytes=self.bucket_bytes)
        if control is None:
            for _ in buckets:  # take part in the gathers; only rank 0 sends
                pass
            _sum_over_ranks([0, 0])
            return SyncStats()
        sent = control.run(lambda c: c.update_weights(self.sender, buckets, weight_version=version))
        receivers = sum(s.ranks for s in control.servers)
        # every server rank receives every tensor whole; the least a server as a whole
        # needs is one full copy (its ranks could split it)
        delivered, bound = _sum_over_ranks([sent * receivers, engine.hf_weight_bytes() * len(control.servers)])
        return SyncStats(bytes=delivered, lower_bound=bound)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


class DiskTransport(WeightTransport):
    """An HF directory per version under ``<run>/weights/``, loaded by every server.
    Only the newest two versions are kept (a server may still be reading the previous
    one when the next is written)."""

    def __init__(self, out_dir: str, keep: int = 2) -> None:
        self.root = os.path.join(out_dir, "weights")
        self.keep = keep

    def connect(self, engine: "MegatronEngine", control: ServerControl | None) -> None:
        os.makedirs(self.root, exist_ok=True)

    def send(self, engine: "MegatronEngine", version: int, control: ServerControl | None) -> SyncStats:
        path = os.path.join(self.root, f"v{version}")
        engine.save_hf(path)
        written = 0
        if control is not None:
            control.run(lambda c: c.update_weights_from_disk(path, weight_version=version))
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
        return DiskTransport(out_dir)
    return BroadcastTransport(backend(cfg.parallel.backend))

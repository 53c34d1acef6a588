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

- :class:`ReshardTransport` — the embedded servers: one *weight world* (every trainer
  rank and every server rank, :mod:`realscale.parallel.weight_world`), and each step the
  resharder moves each server rank exactly its Megatron-layout shard, straight from the
  trainer ranks that hold it (no funnel through rank 0; on GPUs device to device).
- :class:`BroadcastTransport` — SGLang's ``/update_weights_from_distributed``: HF-named
  full tensors gathered to trainer rank 0 and broadcast to every server rank.
- :class:`VllmEngineTransport` — vLLM servers: vLLM's own trainer-side weight-transfer
  engine (``nccl`` on GPUs, realscale's ``gloo`` on CPU: :mod:`realscale.generate.vllm_gloo`)
  over every rank of every server.
- :class:`DiskTransport` — an HF directory on shared storage, then
  ``/update_weights_from_disk`` (vLLM: ``reload_weights``) (the fallback; any server).

Only rank 0 talks to the servers. It does so through a :class:`ServerControl` (its own
HTTP client and event loop, and the rollout controller's pause / version / resume); the
other ranks get ``None``.
"""

from __future__ import annotations

import abc
import asyncio
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

if TYPE_CHECKING:
    from realscale.config import Config
    from realscale.generate.client import InferenceClient
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


class RolloutSide(Protocol):
    """What server control needs of the rollout controller (in its own process or not:
    :mod:`realscale.rollout.process`)."""

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def set_version(self, version: int) -> None: ...
    def retire(self, urls: list[str]) -> None: ...


class ServerControl:
    """Rank 0's handle on the servers: an HTTP client of its own, on an event loop of its
    own (a thread of rank 0, busy only while a weight update runs), and the rollout
    controller's pause / version / resume. The controller generates with its own client
    (in its own process): ``fn(client)`` coroutines here never cross a process boundary,
    so a transport may pass them live objects (a weight sender, a bucket iterator whose
    exports are collectives of the trainer ranks). Servers a weight update retires (they
    did not answer) are handed to the controller before generation resumes."""

    def __init__(self, rollouts: RolloutSide, servers: list[ServerEndpoint],
                 client: Callable[[], "InferenceClient"]) -> None:
        self.rollouts = rollouts
        self.servers = servers
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="server-control", daemon=True)
        self._thread.start()
        self.client = client()
        self._on_loop(self.client.start()).result(60.0)

    def _on_loop(self, coro: Awaitable[Any]) -> "Future[Any]":
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, fn: Coro, timeout: float | None = 600.0) -> Any:
        """``await fn(client)`` on the control loop; wait for the result."""
        return self.submit(fn).result(timeout)

    def submit(self, fn: Coro) -> "Future[Any]":
        """``await fn(client)`` on the control loop; return at once (a future)."""
        return self._on_loop(_await(fn, self.client))

    def pause(self, mode: str) -> None:
        self.rollouts.pause()
        self.run(lambda c: c.pause(mode))

    def resume(self, version: int) -> None:
        retired = [s.url for s in self.client.servers if s.retired]
        if retired:
            self.rollouts.retire(retired)
        self.rollouts.set_version(version)
        self.run(lambda c: c.resume())
        self.rollouts.resume()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._on_loop(self.client.close()).result(30.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30.0)
            if not self._thread.is_alive():
                self._loop.close()


async def _await(fn: Coro, client: "InferenceClient") -> Any:
    return await fn(client)


class _NoRollouts:
    """The rollout side of a :class:`ClientControl`: there is none."""

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def set_version(self, version: int) -> None: ...
    def retire(self, urls: list[str]) -> None: ...


class ClientControl(ServerControl):
    """A :class:`ServerControl` with no rollout controller: an
    :class:`~realscale.generate.client.InferenceClient` on a loop thread of its own
    (benchmarks and tests drive transports through it exactly as the trainer does)."""

    def __init__(self, servers: list[ServerEndpoint], request_timeout: float = 600.0) -> None:
        from realscale.generate.client import InferenceClient

        urls = [s.url for s in servers]
        super().__init__(_NoRollouts(), servers, lambda: InferenceClient(urls, request_timeout=request_timeout))


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


def sum_over_ranks(values: list[int]) -> list[int]:
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
            sum_over_ranks([0, 0])
            return SyncStats()
        sent = control.run(lambda c: c.update_weights(self.sender, buckets, weight_version=version,
                                                      flush_cache=self.flush_cache))
        receivers = sum(s.ranks for s in control.servers)
        # every server rank receives every tensor whole; the least a server as a whole
        # needs is one full copy (its ranks could split it)
        delivered, bound = sum_over_ranks([sent * receivers, engine.hf_weight_bytes() * len(control.servers)])
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
            sum_over_ranks([0, 0])
            return SyncStats()
        receivers = self.client.world_size(self.client.members) - 1
        delivered, bound = sum_over_ranks([self.source.nbytes() * receivers,
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

    Storage stays bounded: once every server has loaded version v (the update returned
    success from each of them; a server that did not answer was retired and never loads
    again), every older version is deleted. So at most two versions are on disk, and two
    only while the newer one is being written and loaded."""

    def __init__(self, out_dir: str, pause_mode: str = "abort") -> None:
        self.root = os.path.join(out_dir, "weights")
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
            self.prune_before(version)
        return SyncStats(bytes=written, lower_bound=written)

    def prune_before(self, version: int) -> list[str]:
        """Delete every version older than ``version`` (all servers hold ``version``)."""
        import shutil

        deleted = []
        for name in os.listdir(self.root):
            if name.startswith("v") and name[1:].isdigit() and int(name[1:]) < version:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
                deleted.append(name)
        return deleted


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
        if self.control is not None:
            self.control.close()


class ReshardTransport(WeightTransport):
    """The resharder over the weight world (trainer ranks ``[0, T)`` + server ranks).

    Each ``send``: (1) rank 0 asks which servers are alive (a dead one is retired); on the
    first step, or when that set changed, it hosts a new world's store (OS-picked port),
    has every server check the world (``/realscale/join_weight_world`` with
    ``check_only``), and every trainer rank learns the world
    (:class:`~realscale.parallel.weight_world.WorldSpec`); then the servers join over HTTP
    (every server rank at ``rank_offset + tp_rank``) while every trainer rank joins, and
    all compute the same plan from the two layouts. (2) Each trainer rank packs its
    Megatron shards into its flat source buffer. (3) Rank 0 asks the servers to receive
    (``/realscale/update_weights_reshard``) while every trainer rank sends its part. A
    server carries the new version only once all its ranks have every byte; ``bytes``
    is what the server ranks report receiving.
    """

    def __init__(self, backend: str, bucket_bytes: int = 64 << 20, timeout_s: float = 600.0) -> None:
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.member: Any = None  # realscale.parallel.weight_world.WorldMember
        self.members: list[str] = []  # server URLs of the current world, in rank order
        self.spec: Any = None
        self.src_buf: Any = None
        self.store: Any = None  # rank 0: the weight world's TCPStore
        self.rebuilds = 0
        self.sent_bytes = 0  # what this trainer rank sent in the last send
        self.received: dict[str, list[int]] = {}  # rank 0: bytes each server rank reported receiving, by URL

    def connect(self, engine: "MegatronEngine", control: ServerControl | None) -> None:
        from realscale.parallel.model_spec import spec_from_hf_config

        itemsize = engine.config.params_dtype.itemsize
        self.spec = spec_from_hf_config(engine.hf_config, itemsize=itemsize)
        check_megatron_order(engine)

    def send(self, engine: "MegatronEngine", version: int, control: ServerControl | None) -> SyncStats:
        import torch.distributed as dist

        from realscale.models.convert import local_params
        from realscale.parallel.weight_world import pack_megatron

        world = self._agree_on_world(engine, control)
        if world is not None:
            self._join(world, control)
        src, _ = self.member.world.layouts()
        pack_megatron(local_params(engine.model), self.spec, src, dist.get_rank(), self.src_buf)
        pending = None
        if control is not None:
            body = {"name": self.member.world.name, "weight_version": str(version)}
            pending = control.submit(lambda c: c.post_each("/realscale/update_weights_reshard",
                                                           {u: body for u in self.members}))
        self.sent_bytes = self.member.send(self.src_buf).send_bytes
        if pending is None:
            return SyncStats()
        replies = pending.result(timeout=self.timeout_s)
        self.received = {u: list(r["recv_bytes"]) for u, r in replies.items()}
        delivered = sum(sum(r) for r in self.received.values())
        return SyncStats(bytes=delivered, lower_bound=self.member.lower_bound_bytes(),
                         extra={"perf/weight_sync_rebuilds": float(self.rebuilds)})

    def _agree_on_world(self, engine: "MegatronEngine", control: ServerControl | None) -> Any:
        """Rank 0 decides whether the servers of the world changed (first step, or a server
        died); every trainer rank gets the new world, or None when nothing changed."""
        import torch.distributed as dist

        from realscale.parallel.weight_world import WorldSpec, host_store, spec_digest

        holder: list[Any] = [None]
        if control is not None:
            alive = control.run(lambda c: c.weight_targets())
            if self.member is None or alive != self.members:
                from realscale.launcher import advertise_host

                ranks = {s.url: s.ranks for s in control.servers}
                r = engine.ranks
                self.rebuilds += self.member is not None
                n = r.dp * r.tp * r.pp + sum(ranks[u] for u in alive)
                self.store = host_store(advertise_host(), n, self.timeout_s)
                world = WorldSpec(advertise_host(), self.store.port, f"realscale-weights-{self.rebuilds}",
                                  self.backend, f"d{r.dp}t{r.tp}p{r.pp}", [ranks[u] for u in alive],
                                  str(engine.config.params_dtype).removeprefix("torch."), spec_digest(self.spec),
                                  self.bucket_bytes, self.timeout_s)
                # every server validates the world first: a mismatch is an error, not a hang
                control.run(lambda c: c.post_each("/realscale/join_weight_world", _join_bodies(world, alive, True)))
                holder[0] = (alive, world)
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(holder, src=0)
        if holder[0] is None:
            return None
        self.members = list(holder[0][0])
        return holder[0][1]

    def _join(self, world: Any, control: ServerControl | None) -> None:
        """Leave the old world; rank 0 asks every server to join the new one while every
        trainer rank joins it (building the group blocks until all have)."""
        import torch.distributed as dist

        from realscale.parallel.device import comm_empty
        from realscale.parallel.weight_world import WorldMember

        if self.member is not None:
            self.member.close()
        pending = None
        if control is not None:
            bodies = _join_bodies(world, self.members, False)
            pending = control.submit(lambda c: c.post_each("/realscale/join_weight_world", bodies))
        try:
            self.member = WorldMember(world, dist.get_rank(), self.spec, self.store if control is not None else None)
        finally:
            if pending is not None:
                pending.result(timeout=self.timeout_s)  # a server's refusal surfaces here
        n = self.member.resharder.src_idx.numel
        self.src_buf = comm_empty(n, self.member.dtype, world.backend)

    def close(self) -> None:
        if self.member is not None:
            self.member.close()
            self.member = None


def _join_bodies(world: Any, urls: list[str], check_only: bool) -> dict[str, dict[str, Any]]:
    """``/realscale/join_weight_world`` bodies: server i joins at its rank offset."""
    return {u: {"world": world.to_json(), "rank_offset": world.server_offset(i), "check_only": check_only}
            for i, u in enumerate(urls)}


def check_megatron_order(engine: "MegatronEngine") -> None:
    """The weight world numbers trainer ranks in Megatron's order (tp fastest, then dp,
    then pp): the global rank must be that, or the plan would read the wrong shards."""
    import torch.distributed as dist

    r = engine.ranks
    expected = r.pp_rank * r.tp * r.dp + r.dp_rank * r.tp + r.tp_rank
    if dist.get_rank() != expected:
        raise RuntimeError(f"trainer rank {dist.get_rank()} is (dp={r.dp_rank}, tp={r.tp_rank}, pp={r.pp_rank}), "
                           f"which Megatron's tp-dp-pp order numbers {expected}; the weight world needs that order")


def transport_for(cfg: "Config", out_dir: str) -> WeightTransport:
    """The transport ``generate.weight_update`` names: disk, or ``distributed`` = the
    reshard transport for embedded servers, vLLM's engine for vLLM, SGLang's broadcast for SGLang."""
    from realscale.parallel.device import backend

    if cfg.generate.weight_update == "disk":
        return DiskTransport(out_dir, pause_mode=cfg.generate.pause_mode)
    if cfg.generate.backend == "embedded":
        return ReshardTransport(backend(cfg.parallel.backend))
    if cfg.generate.backend == "vllm":
        from realscale.generate.vllm_server import weight_engine

        return VllmEngineTransport(weight_engine(backend(cfg.parallel.backend) == "nccl"))
    return BroadcastTransport(backend(cfg.parallel.backend), pause_mode=cfg.generate.pause_mode)

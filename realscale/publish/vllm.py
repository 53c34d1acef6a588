"""vLLM servers: vLLM's own trainer-side weight-transfer engine (broadcast: ``nccl`` on
GPUs, realscale's ``gloo`` twin on CPU; shard to shard: ``nccl_m2n`` on GPUs, realscale's
``gloo_m2n`` twin on CPU), driven through :class:`VllmSyncClient`."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from realscale.inference.vllm_plugin import register
from realscale.parallel.net import advertise_host, free_port
from realscale.publish.control import ServerControl
from realscale.publish.transport import RESENDS, SyncStats, WeightTransport, _rank, any_over_ranks, sum_over_ranks

if TYPE_CHECKING:
    from realscale.inference.client import InferenceClient
    from realscale.train.engine import MegatronEngine


class VllmSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol (four synchronous calls) over every live
    vLLM server, through rank 0's :class:`ServerControl` (the rollout controller's HTTP
    client, so dead servers are retired as for any other update).

    vLLM's trainer engines build one worker init info with ``rank_offset = 1`` (the
    trainer is rank 0); with several servers, server *i*'s workers start after the ranks
    of servers ``0..i-1``, so its offset is ``1 + sum(ranks before it)``: every worker
    joins at ``rank_offset + its rank`` as the multi-rank interface says.
    """

    def __init__(self, control: "ServerControl", timeout: float = 600.0) -> None:
        self.control = control
        self.members: list[str] = []  # servers of the current weight group, in rank order
        self.version: Any = None  # set by the transport before each round
        self.timeout = timeout
        self.trainer_ranks = 1  # ranks of the group before the workers (m2n: every trainer rank)

    @property
    def ranks(self) -> dict[str, int]:
        """url -> ranks (tp x pp) of that server, restarted ones included (read each time)."""
        return {s.url: s.ranks for s in self.control.servers}

    def world_size(self, urls: list[str]) -> int:
        return self.trainer_ranks + sum(self.ranks[u] for u in urls)

    def destination_mesh(self, urls: list[str]) -> tuple[int, int]:
        """The workers as vLLM's m2n destination mesh (axis 0 replicates, axis 1 shards:
        ``m2n_common.py:33-36``): one row per server when they all have the same ranks (a
        server's tp ranks shard), else one flat replicated axis."""
        sizes = {self.ranks[u] for u in urls}
        return (len(urls), sizes.pop()) if len(sizes) == 1 else (sum(self.ranks[u] for u in urls), 1)

    def _fan_out(self, path: str, body_of: Any) -> None:
        async def go(client: InferenceClient) -> None:
            await asyncio.gather(*(client.post(u, path, body_of(i, u), timeout=self.timeout)
                                   for i, u in enumerate(self.members)))

        self.control.run(go, timeout=self.timeout)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        offsets, first = {}, int(init_info["rank_offset"])
        for u in self.members:
            offsets[u] = first
            first += self.ranks[u]
        if "src_mesh_dims" not in init_info:  # broadcast engines: each server's own offset
            body = lambda i, u: {"init_info": {**init_info, "rank_offset": offsets[u]}}
        elif len(self.members) == 1:  # m2n, one server: vLLM's protocol exactly
            body = lambda i, u: {"init_info": init_info}
        else:  # m2n: rank_offset is where the destination mesh starts; gloo_m2n's extension places each server
            body = lambda i, u: {"init_info": {**init_info, "first_worker_rank": offsets[u]}}
        self._fan_out("/init_weight_transfer_engine", body)

    def start_weight_update(self) -> None:
        self._fan_out("/start_weight_update", lambda i, u: {})

    def update_weights(self, update_info: Any) -> None:
        self._fan_out("/update_weights", lambda i, u: {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.version
        body = {"weight_version": str(version)} if version is not None else {}
        self._fan_out("/finish_weight_update", lambda i, u: body)

    def shutdown_weight_transfer_engine(self) -> None:
        self._fan_out("/shutdown_weight_transfer_engine", lambda i, u: None)

    def close_failed_update(self, urls: list[str]) -> None:
        """End the update session a failed round left open on ``urls``: vLLM refuses to
        leave a weight group during one (``gpu_worker.py:1500``, "Cannot release a trainer
        connection during a weight update") and to start the next (``:1534``). Finished
        without a version, the server keeps its last version's tag until the resend; one
        whose session the failure already closed (``update_weights`` resets it on error,
        ``:1581``) refuses, which is what it should do."""
        async def go(client: InferenceClient) -> None:
            await asyncio.gather(*(client.post(u, "/finish_weight_update", {}, timeout=self.timeout) for u in urls),
                                 return_exceptions=True)

        self.control.run(go, timeout=self.timeout)


class VllmEngineTransport(WeightTransport):
    """vLLM's weight-transfer protocol, driven by vLLM's own trainer-side engine.

    Every trainer rank builds the engine (``WeightTransferTrainerFactory.trainer_init``) and
    calls ``send_weights`` each step. Broadcast engines (``nccl`` on GPUs, ``gloo`` on CPU):
    rank 0 hosts a group of 1 + every worker of every server (server *i*'s workers join at
    ``1 + ranks of servers before it + their rank``) and broadcasts HF-named full tensors;
    the other ranks replay the export (its gathers are collectives). Shard-to-shard engines
    (``nccl_m2n`` / ``gloo_m2n``, ``generate.vllm_weight_engine=m2n``): every trainer rank
    joins a group of T + every worker and sends its local shards
    (:class:`realscale.publish.vllm_source.MegatronShardSource`); rank 0 tells the others
    where the group is. The control calls (init, start, update concurrently with the
    sends, finish with the new version) go through
    :class:`realscale.publish.vllm.VllmSyncClient`. A server that stopped answering is
    retired by the client and the group rebuilt among the others before the next round
    (a collective with a dead member never completes); one lost during a round costs a
    resend of that round (:meth:`_send_once`)."""

    def __init__(self, engine_name: str, bucket_bytes: int = 64 << 20) -> None:
        self.engine_name = engine_name
        self.m2n = engine_name.endswith("_m2n")
        self.bucket_bytes = bucket_bytes
        self.source: Any = None
        self.client: VllmSyncClient | None = None
        self.trainer_engine: Any = None
        self.trainer_ranks = 1

    def connect(self, engine: "MegatronEngine", control: ServerControl | None) -> None:
        from realscale.publish.vllm_source import MegatronShardSource, MegatronWeightSource

        register()
        if self.m2n:
            if self.engine_name == "nccl_m2n" and engine.ranks.pp > 1:
                raise ValueError("vLLM's nccl_m2n describes every parameter over one trainer mesh of all ranks "
                                 "(vllm/distributed/weight_transfer/m2n_engine.py:204-211), which a pipeline "
                                 f"stage's parameters are not (pp={engine.ranks.pp}): use "
                                 "generate.vllm_weight_engine=broadcast with pipeline parallelism on GPUs")
            self.source = MegatronShardSource(engine)
            self.trainer_ranks = _world()
        else:
            self.source = MegatronWeightSource(engine, self.bucket_bytes)
        if control is not None:
            self.client = VllmSyncClient(control)
            self.client.trainer_ranks = self.trainer_ranks
            self._open(control.run(lambda c: c.update_targets()))
        elif self.m2n:
            self._join(_share(None))
        else:
            self.trainer_engine = self._trainer_init(rank=_rank(), world_size=0, port=0)

    def _trainer_init(self, rank: int, world_size: int, port: int, address: str | None = None,
                      dst_mesh: tuple[int, int] | None = None) -> Any:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        info = _trainer_init_info(self.engine_name, rank=rank, master_address=address or advertise_host(),
                                  master_port=port, world_size=world_size, num_trainer_ranks=self.trainer_ranks,
                                  dst_mesh_dims=dst_mesh)
        return WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=self.source)

    def _open(self, urls: list[str]) -> None:
        """Rank 0: a new weight group among the servers at ``urls`` (m2n: the other trainer
        ranks are told where, and join it too)."""

        self.client.members = list(urls)
        group = {"world_size": self.client.world_size(urls), "port": free_port(), "address": advertise_host(),
                 "dst_mesh": self.client.destination_mesh(urls) if self.m2n else None}
        if self.m2n:
            _share(group)
            self._join(group)
        else:
            self.trainer_engine = self._trainer_init(rank=0, world_size=group["world_size"], port=group["port"])

    def _join(self, group: dict[str, Any]) -> None:
        self.trainer_engine = self._trainer_init(rank=_rank(), world_size=group["world_size"], port=group["port"],
                                                 address=group["address"], dst_mesh=tuple(group["dst_mesh"]))

    def _regroup(self, urls: list[str]) -> None:
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
        """The round; sent again (to the survivors, in a rebuilt group) when servers die
        during it (:data:`~realscale.publish.transport.RESENDS`)."""
        for attempt in range(RESENDS + 1):
            if not self._send_once(version, control, last=attempt == RESENDS):
                break
        if self.m2n:
            delivered, bound = sum_over_ranks([self.trainer_engine.bytes_sent,
                                                self.trainer_engine.lower_bound_bytes() if control is not None else 0])
            return SyncStats(bytes=delivered, lower_bound=bound)
        if control is None:
            sum_over_ranks([0, 0])
            return SyncStats()
        receivers = self.client.world_size(self.client.members) - 1
        delivered, bound = sum_over_ranks([self.source.nbytes() * receivers,
                                            engine.hf_weight_bytes() * len(self.client.members)])
        return SyncStats(bytes=delivered, lower_bound=bound)

    def _send_once(self, version: int, control: ServerControl | None, last: bool) -> bool:
        """One round; whether it must be sent again. A round that fails on some rank (on
        gloo a sender errors within a second of a member's death, the survivors once the
        failed rank has left the group) is sent again when rank 0 finds servers gone since
        it began; any other failure is raised on every rank (after each has finished its
        export, whose gathers run in step). On NCCL the survivors would wait in the
        collective until its timeout instead (not run on GPUs)."""
        self._prepare(version, control)
        self.source.begin_round()
        failed: Exception | None = None
        try:
            self.trainer_engine.send_weights()
        except Exception as exc:  # noqa: BLE001 - judged below: a server gone, or a real error
            failed = exc
            # leave the broken group at once: a survivor's workers wait in their receive
            # until every peer they wait on has closed its end (then gloo errors at once)
            self.trainer_engine.shutdown()
            self.source.finish_round()
        if not any_over_ranks(failed is not None):
            return False
        lost = None
        if control is not None:
            live = control.run(lambda c: c.update_targets())
            lost = live != self.client.members
            self.client.close_failed_update([u for u in self.client.members if u in live])
        if not _share(lost) or last:
            raise failed or RuntimeError("another trainer rank's vLLM weight send failed (its log says why)")
        if control is not None:
            logging.getLogger(__name__).warning("vLLM weight update %s failed (%r): servers went away; sending it "
                                                "again to the others", version, failed or "on another trainer rank")
        return True

    def _prepare(self, version: int, control: ServerControl | None) -> None:
        """The group for this round: rebuilt among the live servers when they changed."""
        if control is not None:
            urls = control.run(lambda c: c.update_targets())
            changed = urls != self.client.members
            if self.m2n:
                _share(changed)
            if changed:
                self._regroup(urls)
            self.client.version = version
        elif self.m2n and _share(None):  # rank 0 rebuilds the group: join the new one
            self.trainer_engine.shutdown()
            self._join(_share(None))

    def close(self) -> None:
        """The servers leave the weight group too (a next trainer on them starts clean),
        then each rank's engine shuts down."""
        if self.client is not None and self.client.members:
            try:
                self.client.shutdown_weight_transfer_engine()
            except Exception as exc:  # noqa: BLE001 - closing: a server may be gone already
                logging.getLogger(__name__).warning("vLLM servers did not shut their weight transfer down: %r", exc)
        if self.trainer_engine is not None:
            self.trainer_engine.shutdown()


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _share(value: Any) -> Any:
    """Rank 0's ``value`` on every trainer rank (m2n: where the group is, whether it is rebuilt)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _trainer_init_info(engine_name: str, *, rank: int, master_address: str, master_port: int,
                       world_size: int, num_trainer_ranks: int = 1, dst_mesh_dims: tuple[int, int] | None = None) -> Any:
    """vLLM's trainer init info for ``engine_name`` (broadcast: rank 0 is the sender; m2n:
    every trainer rank is in the group, ``[0, num_trainer_ranks)``)."""
    if engine_name == "gloo":
        from realscale.inference.vllm_gloo import GlooTrainerInitInfo

        return GlooTrainerInitInfo(master_address=master_address, master_port=master_port,
                                   world_size=world_size, rank=rank)
    if engine_name == "nccl":  # GPU only; not run on the CPU machine
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(master_address=master_address, master_port=master_port,
                                   world_size=world_size, rank=rank)
    if engine_name in ("gloo_m2n", "nccl_m2n"):
        if engine_name == "gloo_m2n":
            from realscale.inference.vllm_m2n import GlooM2NTrainerInitInfo as Info
        else:  # GPU only (NVIDIA's nccl-extensions); not run on the CPU machine
            from vllm.distributed.weight_transfer.m2n_trainer import M2NTrainerInitInfo as Info
        return Info(master_address=master_address, master_port=master_port, world_size=world_size, rank=rank,
                    num_trainer_ranks=num_trainer_ranks, dst_mesh_dims=dst_mesh_dims)
    raise ValueError(f"vLLM weight-transfer engine {engine_name!r}: expected gloo or gloo_m2n (CPU), "
                     "nccl or nccl_m2n (GPU)")

"""vLLM servers: vLLM's own trainer-side weight-transfer engine (``nccl`` on GPUs,
realscale's ``gloo`` twin on CPU), driven through :class:`VllmSyncClient`."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from realscale.inference.vllm_plugin import register
from realscale.parallel.net import advertise_host, free_port
from realscale.publish.control import ServerControl
from realscale.publish.transport import SyncStats, WeightTransport, _rank, sum_over_ranks

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

    @property
    def ranks(self) -> dict[str, int]:
        """url -> ranks (tp x pp) of that server, restarted ones included (read each time)."""
        return {s.url: s.ranks for s in self.control.servers}

    def world_size(self, urls: list[str]) -> int:
        return 1 + sum(self.ranks[u] for u in urls)

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
        self._fan_out("/init_weight_transfer_engine",
                      lambda i, u: {"init_info": {**init_info, "rank_offset": offsets[u]}})

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


class VllmEngineTransport(WeightTransport):
    """vLLM's weight-transfer protocol, driven by vLLM's own trainer-side engine.

    Every trainer rank builds the engine (``WeightTransferTrainerFactory.trainer_init``) and
    calls ``send_weights`` each step: rank 0 hosts a group of 1 + every worker of every
    server (server *i*'s workers join at ``1 + ranks of servers before it + their rank``)
    and broadcasts HF-named full tensors; the other ranks replay the export (its gathers
    are collectives). The control calls (init, start, update concurrently with the
    broadcast, finish with the new version) go through
    :class:`realscale.publish.vllm.VllmSyncClient`. ``engine_name`` is ``nccl`` on
    GPUs and ``gloo`` on CPU: the same code path, only the group differs. A server that
    stopped answering is retired by the client and the group rebuilt among the others
    before the next round (a collective with a dead member never completes)."""

    def __init__(self, engine_name: str, bucket_bytes: int = 64 << 20) -> None:
        self.engine_name = engine_name
        self.bucket_bytes = bucket_bytes
        self.source: Any = None
        self.client: VllmSyncClient | None = None
        self.trainer_engine: Any = None

    def connect(self, engine: "MegatronEngine", control: ServerControl | None) -> None:
        from realscale.publish.vllm_source import MegatronWeightSource

        register()
        self.source = MegatronWeightSource(engine, self.bucket_bytes)
        if control is not None:
            self.client = VllmSyncClient(control)
            self._open(control.run(lambda c: c.update_targets()))
        else:
            self.trainer_engine = self._trainer_init(rank=_rank(), world_size=0, port=0)

    def _trainer_init(self, rank: int, world_size: int, port: int) -> Any:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        info = _trainer_init_info(self.engine_name, rank=rank, master_address=advertise_host(),
                                  master_port=port, world_size=world_size)
        return WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=self.source)

    def _open(self, urls: list[str]) -> None:
        """Rank 0: a new weight group among the servers at ``urls``."""

        self.client.members = list(urls)
        self.trainer_engine = self._trainer_init(rank=0, world_size=self.client.world_size(urls),
                                                 port=free_port())

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
        """The servers leave the weight group too (a next trainer on them starts clean),
        then rank 0's engine shuts down."""
        if self.client is not None and self.client.members:
            try:
                self.client.shutdown_weight_transfer_engine()
            except Exception as exc:  # noqa: BLE001 - closing: a server may be gone already
                logging.getLogger(__name__).warning("vLLM servers did not shut their weight transfer down: %r", exc)
        if self.trainer_engine is not None:
            self.trainer_engine.shutdown()


def _trainer_init_info(engine_name: str, *, rank: int, master_address: str, master_port: int,
                       world_size: int) -> Any:
    """vLLM's trainer init info for ``engine_name`` (rank 0 is the sender)."""
    if engine_name == "gloo":
        from realscale.inference.vllm_gloo import GlooTrainerInitInfo

        return GlooTrainerInitInfo(master_address=master_address, master_port=master_port,
                                   world_size=world_size, rank=rank)
    if engine_name == "nccl":  # GPU only; not run on the CPU machine
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(master_address=master_address, master_port=master_port,
                                   world_size=world_size, rank=rank)
    raise ValueError(f"vLLM weight-transfer engine {engine_name!r}: expected 'gloo' (CPU) or 'nccl' (GPU)")

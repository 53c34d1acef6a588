"""Embedded servers: the resharder over the weight world moves each server rank exactly its
Megatron-layout shard, straight from the trainer ranks that hold it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from realscale.models.convert import local_params
from realscale.parallel.device import comm_empty
from realscale.parallel.model_spec import spec_from_hf_config
from realscale.parallel.net import advertise_host
from realscale.publish.control import ServerControl
from realscale.publish.transport import RESENDS, SyncStats, WeightTransport, any_over_ranks
from realscale.publish.weight_world import WorldMember, WorldSpec, host_store, pack_megatron, spec_digest

if TYPE_CHECKING:
    from realscale.train.engine import MegatronEngine

log = logging.getLogger(__name__)


class _Lost(RuntimeError):
    """Servers went away during a send: try again in a world without them."""


class ReshardTransport(WeightTransport):
    """The resharder over the weight world (trainer ranks ``[0, T)`` + server ranks).

    Each ``send``: (1) rank 0 asks which servers are alive (a dead one is retired); on the
    first step, or when that set changed, it hosts a new world's store (OS-picked port),
    has every server check the world (``/realscale/join_weight_world`` with
    ``check_only``), and every trainer rank learns the world
    (:class:`~realscale.publish.weight_world.WorldSpec`); then the servers join over HTTP
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
        self.member: Any = None  # realscale.publish.weight_world.WorldMember
        self.members: list[str] = []  # server URLs of the current world, in rank order
        self.spec: Any = None
        self.src_buf: Any = None
        self.store: Any = None  # rank 0: the weight world's TCPStore
        self.rebuilds = 0
        self.sent_bytes = 0  # what this trainer rank sent in the last send
        self.received: dict[str, list[int]] = {}  # rank 0: bytes each server rank reported receiving, by URL

    def connect(self, engine: "MegatronEngine", control: ServerControl | None) -> None:
        itemsize = engine.config.params_dtype.itemsize
        self.spec = spec_from_hf_config(engine.hf_config, itemsize=itemsize)
        check_megatron_order(engine)

    def send(self, engine: "MegatronEngine", version: int, control: ServerControl | None) -> SyncStats:
        """One update; sent again in a rebuilt world when servers die during it
        (:data:`~realscale.publish.transport.RESENDS`: every trainer rank learns whether a
        send failed anywhere, rank 0 retires the servers that are gone, all rebuild)."""
        for attempt in range(RESENDS + 1):
            try:
                return self._send_once(engine, version, control)
            except _Lost as lost:
                if attempt == RESENDS:
                    raise RuntimeError(f"weight update: servers kept failing mid-transfer ({lost})") from lost
        raise AssertionError("not reached")

    def _send_once(self, engine: "MegatronEngine", version: int, control: ServerControl | None) -> SyncStats:
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
        failure: BaseException | None = None
        try:
            self.sent_bytes = self.member.send(self.src_buf).send_bytes
        except RuntimeError as exc:  # a peer of the world went away (gloo: "Connection closed by peer")
            failure = exc
        replies = None
        if pending is not None:
            try:
                replies = pending.result(timeout=self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - judged below: a server gone, or a real error
                failure = failure or exc
        self._after_failure(failure, control)
        if pending is None:
            return SyncStats()
        self.received = {u: list(r["recv_bytes"]) for u, r in replies.items()}
        delivered = sum(sum(r) for r in self.received.values())
        return SyncStats(bytes=delivered, lower_bound=self.member.lower_bound_bytes(),
                         extra={"perf/weight_sync_rebuilds": float(self.rebuilds)})

    def _after_failure(self, failure: BaseException | None, control: ServerControl | None) -> None:
        """Every rank learns whether a send failed anywhere. Then rank 0 retires the servers
        that are gone; if none is, the failure is a real error (raised on rank 0; the others
        stop with the run). Else all leave this world (rebuilt at the next try)."""
        if not any_over_ranks(failure is not None):
            return
        gone: list[str] = []
        if control is not None:
            gone = control.run(lambda c: c.retire_dead(list(self.members)))
        if not any_over_ranks(bool(gone)):  # no server is gone: a real error, on every rank
            if failure is not None:
                raise failure
            raise RuntimeError("weight update failed on another trainer rank (its log says why)")
        log.warning("weight world %s: servers %s went away mid-transfer; sending again to the others",
                    self.member.world.name, gone or "(rank 0 knows)")
        self.member.close()
        self.member, self.members = None, []
        self.rebuilds += 1
        raise _Lost(gone)

    def _agree_on_world(self, engine: "MegatronEngine", control: ServerControl | None) -> Any:
        """Rank 0 decides whether the servers of the world changed (first step, or a server
        died); every trainer rank gets the new world, or None when nothing changed."""

        holder: list[Any] = [None]
        if control is not None:
            alive = control.run(lambda c: c.weight_targets())
            if self.member is None or alive != self.members:
                ranks = {s.url: s.ranks for s in control.servers}
                r = engine.ranks
                self.rebuilds += self.member is not None
                n = r.strategy.world + sum(ranks[u] for u in alive)
                self.store = host_store(advertise_host(), n, self.timeout_s)
                world = WorldSpec(advertise_host(), self.store.port, f"realscale-weights-{self.rebuilds}",
                                  self.backend, str(r.strategy), [ranks[u] for u in alive],
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

    r = engine.ranks
    expected = r.world_rank()
    if dist.get_rank() != expected:
        raise RuntimeError(f"trainer rank {dist.get_rank()} is (dp={r.dp_rank}, tp={r.tp_rank}, pp={r.pp_rank}), "
                           f"which Megatron's tp-dp-pp order numbers {expected}; the weight world needs that order")

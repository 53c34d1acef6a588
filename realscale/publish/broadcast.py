"""SGLang's weight-update protocol: a broadcast group from trainer rank 0 to every server
rank (:class:`BroadcastTransport`), or with a pipelined trainer one group per pipeline
stage, each stage sending its own part (:class:`StageBroadcastTransport`)."""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from realscale.inference.client import ServerLost
from realscale.inference.weight_sync import RemoteSender, WeightPart, WeightSender, send_overlapped
from realscale.parallel.net import advertise_host, free_port
from realscale.publish.control import ServerControl
from realscale.publish.transport import (RESENDS, SyncStats, WeightTransport, any_over_ranks, flush_after_update,
                                        sum_over_ranks)

if TYPE_CHECKING:
    from realscale.train.engine import MegatronEngine

log = logging.getLogger(__name__)


class BroadcastTransport(WeightTransport):
    """SGLang's protocol (the pinned version's, see :mod:`realscale.inference.weight_sync`):
    rank 0 hosts a weight group of 1 + every rank of every server (server i's tp rank r at
    ``rank_offset_i + r``) and, inside a begin/end update session, broadcasts HF-named full
    tensors bucket by bucket (gathered from the trainer's shards over TP); the version goes
    with the last bucket. A pipelined trainer sends each stage's part from that stage
    (:class:`StageBroadcastTransport`, chosen at :meth:`connect`)."""

    def __init__(self, backend: str, bucket_bytes: int = 64 << 20, group_name: str = "realscale-weights",
                 pause_mode: str = "abort", per_stage: bool = True) -> None:
        self.backend = backend
        self.per_stage = per_stage  # False: every stage's tensors through rank 0 (benchmarks compare)
        self.bucket_bytes = bucket_bytes
        self.group_name = group_name
        self.flush_cache = flush_after_update(pause_mode)
        self.sender: WeightSender | None = None
        self.control: ServerControl | None = None
        self.staged: StageBroadcastTransport | None = None  # a pipelined trainer's
        self.count: int | None = None  # buckets per update (rank 0's export; others yield none)

    def connect(self, engine: "MegatronEngine", control: ServerControl | None) -> None:
        if engine.ec.pp > 1 and self.per_stage:  # no funnel: each stage sends its own part
            self.staged = StageBroadcastTransport(self.backend, self.bucket_bytes, self.group_name,
                                                  flush_cache=self.flush_cache)
            self.staged.connect(engine, control)
            return
        # how many buckets an update has (a collective pass; names and shapes never change),
        # so each next bucket is exported while one is on the wire
        self.count = sum(1 for _ in engine.export_hf_weights(bucket_bytes=self.bucket_bytes))
        if control is None:
            return
        self.control = control

        ranks = {s.url: s.ranks for s in control.servers}
        self.sender = WeightSender(advertise_host(), free_port(), world_size=1 + sum(ranks.values()),
                                   group_name=self.group_name, backend=self.backend)
        control.run(lambda c: c.init_weights_update_group(self.sender, ranks))

    def send(self, engine: "MegatronEngine", version: int, control: ServerControl | None) -> SyncStats:
        """The update; sent again (to the survivors, in a rebuilt group) when servers die
        during it (:data:`~realscale.publish.transport.RESENDS`): every trainer rank learns
        whether rank 0 lost servers, and all export again together."""
        if self.staged is not None:
            return self.staged.send(engine, version, control)
        for attempt in range(RESENDS + 1):
            sent, lost = self._send_once(engine, version, control, last=attempt == RESENDS)
            if not any_over_ranks(lost):
                break
        if control is None:
            sum_over_ranks([0, 0])
            return SyncStats()
        receivers = sum(s.ranks for s in control.servers)
        # every server rank receives every tensor whole; the least a server as a whole
        # needs is one full copy (its ranks could split it)
        delivered, bound = sum_over_ranks([sent * receivers, engine.hf_weight_bytes() * len(control.servers)])
        return SyncStats(bytes=delivered, lower_bound=bound)

    def _send_once(self, engine: "MegatronEngine", version: int, control: ServerControl | None,
                   last: bool) -> tuple[int, bool]:
        """(bytes sent, whether servers went away mid-way). Rank 0 then still drains the
        export, whose gathers the other ranks run in step."""
        buckets = engine.export_hf_weights(bucket_bytes=self.bucket_bytes)
        if control is None:
            _drain(buckets)  # take part in the gathers; only rank 0 sends
            return 0, False
        try:
            return control.run(lambda c: c.update_weights(self.sender, buckets, weight_version=version,
                                                          flush_cache=self.flush_cache, count=self.count)), False
        except ServerLost as exc:
            if last:
                raise
            log.warning("%s; sending the update again to the others", exc)
            _drain(buckets)
            return 0, True

    def close(self) -> None:
        """Servers leave the group first (SGLang keeps a group until told and refuses its
        name again: a next trainer on the same servers could not join), then rank 0 drops it."""
        if self.staged is not None:
            self.staged.close()
        if self.sender is None:
            return
        sender = self.sender
        if self.control is not None:
            try:
                self.control.run(lambda c: c.destroy_weights_update_group(sender))
            except Exception as exc:  # noqa: BLE001 - closing: the servers may be gone already
                log.warning("servers did not leave the weight-update group: %r", exc)
        sender.close()
        self.sender = None


class StageBroadcastTransport(WeightTransport):
    """SGLang's protocol from a pipelined trainer without a funnel through rank 0: each
    pipeline stage's first rank (tp and dp rank 0, the *leader*) hosts a weight group of
    its own (``<group_name>-stage<s>``: the leader + every rank of every server) and
    broadcasts the HF-named tensors its stage holds, gathered over TP only; nothing goes
    down the pipeline (:func:`realscale.models.convert.iter_hf_tensors`, ``stage_local``).

    Rank 0 still speaks to the servers. A server runs one update call at a time (the
    pinned SGLang holds one lock around each, ``tokenizer_control_mixin.py``
    ``update_weights_from_distributed``), and a broadcast needs every server of its group
    inside the matching receive, so the stages' groups are joined and their buckets posted
    one stage after another, in the same order at every server, inside one
    ``/begin_weight_update`` … ``/end_weight_update`` session; rank 0 tells each leader
    over the trainer's store when its part begins (or that it will not come, after a
    failure before it). Each leader exports its next bucket while the current one is on
    the wire. The version and the flush ride on the last stage's last bucket.

    Membership (the live servers, restarted ones included) is rank 0's; every trainer
    rank learns it before each round, and when it changed every leader hosts a new group
    on a new port and the servers leave the old ones and join the new ones. A server
    lost mid-update costs a resend to the others (:data:`RESENDS`), as for
    :class:`BroadcastTransport`."""

    WAIT_S = 3600.0  # a leader waits this long for its part's turn (the stages before it)

    def __init__(self, backend: str, bucket_bytes: int = 64 << 20, group_name: str = "realscale-weights",
                 flush_cache: bool = True, timeout_s: float = 600.0) -> None:
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.group_name = group_name
        self.flush_cache = flush_cache
        self.timeout_s = timeout_s
        self.sender: WeightSender | None = None  # leaders
        self.remotes: dict[int, RemoteSender] = {}  # rank 0: the other stages' groups
        self.metas: dict[int, list[list[tuple[str, torch.dtype, tuple[int, ...]]]]] = {}  # rank 0
        self.members: list[str] = []
        self.receivers = 0
        self.control: ServerControl | None = None
        self.stage, self.leader, self.rounds = 0, False, 0

    def _name(self, stage: int) -> str:
        return f"{self.group_name}-stage{stage}"

    def _turn_key(self, stage: int) -> str:
        """The store key on which rank 0 tells ``stage``'s leader whether its part of this
        round is sent (every rank counts the rounds alike)."""
        return f"realscale/stage-broadcast/{self.group_name}/{self.rounds}/stage{stage}"

    def connect(self, engine: "MegatronEngine", control: ServerControl | None) -> None:
        groups = engine.export_groups()
        self.stage, self.leader, self.control = groups.pp_rank, groups.is_sender_column, control
        # what each stage sends, bucket by bucket (names and shapes never change in a run):
        # rank 0 posts every stage's bucket metadata while the leaders broadcast the data
        mine = [[(n, t.dtype, tuple(t.shape)) for n, t in b]
                for b in engine.export_hf_weights(bucket_bytes=self.bucket_bytes, stage_local=True)]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (self.stage, mine) if self.leader else None)
        self.metas = {s: m for s, m in (x for x in everyone if x is not None)}
        self._sync_members(force=True)

    def _sync_members(self, force: bool = False) -> None:
        """Every rank: rank 0's live servers; new groups when they changed (or ``force``)."""
        box: list[Any] = [None]
        if self.control is not None:
            urls = self.control.run(lambda c: c.update_targets())
            ranks = {s.url: s.ranks for s in self.control.servers}
            box = [[(u, ranks[u]) for u in urls]]
        dist.broadcast_object_list(box, src=0)
        members = dict(box[0])
        if list(members) == self.members and not force:
            return
        leaving = [u for u in self.members if u in members]
        self.members, self.receivers = list(members), sum(members.values())
        world = 1 + self.receivers
        if self.leader:
            if self.sender is not None:
                self.sender.close()
            self.sender = WeightSender(advertise_host(), free_port(), world_size=world,
                                       group_name=self._name(self.stage), backend=self.backend)
        hosts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, (self.stage, self.sender.master_address, self.sender.master_port)
                               if self.leader else None)
        if self.control is not None:
            store = dist.distributed_c10d._get_default_store()
            self.remotes = {s: RemoteSender(addr, port, world, self._name(s), self.backend, store)
                            for s, addr, port in sorted(h for h in hosts if h is not None) if s != 0}
            senders = [self.sender, *self.remotes.values()]
            self.control.run(lambda c: c.join_groups(senders, members, leaving=leaving),
                             timeout=self.timeout_s * len(senders))
        elif self.leader:
            self.sender.connect(self.timeout_s)

    def send(self, engine: "MegatronEngine", version: int, control: ServerControl | None) -> SyncStats:
        lost = False
        for attempt in range(RESENDS + 1):
            self._sync_members(force=lost)  # after a loss every group is rebuilt (some were dropped)
            sent, lost_here = self._send_once(engine, version, last=attempt == RESENDS)
            lost = any_over_ranks(lost_here)
            if not lost:
                break
        delivered, bound = sum_over_ranks([sent * self.receivers,
                                           engine.hf_weight_bytes() * len(self.members) if control else 0])
        return SyncStats(bytes=delivered, lower_bound=bound)

    def _send_once(self, engine: "MegatronEngine", version: int, last: bool) -> tuple[int, bool]:
        """(bytes this rank sent, whether servers went away mid-way). Every rank exports
        its stage to the end (the TP gathers run in step)."""
        self.rounds += 1
        key = self._turn_key(self.stage)
        buckets = engine.export_hf_weights(bucket_bytes=self.bucket_bytes, stage_local=True)
        if self.control is not None:
            return self._drive(buckets, version, last)
        if not self.leader:
            _drain(buckets)
            return 0, False
        store = dist.distributed_c10d._get_default_store()
        store.wait([key], datetime.timedelta(seconds=self.WAIT_S))
        go = store.get(key) == b"go"
        store.delete_key(key)
        if not go:  # the update failed before this stage's turn
            _drain(buckets)
            return 0, True
        try:
            return send_overlapped(buckets, self.sender.broadcast_bucket), False
        except Exception as exc:  # noqa: BLE001 - a server went away mid-broadcast: every rank resends
            log.warning("stage %d's weight broadcast failed (%r); the update is sent again", self.stage, exc)
            self.sender.close()  # the survivors' receives fail now, not at the group's timeout
            _drain(buckets)
            return 0, True

    def _drive(self, buckets: Any, version: int, last: bool) -> tuple[int, bool]:
        """Rank 0: the session over every stage's group; its own stage's buckets it sends."""
        parts = [WeightPart(self.sender, buckets, len(self.metas[0]))]
        for stage, remote in self.remotes.items():
            remote.key, remote.started = self._turn_key(stage), False
            parts.append(WeightPart(remote, _meta_buckets(self.metas[stage]), len(self.metas[stage])))
        try:
            return self.control.run(lambda c: c.update_weights_in_parts(parts, self.members, weight_version=version,
                                                                        flush_cache=self.flush_cache)), False
        except BaseException as exc:
            for remote in self.remotes.values():  # leaders whose turn never came stop waiting
                remote.signal(False)
            if not isinstance(exc, ServerLost) or last:
                raise
            log.warning("%s; sending the update again to the others", exc)
            _drain(buckets)
            return 0, True

    def close(self) -> None:
        """Servers leave every stage's group, then each leader drops its own."""
        if self.control is not None and self.members:
            senders = [self.sender, *self.remotes.values()]
            try:
                self.control.run(lambda c: c.leave_groups(senders, self.members))
            except Exception as exc:  # noqa: BLE001 - closing: the servers may be gone already
                log.warning("servers did not leave the weight-update groups: %r", exc)
        if self.sender is not None:
            self.sender.close()
            self.sender = None


def _meta_buckets(meta: list[list[tuple[str, "torch.dtype", tuple[int, ...]]]]) -> list[list[tuple[str, Any]]]:
    """Buckets of shape-only tensors (``meta`` device: no memory) for the requests of a
    stage whose data another rank sends."""
    return [[(n, torch.empty(shape, dtype=dtype, device="meta")) for n, dtype, shape in b] for b in meta]


def _drain(buckets: Any) -> None:
    """Run an export to its end without sending (its collectives keep every rank in step)."""
    for _ in buckets:
        pass

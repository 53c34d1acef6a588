"""SGLang's weight-update protocol: a broadcast group from trainer rank 0 to every server rank."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from realscale.inference.client import ServerLost
from realscale.inference.weight_sync import WeightSender
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
    tensors bucket by bucket (gathered from the trainer's shards over TP and down the
    pipeline first); the version goes with the last bucket."""

    def __init__(self, backend: str, bucket_bytes: int = 64 << 20, group_name: str = "realscale-weights",
                 pause_mode: str = "abort") -> None:
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.group_name = group_name
        self.flush_cache = flush_after_update(pause_mode)
        self.sender: WeightSender | None = None
        self.control: ServerControl | None = None

    def connect(self, engine: "MegatronEngine", control: ServerControl | None) -> None:
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
            for _ in buckets:  # take part in the gathers; only rank 0 sends
                pass
            return 0, False
        try:
            return control.run(lambda c: c.update_weights(self.sender, buckets, weight_version=version,
                                                          flush_cache=self.flush_cache)), False
        except ServerLost as exc:
            if last:
                raise
            log.warning("%s; sending the update again to the others", exc)
            for _ in buckets:
                pass
            return 0, True

    def close(self) -> None:
        """Servers leave the group first (SGLang keeps a group until told and refuses its
        name again: a next trainer on the same servers could not join), then rank 0 drops it."""
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

"""What every weight transport is: :class:`WeightTransport` (connect, send, close, called
collectively by every trainer rank) and what one send moved (:class:`SyncStats`)."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from realscale.parallel.device import to_comm
from realscale.publish.control import ServerControl

if TYPE_CHECKING:
    from realscale.train.engine import MegatronEngine



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

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = to_comm(torch.tensor(values, dtype=torch.int64), dist.get_backend())
    dist.all_reduce(t)
    return [int(x) for x in t.cpu().tolist()]


# Sends of one update after servers went away mid-way (each time to the survivors, in a
# group or world rebuilt without the dead): a death during a transfer costs a resend, not
# the run. A failure that kills no server is raised at once.
RESENDS = 2


def any_over_ranks(flag: bool) -> bool:
    """Whether ``flag`` holds on some trainer rank (every rank learns the same answer)."""
    return sum_over_ranks([int(flag)])[0] > 0


def flush_after_update(pause_mode: str) -> bool:
    """Whether a weight update asks the servers to flush their cache. After an ``abort``
    pause nothing holds KV and the prefix cache of the old weights must go. After
    ``in_place`` running requests hold KV, and the pinned SGLang fails an update whose
    flush it has to refuse (``flush_cache`` defaults to true there); after ``retract`` it
    would flush (a paused scheduler ignores its waiting queue), but there is nothing to
    flush: the launcher turns the prefix cache off for both (``sglang_command``)."""
    return pause_mode == "abort"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0

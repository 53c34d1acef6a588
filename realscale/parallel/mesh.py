"""Device meshes, (dp, tp, pp) strategies, and layouts (a strategy placed on a mesh).

A **mesh** is a contiguous range of global GPU ids ``[start, start + size)`` on a cluster
of ``nodes x gpus_per_node`` GPUs. It is either a run of whole nodes, or an aligned
power-of-two slice of one node (1, 2, 4 ... GPUs starting at a multiple of the slice
size). These are the meshes ReaL (arXiv 2406.14088, section 4) searches over; the
restriction keeps tensor-parallel groups inside NVLink domains and keeps the search space
small enough to enumerate.

A **strategy** is ``(dp, tp, pp)``. Ranks inside a mesh follow Megatron-core's default
order ``"tp-cp-ep-dp-pp"`` (megatron/core/parallel_state.py, ``RankGenerator``): tensor
parallel is the fastest-varying index, then data parallel, then pipeline parallel. So
local rank ``i`` has ``tp = i % tp``, ``dp = (i // tp) % dp``, ``pp = i // (tp * dp)``.

Every refusal raises :class:`LayoutError` with a sentence naming what was wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

from realscale.errors import UserError


class LayoutError(UserError):
    """A mesh, strategy or layout that cannot be used; the message says why."""


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class Cluster:
    """``nodes`` machines with ``gpus_per_node`` GPUs each; GPU ``g`` lives on node ``g // gpus_per_node``."""

    nodes: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise LayoutError(f"cluster: nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 1:
            raise LayoutError(f"cluster: gpus_per_node must be >= 1, got {self.gpus_per_node}")

    @property
    def n_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def meshes(self) -> Iterator["Mesh"]:
        """Every valid mesh: aligned power-of-two slices of each node, then runs of whole nodes."""
        g = self.gpus_per_node
        for node in range(self.nodes):
            size = 1
            while size < g:
                if g % size == 0:
                    for off in range(0, g, size):
                        yield Mesh(node * g + off, size)
                size *= 2
        for first in range(self.nodes):
            for count in range(1, self.nodes - first + 1):
                yield Mesh(first * g, count * g)


@dataclass(frozen=True)
class Mesh:
    """GPUs ``[start, start + size)`` (global ids)."""

    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def gpus(self) -> range:
        return range(self.start, self.end)

    def overlaps(self, other: "Mesh") -> bool:
        return self.start < other.end and other.start < self.end

    def check(self, cluster: Cluster) -> None:
        """Raise :class:`LayoutError` unless this mesh is whole nodes or an aligned slice of one."""
        g = cluster.gpus_per_node
        if self.size < 1 or self.start < 0:
            raise LayoutError(f"mesh {self}: start must be >= 0 and size >= 1")
        if self.end > cluster.n_gpus:
            raise LayoutError(f"mesh {self}: ends at GPU {self.end} but the cluster has {cluster.n_gpus} GPUs")
        if self.size >= g:
            if self.start % g or self.size % g:
                raise LayoutError(f"mesh {self}: a mesh of {self.size} GPUs must be whole nodes "
                                  f"(start and size multiples of {g} GPUs per node)")
        else:
            if not _is_pow2(self.size) or self.start % self.size:
                raise LayoutError(f"mesh {self}: a sub-node mesh must be a power-of-two slice aligned to its "
                                  f"size (got {self.size} GPUs at offset {self.start % g} of a node)")

    def nodes(self, cluster: Cluster) -> int:
        """How many nodes this mesh touches."""
        return cluster.node_of(self.end - 1) - cluster.node_of(self.start) + 1

    def __str__(self) -> str:
        return f"gpus[{self.start}:{self.end}]"


@dataclass(frozen=True)
class Strategy:
    """``dp x tp x pp`` ranks; Megatron order (tp fastest, then dp, then pp).

    ``ep``: expert parallelism of a mixture-of-experts model, carved out of dp as Megatron
    does (expert ranks ordered tp, ep, dp, pp): the rank at data-parallel coordinate ``d``
    holds the experts of expert-parallel rank ``d % ep``, each split over tp like a dense
    MLP. It changes who holds which experts, not the number of ranks."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"strategy: {name} must be a positive integer, got {value!r}")
        if self.dp % self.ep:
            raise LayoutError(f"strategy: ep={self.ep} must divide dp={self.dp} (experts are spread over "
                              "data-parallel ranks)")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def coords(self, local_rank: int) -> tuple[int, int, int]:
        """``(dp, tp, pp)`` coordinates of a local rank (Megatron's "tp-cp-ep-dp-pp" order)."""
        if not 0 <= local_rank < self.world:
            raise LayoutError(f"strategy {self}: local rank {local_rank} outside [0, {self.world})")
        return (local_rank // self.tp) % self.dp, local_rank % self.tp, local_rank // (self.tp * self.dp)

    def local_rank(self, dp: int, tp: int, pp: int) -> int:
        return pp * self.tp * self.dp + dp * self.tp + tp

    def ep_rank(self, dp: int) -> int:
        """The expert-parallel rank of data-parallel coordinate ``dp``."""
        return dp % self.ep

    def __str__(self) -> str:
        # AReaL's notation (d<dp>t<tp>p<pp>) so plans read like its published configs; e<ep> when experts are split
        return f"d{self.dp}t{self.tp}p{self.pp}" + (f"e{self.ep}" if self.ep > 1 else "")

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        """``"d4t2p1"`` (any order of d/t/p/e, missing letters mean 1) -> Strategy."""

        parts = re.findall(r"([dtpe])(\d+)", text)
        if not parts or "".join(a + b for a, b in parts) != text.replace(" ", ""):
            raise LayoutError(f"strategy {text!r}: expected e.g. 'd4t2p1' (d=data, t=tensor, p=pipeline parallel; "
                              "e=expert parallel, within d)")
        vals = {"d": 1, "t": 1, "p": 1, "e": 1}
        for key, num in parts:
            vals[key] = int(num)
        return cls(dp=vals["d"], tp=vals["t"], pp=vals["p"], ep=vals["e"])


def even_partition(n_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage, as even as possible, earlier stages taking the remainder last
    (Megatron refuses uneven splits unless told; we allow them, see :class:`Layout`)."""
    if pp > n_layers:
        raise LayoutError(f"pp={pp} is more than the model's {n_layers} layers: some stage would be empty")
    base, extra = divmod(n_layers, pp)
    return tuple(base + (1 if s >= pp - extra else 0) for s in range(pp))


@dataclass(frozen=True)
class Layout:
    """A strategy placed on a mesh, with the pipeline partition (layers per stage)."""

    mesh: Mesh
    strategy: Strategy
    partition: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.mesh.size != self.strategy.world:
            raise LayoutError(f"layout {self.strategy} on {self.mesh}: the strategy needs {self.strategy.world} "
                              f"GPUs but the mesh has {self.mesh.size}")
        if self.partition is not None:
            if len(self.partition) != self.strategy.pp:
                raise LayoutError(f"layout {self.strategy}: partition {list(self.partition)} has "
                                  f"{len(self.partition)} stages, expected pp={self.strategy.pp}")
            if any(n < 1 for n in self.partition):
                raise LayoutError(f"layout {self.strategy}: partition {list(self.partition)} has an empty stage")

    def stages(self, n_layers: int) -> tuple[int, ...]:
        """Layers per pipeline stage (the explicit partition, else an even one)."""
        if self.partition is None:
            return even_partition(n_layers, self.strategy.pp)
        if sum(self.partition) != n_layers:
            raise LayoutError(f"layout {self.strategy}: partition {list(self.partition)} covers "
                              f"{sum(self.partition)} layers, the model has {n_layers}")
        return self.partition

    def gpu(self, local_rank: int) -> int:
        return self.mesh.start + local_rank

    def coords_of_gpu(self, gpu: int) -> tuple[int, int, int] | None:
        """``(dp, tp, pp)`` of the rank on ``gpu``, or None when the GPU is not in the mesh."""
        if gpu not in self.mesh.gpus:
            return None
        return self.strategy.coords(gpu - self.mesh.start)

    def check(self, cluster: Cluster) -> None:
        """Mesh validity plus: a tensor-parallel group must stay inside one node (NVLink)."""
        self.mesh.check(cluster)
        tp = self.strategy.tp
        if tp > cluster.gpus_per_node:
            raise LayoutError(f"layout {self.strategy} on {self.mesh}: tp={tp} spans more than one node "
                              f"({cluster.gpus_per_node} GPUs per node); tensor parallelism needs NVLink")
        if (self.mesh.start % cluster.gpus_per_node) % tp or cluster.gpus_per_node % tp:
            raise LayoutError(f"layout {self.strategy} on {self.mesh}: tp={tp} groups would straddle a node "
                              f"boundary ({cluster.gpus_per_node} GPUs per node)")

    def __str__(self) -> str:
        part = "" if self.partition is None else f" stages={list(self.partition)}"
        return f"{self.strategy}@{self.mesh}{part}"

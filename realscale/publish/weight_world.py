"""The weight world: every trainer rank and every generation-server rank in one process
group, so the resharder can move each slice of the new weights straight from a trainer
rank that holds it to the server ranks that need it.

Ranks: ``[0, T)`` are the trainer ranks (world rank = trainer rank, Megatron order: tp
fastest, then dp, then pp), ``[T, T + S)`` the server ranks; server ``i``'s tensor-parallel
rank ``k`` is ``T + offset_i + k`` (``offset_i`` = ranks of the servers before it). So the
resharder's source layout is the trainer's strategy on mesh ``[0, T)`` and its destination
layout ``dp = servers, tp = ranks per server, pp = 1`` on mesh ``[T, T + S)``
(:meth:`WorldSpec.layouts`), with weight-world ranks as its "GPU" ids.

How the group is built: trainer rank 0 hosts a ``TCPStore``; every member builds a
``ProcessGroupGloo`` (``ProcessGroupNCCL`` on GPUs) from it under the world's name, never
through ``init_process_group`` (the trainer ranks already have their default group, the
servers may have theirs). The resharder's broadcasts run on sub-groups made from the same
store under a prefix naming their members, by the members only (unlike ``new_group`` on a
default group, non-members take no part). Members create their sub-groups in one global
order (sorted member tuples), which cannot deadlock: the smallest sub-group not yet made
has every member waiting at it.

:class:`WorldSpec` is everything a member needs to join and to compute the same plan
(rank 0 sends it to the servers as JSON); :class:`StoreGroup` is the group as the
resharder uses it (:class:`realscale.parallel.reshard_exec.Comm`). :func:`pack_megatron`
writes a trainer rank's local Megatron parameter shards into its flat source buffer.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from realscale.parallel.device import comm_empty, store_group
from realscale.parallel.mesh import Layout, LayoutError, Mesh, Strategy

if TYPE_CHECKING:
    import torch

    from realscale.parallel.model_spec import ModelSpec


def spec_digest(spec: "ModelSpec") -> str:
    """A short fingerprint of a spec (names, full shapes, sharding, stages): both ends of a
    weight world must plan with the same one. The element size is not part of it: the
    world moves the trainer's dtype and a server of another dtype casts on arrival."""
    text = json.dumps([[t.name, list(t.shape), t.split_dim, t.layer, t.also_last] for t in spec.tensors]
                      + [spec.n_layers])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class WorldSpec:
    """One weight world: where its store is, who is in it, and what moves through it."""

    master_address: str
    master_port: int
    name: str  # store prefix; a rebuilt world gets a new name (and port)
    backend: str  # gloo | nccl
    trainer: str  # the trainer's strategy, e.g. "d1t2p2"
    servers: list[int] = field(default_factory=list)  # ranks of each server, in server order
    dtype: str = "float32"
    spec_digest: str = ""
    bucket_bytes: int = 64 << 20
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.servers or any(r < 1 for r in self.servers):
            raise LayoutError(f"weight world: servers must be a non-empty list of positive rank counts, got {self.servers}")
        if len(set(self.servers)) != 1:
            raise LayoutError(f"weight world: every server must have the same number of ranks, got {self.servers}")
        if self.backend not in ("gloo", "nccl"):
            raise LayoutError(f"weight world: backend {self.backend!r} is not one of 'gloo', 'nccl'")

    @property
    def trainer_ranks(self) -> int:
        return Strategy.parse(self.trainer).world

    @property
    def server_ranks(self) -> int:
        return sum(self.servers)

    @property
    def world_size(self) -> int:
        return self.trainer_ranks + self.server_ranks

    def server_offset(self, i: int) -> int:
        """World rank of server ``i``'s first rank (its ``rank_offset``)."""
        return self.trainer_ranks + sum(self.servers[:i])

    def layouts(self) -> tuple[Layout, Layout]:
        """(trainer layout on ``[0, T)``, servers' layout on ``[T, T + S)``)."""
        src = Strategy.parse(self.trainer)
        dst = Strategy(dp=len(self.servers), tp=self.servers[0], pp=1)
        return Layout(Mesh(0, src.world), src), Layout(Mesh(src.world, dst.world), dst)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "WorldSpec":
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise LayoutError(f"weight world: unknown fields {unknown}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise LayoutError(f"weight world: {exc}") from None


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise LayoutError(f"weight world: {name!r} is not a torch dtype")
    return value


def host_store(address: str, world_size: int, timeout_s: float) -> Any:
    """Rank 0's ``TCPStore`` on a port the OS picks (``.port``; no race for a free port);
    it does not wait for the others here, :class:`StoreGroup` does."""
    import torch.distributed as dist

    return dist.TCPStore(address, 0, world_size, True, datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class StoreGroup:
    """This process's membership of a weight world (see the module docstring).

    Building it blocks until every member of the world has joined. Rank 0 passes the
    store it hosts (:func:`host_store`, whose port is ``world.master_port``).
    """

    def __init__(self, world: WorldSpec, rank: int, store: Any = None) -> None:
        import torch.distributed as dist

        if not 0 <= rank < world.world_size:
            raise LayoutError(f"weight world {world.name}: rank {rank} outside [0, {world.world_size})")
        if (store is not None) != (rank == 0):
            raise LayoutError(f"weight world {world.name}: rank 0, and only rank 0, hosts the store")
        self.world, self.rank, self.size = world, rank, world.world_size
        self.backend = world.backend
        self.timeout = datetime.timedelta(seconds=world.timeout_s)
        if store is None:
            store = dist.TCPStore(world.master_address, world.master_port, world.world_size, is_master=False,
                                  timeout=self.timeout)
        self.store = store
        self.pg = store_group(dist.PrefixStore(f"{world.name}/all/", self.store), rank, self.size, self.backend,
                              self.timeout)
        self.subgroups: dict[tuple[int, ...], Any] = {}

    # -------------------------------------------------- the resharder's Comm
    def prepare(self, member_sets: list[tuple[int, ...]]) -> None:
        """Make the broadcast sub-groups this rank belongs to (see the module docstring)."""
        import torch.distributed as dist

        for members in sorted(set(member_sets)):
            if self.rank in members and members not in self.subgroups:
                key = "-".join(str(m) for m in members)
                store = dist.PrefixStore(f"{self.world.name}/bcast/{key}/", self.store)
                self.subgroups[members] = store_group(store, members.index(self.rank), len(members), self.backend,
                                                      self.timeout)

    def isend(self, buf: "torch.Tensor", peer: int) -> Any:
        return self.pg.send([buf], peer, 0)

    def irecv(self, buf: "torch.Tensor", peer: int) -> Any:
        return self.pg.recv([buf], peer, 0)

    def broadcast(self, buf: "torch.Tensor", root: int, members: tuple[int, ...]) -> Any:
        return self.subgroups[members].broadcast(buf, members.index(root))

    def barrier(self) -> None:
        """Every member of the world got here (a tiny all-reduce: works on gloo and NCCL)."""

        t = comm_empty(1, _int64(), self.backend).zero_()
        self.pg.allreduce([t]).wait()

    def close(self) -> None:
        self.subgroups.clear()
        self.pg = None
        self.store = None


def _int64() -> Any:
    import torch

    return torch.int64


# ----------------------------------------------------------------------------- trainer side


def _spec_name(name: str, spec_names: set[str]) -> str:
    """The spec name of a local Megatron parameter (global layer index already applied).
    A tied output layer on the last pipeline stage is Megatron's copy of the embedding."""
    if name == "output_layer.weight" and name not in spec_names:
        return "embedding.word_embeddings.weight"
    return name


def pack_megatron(params: dict[str, "torch.Tensor"], spec: "ModelSpec", layout: Layout, gpu: int,
                  out: "torch.Tensor") -> "torch.Tensor":
    """Write this rank's Megatron parameter shards into ``out`` in ``shard_index`` order.

    ``params``: local parameters by global name
    (:func:`realscale.models.convert.local_params`). Every entry of the shard must be
    filled exactly once and every local parameter must have its place, else a
    :class:`LayoutError` names the tensor (a different vocabulary padding or pipeline
    partition shows up here, not as wrong weights on a server)."""
    import torch

    from realscale.parallel.reshard import shard_index

    idx = shard_index(spec, layout, gpu)
    if idx is None:
        raise LayoutError(f"rank {gpu} is not in the trainer layout {layout}")
    if out.numel() != idx.numel:
        raise LayoutError(f"rank {gpu}: source buffer has {out.numel()} elements, the layout puts {idx.numel} here")
    by_name = {t.name: i for i, t in enumerate(spec.tensors)}
    filled: set[int] = set()
    with torch.no_grad():
        for name, param in params.items():
            key = _spec_name(name, set(by_name))
            ti = by_name.get(key)
            if ti is None:
                raise LayoutError(f"Megatron parameter {name} has no tensor in the model spec")
            if ti not in idx.entries:
                raise LayoutError(f"rank {gpu} holds {name}, but the layout {layout} puts it on another stage")
            if ti in filled:
                continue  # (a tied embedding present twice on a single-stage model)
            lo, hi, off = idx.entries[ti]
            outer, _, inner = spec.tensors[ti].view3()
            n = outer * (hi - lo) * inner
            if param.numel() != n:
                raise LayoutError(f"{name}: the local shard has {param.numel()} elements, the spec's slice has {n} "
                                  f"(shape {tuple(param.shape)} vs rows [{lo}, {hi}) of {spec.tensors[ti].shape}); "
                                  "vocabulary padding or head layout differ")
            out[off:off + n].copy_(param.detach().reshape(-1))
            filled.add(ti)
    missing = sorted(set(idx.entries) - filled)
    if missing:
        raise LayoutError(f"rank {gpu}: no local parameter for {spec.tensors[missing[0]].name} "
                          f"({len(missing)} spec tensors missing)")
    return out


# ----------------------------------------------------------------------------- both sides


def plan_for(world: WorldSpec, spec: "ModelSpec") -> Any:
    """The resharding plan of ``world``; every member computes the same one from the same
    inputs (the plan is deterministic), so no plan is ever sent over the wire."""
    from realscale.parallel.reshard import plan_reshard

    if spec_digest(spec) != world.spec_digest:
        raise LayoutError(f"weight world {world.name}: this side's model spec ({spec_digest(spec)}) differs from "
                          f"the trainer's ({world.spec_digest}); do both hold the same model?")
    src, dst = world.layouts()
    return plan_reshard(spec, src, dst, gpus_per_node=world.world_size)


class WorldMember:
    """One rank's membership of a weight world, with the resharder built on it: what a
    trainer rank and a generation-server rank each hold between steps."""

    def __init__(self, world: WorldSpec, rank: int, spec: "ModelSpec", store: Any = None) -> None:
        from realscale.parallel.reshard_exec import Resharder

        plan = plan_for(world, spec)  # before joining: a mismatch fails here, not as a hang
        self.world, self.rank, self.spec = world, rank, spec
        self.group = StoreGroup(world, rank, store)
        self.resharder = Resharder(plan, comm=self.group, bucket_bytes=world.bucket_bytes,
                                   max_inflight_bytes=4 * world.bucket_bytes)
        self.dtype = torch_dtype(world.dtype)

    @property
    def plan(self) -> Any:
        return self.resharder.plan

    def lower_bound_bytes(self) -> int:
        from realscale.parallel.reshard import lower_bound_elems

        src, dst = self.world.layouts()
        return sum(lower_bound_elems(self.spec, src, dst).values()) * self.spec.itemsize

    def send(self, src_buf: "torch.Tensor") -> Any:
        """Trainer rank: move this rank's part of the weights; returns ReshardStats."""
        return self.resharder.run(src_buf)[1]

    def receive(self, out: "torch.Tensor") -> Any:
        """Server rank: fill ``out`` (this rank's flat shard) with the new weights."""
        return self.resharder.run(None, dtype=self.dtype, out=out)[1]

    def close(self) -> None:
        self.group.close()

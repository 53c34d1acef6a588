"""Rollout data to the trainer ranks: each rank receives only the tensors it reads.

The driver (global rank 0) holds a step's packed batch. It splits every mini-batch into
token-balanced data-parallel shares once (:func:`realscale.train.actor.split_for_dp`);
:meth:`BatchScatter.scatter` then delivers, on every trainer rank, this rank's share of
each mini-batch as a list of :class:`~realscale.train.batch.PackedBatch`, holding only
the parts its pipeline stage reads (:class:`StageNeeds`; the actor declares them).

Protocol (every trainer rank calls :meth:`~BatchScatter.scatter`; point-to-point sends over
the trainer's world group and broadcasts over megatron's TP groups; gloo on CPU, NCCL on
GPUs with every buffer on the device, chosen by :mod:`realscale.parallel.device`):

0. **start**: the driver's *order*, so that a rank's ``seconds`` measure the transfer and
   not the wait for rollouts. The other ranks wait here for the driver's batch, which
   takes as long as generation does (the first batch of a long-answer recipe: longer than
   NCCL's 10-minute watchdog), so the order is a broadcast on a gloo side group with a
   one-day timeout (:func:`realscale.parallel.device.wait_group`), never inside an NCCL
   collective; every NCCL call below starts once the driver holds its batch. The order
   is :data:`BATCH` (steps 1-3 follow) or :data:`REPUBLISH`: every rank takes part in a
   republish of the current weights (the caller's ``republish``: no generation server
   was in rotation, :mod:`realscale.publish.outage`), then waits for the next order. The
   driver gives that order with :meth:`BatchScatter.order_republish` while it waits.
1. **DP hop**: for each data-parallel group ``d >= 1`` the driver sends the share of ``d``
   (the parts any of the group's stages reads) to the group's *entry*: its TP-rank-0
   process on the stage that reads the most (the last stage: it alone reads the loss
   fields). Group 0's source is the driver itself.
2. **PP hop**: the source of each group sends every other stage's TP-rank-0 process the
   parts that stage reads (first stage: tokens; middle stages: no tokens).
3. **TP hop**: each stage's TP-rank-0 process broadcasts its parts over its TP group.

Each message is a header, then the tensors: the header is two tensors (its length,
int64; then UTF-8 JSON: the keys, their dtypes and trailing shapes, and per mini-batch
the token and sequence counts), so receivers allocate their buffers before the data
arrives; tensor data is never pickled. Parts a stage does not read are not sent; on
such a rank ``input_ids`` is a placeholder of ``-1`` s (an expanded view: no memory, and
an embedding lookup of it fails loudly), and unread fields are absent.

Lower bound (:meth:`~BatchScatter.lower_bound`): every rank other than the driver must
receive the parts its stage reads of its DP group's share, once: the sum of those bytes.
Steps 1-3 move exactly that whenever the entry stage reads every part its group needs
(true for the actor's needs, where the last stage reads a superset), so ``bytes`` equals
the bound; header bytes (a few hundred per message) are counted apart. The driver sends
about one batch (each share once, plus group 0's stage subsets), instead of the pickled
whole batch to every rank that ``broadcast_object_list`` sent.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist

from realscale.parallel.device import check_comm, comm_empty, to_comm, wait_group
from realscale.train.batch import PackedBatch

if TYPE_CHECKING:
    from realscale.parallel.megatron_state import RankInfo

TOKENS, CU = "input_ids", "cu_seqlens"
PLACEHOLDER_TOKEN = -1
DRIVER = 0
BATCH, REPUBLISH = 0, 1  # the driver's orders at step 0 (module docstring)


@dataclass(frozen=True)
class StageNeeds:
    """The parts of a share each pipeline stage reads: ``input_ids``, ``cu_seqlens``
    (always: it sets the micro-batches) and per-token field names."""

    first: tuple[str, ...]
    middle: tuple[str, ...]
    last: tuple[str, ...]

    def keys(self, pp_rank: int, pp: int) -> tuple[str, ...]:
        """What stage ``pp_rank`` of ``pp`` reads (with one stage: first and last at once)."""
        want = {CU}
        if pp_rank == 0:
            want.update(self.first)
        if pp_rank == pp - 1:
            want.update(self.last)
        if 0 < pp_rank < pp - 1:
            want.update(self.middle)
        return _ordered(want)


@dataclass
class ScatterStats:
    """What one :meth:`BatchScatter.scatter` moved, seen from this rank."""

    bytes: int = 0  # tensor bytes this rank received
    header_bytes: int = 0  # header bytes this rank received
    seconds: float = 0.0  # from the start barrier until this rank held its shares
    lower_bound: int = 0  # driver only: what the ranks had to receive at least (module docstring)

    def local(self) -> dict[str, float]:
        return {"batch_bytes": float(self.bytes), "batch_header_bytes": float(self.header_bytes),
                "batch_s": self.seconds}


@dataclass(frozen=True)
class _Route:
    """One message: which parts of which DP group's shares go from ``src`` to ``dst``."""

    src: int
    dst: int
    dp: int
    keys: tuple[str, ...]


@dataclass
class _Topology:
    """Global rank <-> (dp, pp, tp) position of every trainer rank."""

    where: list[tuple[int, int, int]]
    at: dict[tuple[int, int, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.at = {pos: rank for rank, pos in enumerate(self.where)}


class BatchScatter:
    """Delivers each trainer rank its shares (module docstring). Built once on every rank
    (collective: the ranks exchange their layout positions); ``ranks`` is the engine's
    :class:`~realscale.parallel.megatron_state.RankInfo`."""

    def __init__(self, ranks: "RankInfo", needs: StageNeeds, backend: str | None = None) -> None:
        self.ranks, self.needs = ranks, needs
        self.backend = backend or dist.get_backend()
        self.rank = dist.get_rank()
        self.topo = _Topology(_positions(ranks, self.backend))
        if self.topo.where[DRIVER] != (0, 0, 0):
            raise RuntimeError(f"batch scatter: global rank 0 sits at (dp, pp, tp) = {self.topo.where[DRIVER]}, "
                               "expected (0, 0, 0) (megatron's rank order)")
        self.entry_stage = self._entry_stage()
        # step 0's wait for the driver's batch: on a gloo side group (module docstring)
        self.start_group = wait_group() if dist.get_world_size() > 1 else None

    # ------------------------------------------------------------------ the plan

    def _entry_stage(self) -> int:
        """The stage that first receives a DP group's share: one that reads everything the
        group needs (then nothing is received twice), else the last."""
        pp = self.ranks.pp
        union = set().union(*(self.needs.keys(s, pp) for s in range(pp)))
        for stage in reversed(range(pp)):
            if union <= set(self.needs.keys(stage, pp)):
                return stage
        return pp - 1

    def _head(self, dp: int, stage: int) -> int:
        return self.topo.at[(dp, stage, 0)]

    def _source(self, dp: int) -> int:
        return DRIVER if dp == 0 else self._head(dp, self.entry_stage)

    def routes(self) -> list[_Route]:
        """Every point-to-point message of a step, in the order they are sent (steps 1, 2)."""
        r, pp = self.ranks, self.ranks.pp
        union = _ordered(set().union(*(self.needs.keys(s, pp) for s in range(pp))))
        out = [_Route(DRIVER, self._source(d), d, union) for d in range(1, r.dp)]
        for d in range(r.dp):
            src = self._source(d)
            out += [_Route(src, self._head(d, s), d, self.needs.keys(s, pp))
                    for s in range(pp) if self._head(d, s) != src]
        return out

    def lower_bound(self, shares: Sequence[Sequence[PackedBatch]]) -> int:
        """Bytes every rank but the driver must receive: its stage's parts of its group's shares."""
        total = 0
        for rank, (dp, stage, _) in enumerate(self.topo.where):
            if rank != DRIVER:
                keys = self.needs.keys(stage, self.ranks.pp)
                total += sum(_part(b, k).nbytes for b in shares[dp] for k in keys)
        return total

    # ------------------------------------------------------------------ one step

    def order_republish(self) -> None:
        """The driver, while it waits for its batch: every other rank leaves its wait in
        :meth:`scatter` to republish the weights with it (module docstring, step 0)."""
        if self.rank != DRIVER:
            raise RuntimeError("batch scatter: only the driver gives orders")
        self._order(REPUBLISH)

    def _order(self, order: int) -> int:
        """Step 0 on the wait group: the driver sends ``order``, the others receive one."""
        if self.start_group is None:
            return order
        holder = comm_empty(1, torch.int64, "gloo")
        holder.fill_(order)
        dist.broadcast(holder, DRIVER, group=self.start_group)
        return int(holder.item())

    def scatter(self, shares: Sequence[Sequence[PackedBatch]] | None,
                republish: Callable[[], Any] | None = None) -> tuple[list[PackedBatch], ScatterStats]:
        """This rank's share of every mini-batch. ``shares[d][m]`` (driver only; None
        elsewhere) is DP group ``d``'s share of mini-batch ``m``. ``republish`` (every rank
        but the driver): what a :data:`REPUBLISH` order runs before the next order."""

        r = self.ranks
        if self.rank == DRIVER and (shares is None or len(shares) != r.dp):
            raise ValueError(f"batch scatter: the driver needs one list of shares per DP rank ({r.dp}), "
                             f"got {None if shares is None else len(shares)}")
        while self._order(BATCH) == REPUBLISH:  # only the driver's order counts: the others receive it
            if republish is None:
                raise RuntimeError("batch scatter: the driver ordered a republish, and this rank has nothing to run")
            republish()
        start = time.perf_counter()
        stats = ScatterStats()
        held: dict[int, list[dict[str, torch.Tensor]]] = {}  # dp -> parts of each share, on this rank
        if self.rank == DRIVER:
            stats.lower_bound = self.lower_bound(shares)
            held = {d: [_parts(b) for b in shares[d]] for d in range(r.dp)}
        pending = []
        for route in self.routes():
            if route.src == self.rank:
                pending += _send(held[route.dp], route.keys, route.dst, self.backend)
            elif route.dst == self.rank:
                held[route.dp] = _recv(route.src, self.backend, stats)
        for work in pending:
            work.wait()
        keys = self.needs.keys(r.pp_rank, r.pp)
        mine = held.get(r.dp_rank)
        if r.tp > 1:
            mine = _tp_broadcast(mine, keys, r, self.backend, stats)
        out = [_share(parts, keys) for parts in mine]
        stats.seconds = time.perf_counter() - start
        return out, stats


# ---------------------------------------------------------------------- parts and headers


def _ordered(keys: set[str]) -> tuple[str, ...]:
    """Tokens, offsets, then fields by name: the same order on every rank."""
    return tuple(sorted(keys, key=lambda k: (k != TOKENS, k != CU, k)))


def _part(batch: PackedBatch, key: str) -> torch.Tensor:
    if key == TOKENS:
        return batch.input_ids
    if key == CU:
        return batch.cu_seqlens
    if key not in batch.fields:
        raise KeyError(f"batch scatter: the batch has no field {key!r} that a stage reads "
                       f"(fields: {sorted(batch.fields)})")
    return batch.fields[key]


def _parts(batch: PackedBatch) -> dict[str, torch.Tensor]:
    return {TOKENS: batch.input_ids, CU: batch.cu_seqlens, **batch.fields}


def _share(parts: dict[str, torch.Tensor], keys: tuple[str, ...]) -> PackedBatch:
    """A PackedBatch of the parts this stage reads; unread tokens become a placeholder."""
    cu = parts[CU]
    tokens = parts.get(TOKENS) if TOKENS in keys else None
    if tokens is None:
        tokens = torch.full((1,), PLACEHOLDER_TOKEN, dtype=torch.long).expand(int(cu[-1]))
    return PackedBatch(tokens, cu, {k: parts[k] for k in keys if k not in (TOKENS, CU)})


def _header(parts: list[dict[str, torch.Tensor]], keys: tuple[str, ...]) -> bytes:
    first = parts[0]
    head = {"keys": list(keys), "dtypes": [str(first[k].dtype).removeprefix("torch.") for k in keys],
            "trailing": [list(first[k].shape[1:]) for k in keys],
            "shares": [[int(p[CU][-1]), p[CU].numel() - 1] for p in parts]}
    return json.dumps(head, separators=(",", ":")).encode()


def _buffers(head: dict[str, Any], backend: str) -> list[dict[str, torch.Tensor]]:
    """Empty receive buffers for every part a header announces, on the comm device."""
    out = []
    for tokens, seqs in head["shares"]:
        bufs = {}
        for key, dtype, trailing in zip(head["keys"], head["dtypes"], head["trailing"]):
            rows = seqs + 1 if key == CU else tokens
            bufs[key] = comm_empty((rows, *trailing), getattr(torch, dtype), backend)
        out.append(bufs)
    return out


def _to_host(parts: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Received parts where the engine takes them (it moves each micro-batch's row to its device)."""
    return [{k: v.cpu() for k, v in p.items()} for p in parts]


# ---------------------------------------------------------------------- messages


def _header_tensors(parts: list[dict[str, torch.Tensor]], keys: tuple[str, ...], backend: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(length, UTF-8 JSON) of the header announcing ``keys`` of ``parts``, on the comm device."""
    raw = _header(parts, keys)
    return (to_comm(torch.tensor([len(raw)], dtype=torch.int64), backend),
            to_comm(torch.frombuffer(bytearray(raw), dtype=torch.uint8), backend))


def _account(stats: ScatterStats, header: tuple[torch.Tensor, ...], bufs: list[dict[str, torch.Tensor]]) -> None:
    stats.header_bytes += sum(t.nbytes for t in header)
    stats.bytes += sum(t.nbytes for b in bufs for t in b.values())


def _send(parts: list[dict[str, torch.Tensor]], keys: tuple[str, ...], dst: int, backend: str) -> list[Any]:
    """Header, then every part of every share, to ``dst`` (asynchronous: the works)."""

    msgs = [*_header_tensors(parts, keys, backend), *(to_comm(p[k], backend) for p in parts for k in keys)]
    return [dist.isend(check_comm(t, backend, "batch scatter send"), dst) for t in msgs]


def _recv(src: int, backend: str, stats: ScatterStats) -> list[dict[str, torch.Tensor]]:
    size = comm_empty(1, torch.int64, backend)
    dist.recv(size, src)
    raw = comm_empty(int(size.item()), torch.uint8, backend)
    dist.recv(raw, src)
    head = json.loads(bytes(raw.cpu().numpy()))
    bufs = _buffers(head, backend)
    for work in [dist.irecv(check_comm(b[k], backend, "batch scatter receive"), src) for b in bufs
                 for k in head["keys"]]:
        work.wait()
    _account(stats, (size, raw), bufs)
    return _to_host(bufs)


def _tp_broadcast(parts: list[dict[str, torch.Tensor]] | None, keys: tuple[str, ...], r: "RankInfo",
                  backend: str, stats: ScatterStats) -> list[dict[str, torch.Tensor]]:
    """The TP-rank-0 process's ``keys`` of ``parts`` on every rank of its TP group."""

    group, sending = r.tp_group, r.tp_rank == 0
    src = dist.get_process_group_ranks(group)[0]
    if sending:
        size, raw = _header_tensors(parts, keys, backend)
    else:
        size = comm_empty(1, torch.int64, backend)
    dist.broadcast(size, src, group=group)
    if not sending:
        raw = comm_empty(int(size.item()), torch.uint8, backend)
    dist.broadcast(raw, src, group=group)
    head = json.loads(bytes(raw.cpu().numpy()))
    bufs = [{k: to_comm(p[k], backend) for k in keys} for p in parts] if sending else _buffers(head, backend)
    for b in bufs:
        for k in head["keys"]:
            dist.broadcast(b[k], src, group=group)
    if sending:
        return parts
    _account(stats, (size, raw), bufs)
    return _to_host(bufs)


def _positions(ranks: "RankInfo", backend: str) -> list[tuple[int, int, int]]:
    """(dp, pp, tp) of every global rank, gathered once."""

    mine = torch.tensor([ranks.dp_rank, ranks.pp_rank, ranks.tp_rank], dtype=torch.int64)
    world = dist.get_world_size()
    if world == 1:
        return [tuple(mine.tolist())]
    out = [comm_empty(3, torch.int64, backend) for _ in range(world)]
    dist.all_gather(out, to_comm(mine, backend))
    return [tuple(int(x) for x in t.cpu().tolist()) for t in out]

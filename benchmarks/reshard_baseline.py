"""The reference resharding most RL systems use: gather, then broadcast.

For every source pipeline stage, the tp ranks of its first dp replica send their shards
to one leader, which reassembles the full tensors of that stage and broadcasts them to
every destination GPU that needs any of them; each receiver then slices its own shard.
(verl / OpenRLHF do this per tensor between Megatron/FSDP and vLLM/SGLang.) It moves
full tensors to every receiver and ignores what a receiver already holds; it is the
baseline of ``benchmarks/bench_reshard.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from realscale.parallel.mesh import Layout
from realscale.parallel.model_spec import ModelSpec
from realscale.parallel.reshard import shard_index


def _stage_tensors(spec: ModelSpec, layout: Layout, stage: int) -> list[int]:
    part = layout.stages(spec.n_layers)
    return [i for i, t in enumerate(spec.tensors) if stage in spec.stages_of(t, part)]


def _receivers(spec: ModelSpec, src: Layout, dst: Layout, stage: int) -> list[int]:
    have = set(_stage_tensors(spec, src, stage))
    out = []
    for gpu in dst.mesh.gpus:
        idx = shard_index(spec, dst, gpu)
        if idx is not None and have & set(idx.entries):
            out.append(gpu)
    return out


def volume(spec: ModelSpec, src: Layout, dst: Layout) -> dict[int, int]:
    """Bytes each GPU receives under gather-then-broadcast (leaders count their gather)."""
    recv: dict[int, int] = {}
    s = src.strategy
    for stage in range(s.pp):
        tensors = _stage_tensors(spec, src, stage)
        full = sum(spec.tensors[i].numel for i in tensors) * spec.itemsize
        leader = src.gpu(s.local_rank(0, 0, stage))
        own = shard_index(spec, src, leader)
        recv[leader] = recv.get(leader, 0) + full - own.numel * spec.itemsize  # type: ignore[union-attr]
        for gpu in _receivers(spec, src, dst, stage):
            if gpu != leader:
                recv[gpu] = recv.get(gpu, 0) + full
    return recv


def estimate_seconds(spec: ModelSpec, src: Layout, dst: Layout, gpus_per_node: int, intra_gbps: float,
                     inter_gbps: float) -> float:
    """Busiest GPU's receive time at link speed: a receiver on another node than the
    stage leader receives over IB (same model of links as ``ReshardPlan.estimate_seconds``)."""
    busy: dict[int, float] = {}
    s = src.strategy
    for stage in range(s.pp):
        tensors = _stage_tensors(spec, src, stage)
        full = sum(spec.tensors[i].numel for i in tensors) * spec.itemsize
        leader = src.gpu(s.local_rank(0, 0, stage))
        own = shard_index(spec, src, leader).numel * spec.itemsize  # type: ignore[union-attr]
        busy[leader] = busy.get(leader, 0.0) + (full - own) / (intra_gbps * 1e9)
        for gpu in _receivers(spec, src, dst, stage):
            if gpu != leader:
                bw = inter_gbps if gpu // gpus_per_node != leader // gpus_per_node else intra_gbps
                busy[gpu] = busy.get(gpu, 0.0) + full / (bw * 1e9)
    return max(busy.values(), default=0.0)


def gather_broadcast(spec: ModelSpec, src: Layout, dst: Layout, src_buf: torch.Tensor | None,
                     dtype: torch.dtype, groups: dict | None = None) -> tuple[torch.Tensor | None, int]:
    """Run it on every rank (GPU g = rank g): this rank's destination shard and bytes received."""
    rank = dist.get_rank()
    s = src.strategy
    groups = {} if groups is None else groups
    received = 0
    full_by_stage: dict[int, dict[int, torch.Tensor]] = {}
    for stage in range(s.pp):
        tensors = _stage_tensors(spec, src, stage)
        leader = src.gpu(s.local_rank(0, 0, stage))
        members = [src.gpu(s.local_rank(0, tp, stage)) for tp in range(s.tp)]
        # 1. gather the tp shards of the first replica on the leader
        shards: dict[int, torch.Tensor] = {}
        if rank == leader:
            shards[leader] = src_buf  # type: ignore[assignment]
            for m in members[1:]:
                n = shard_index(spec, src, m).numel  # type: ignore[union-attr]
                buf = torch.empty(n, dtype=dtype)
                dist.recv(buf, m)
                shards[m] = buf
                received += buf.numel() * buf.element_size()
        elif rank in members:
            dist.send(src_buf, leader)  # type: ignore[arg-type]
        total = sum(spec.tensors[i].numel for i in tensors)
        flat = torch.empty(total, dtype=dtype)
        if rank == leader:
            off = 0
            for i in tensors:
                t = spec.tensors[i]
                outer, rows, inner = t.view3()
                parts = []
                for tp, m in enumerate(members if t.split_dim is not None else members[:1]):
                    lo, hi, o = shard_index(spec, src, m).entries[i]  # type: ignore[union-attr]
                    parts.append(shards[m][o:o + outer * (hi - lo) * inner].view(outer, hi - lo, inner))
                flat[off:off + t.numel] = torch.cat(parts, dim=1).reshape(-1)
                off += t.numel
        # 2. broadcast the full stage to every destination GPU that needs part of it
        ranks = sorted(set([leader] + _receivers(spec, src, dst, stage)))
        key = tuple(ranks)
        if key not in groups:
            groups[key] = dist.new_group(ranks)
        if rank in ranks and len(ranks) > 1:
            dist.broadcast(flat, leader, group=groups[key])
            if rank != leader:
                received += flat.numel() * flat.element_size()
        if rank in ranks:
            off, table = 0, {}
            for i in tensors:
                table[i] = flat[off:off + spec.tensors[i].numel]
                off += spec.tensors[i].numel
            full_by_stage[stage] = table
    idx = shard_index(spec, dst, rank)
    if idx is None:
        return None, received
    out = torch.empty(idx.numel, dtype=dtype)
    for i, (lo, hi, off) in idx.entries.items():
        t = spec.tensors[i]
        outer, rows, inner = t.view3()
        full = next(tab[i] for tab in full_by_stage.values() if i in tab)
        part = full.view(outer, rows, inner)[:, lo:hi, :].reshape(-1)
        out[off:off + part.numel()] = part
    return out, received

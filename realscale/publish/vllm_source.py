"""The trainer's weights as a vLLM ``WeightSource``: what vLLM's trainer-side weight-transfer
engines send each round: full tensors for the broadcast engines (``nccl``, realscale's
``gloo``: :class:`MegatronWeightSource`), each rank's local shards for the shard-to-shard
ones (``nccl_m2n``, realscale's ``gloo_m2n``: :class:`MegatronShardSource`).

Iteration replays :meth:`realscale.train.engine.MegatronEngine.export_hf_weights`: full
HF-named tensors gathered over tensor and pipeline parallelism, yielded on global rank 0
(other ranks take part in the gathers and yield nothing). Every trainer rank must iterate
in lockstep, which vLLM's engines do (non-senders replay the iteration).

``metadata()`` must describe the stream before any byte moves (the workers size their
buffers from it). Names, dtypes and shapes never change during a run, so the first call
runs one export pass (a collective, on every rank, as the engines call it) and keeps the
result; later rounds cost nothing extra.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.m2n_common import REPLICATE, M2NMesh, M2NParamMeta

from realscale.inference.vllm_m2n import MeshedWeightSource
from realscale.models.convert import (
    TP_DIM,
    _full_shape,
    _hf_names,
    _param_plan,
    _tp_gather,
    local_params,
    match,
    megatron_to_hf,
)

if TYPE_CHECKING:
    from realscale.models.family import ModelArch
    from realscale.train.engine import MegatronEngine


class _RoundExport:
    """Keeps count of the round's export, so that a round that failed (a server lost
    during the send) can still run it to its end on this rank (:meth:`finish_round`): its
    gathers are collectives the other trainer ranks run to the end in step, whether this
    rank's send failed before, during or after its own iteration."""

    _live: Iterator[tuple[str, torch.Tensor]] | None = None
    _begun = 0

    def begin_round(self) -> None:
        self._live, self._begun = None, 0

    def _tracked(self, pairs: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        self._live, self._begun = pairs, self._begun + 1
        return pairs

    def finish_round(self) -> None:
        """The round's export, finished where a failed send left it, or run whole where
        the send failed before it began."""
        live, self._live = self._live, None
        for _ in live if self._begun else self._pairs():
            pass

    def _pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError


class MegatronWeightSource(_RoundExport, WeightSource):
    """HF-named full tensors of a :class:`MegatronEngine`, re-iterable."""

    def __init__(self, engine: "MegatronEngine", bucket_bytes: int = 64 << 20) -> None:
        self.engine = engine
        self.bucket_bytes = bucket_bytes
        self._meta: list[ParamMeta] | None = None

    def metadata(self) -> list[ParamMeta]:
        if self._meta is None:
            self._meta = [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self._pairs()]  # not a round's
        return self._meta

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._tracked(self._pairs())

    def _pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.engine.export_hf_weights(bucket_bytes=self.bucket_bytes):
            yield from bucket

    def nbytes(self) -> int:
        """Bytes of one full copy as sent (after :meth:`metadata`)."""
        return sum(torch.Size(m.shape).numel() * m.dtype.itemsize for m in self.metadata())


# --------------------------------------------------------------------------- local shards (m2n)


@dataclass(frozen=True)
class ShardEntry:
    """One HF tensor as the trainer holds it: which Megatron parameter (and which of its
    HF outputs) it comes from, the pipeline stage holding it, its full HF shape, and the
    tensor dim tensor parallelism cuts into equal chunks (None: every rank of the stage
    holds it whole). ``gathered``: a vocabulary tensor whose Megatron shards are not equal
    chunks of the HF tensor (padded rows): m2n only expresses equal chunks
    (``m2n_common.py:221-242``), so its tp ranks all-gather it first (padding makes that
    the one exception to "each rank sends its local shard")."""

    hf_name: str
    megatron_name: str
    kind: str
    index: int
    stage: int
    shape: tuple[int, ...]
    dim: int | None
    gathered: bool = False


def shard_layout(arch: "ModelArch", tp: int, pp: int, padded_vocab: int) -> list[ShardEntry]:
    """Every HF tensor of the model, in export order, as Megatron ranks of tensor parallel
    degree ``tp`` and ``pp`` pipeline stages hold it (:mod:`realscale.models.convert`'s
    rules). The local shard of a qkv (fused, per query group) or fc1 ([gate_t; up_t])
    parameter splits into equal dim-0 chunks of the HF q/k/v and gate/up tensors: tensor
    parallelism takes whole query groups, so rank t's q rows are the HF q_proj's t-th chunk."""
    if arch.moe is not None:
        # each expert-parallel rank holds other experts: the shard-to-shard plan below knows
        # only tp and pp (the broadcast engine, vllm_weight_engine=broadcast, moves experts)
        raise ValueError("generate.vllm_weight_engine=m2n does not move mixture-of-experts weights yet; use "
                         "generate.vllm_weight_engine=broadcast")
    shim = SimpleNamespace(vocab_size=padded_vocab)
    out = []
    for name, stage in _param_plan(arch, pp):
        rule, layer = match(name)
        meta = torch.empty(_full_shape(name, arch, shim), device="meta")
        hf = megatron_to_hf(rule.kind, meta, arch)
        gathered = rule.kind == "vocab" and tp > 1 and padded_vocab != arch.vocab_size
        dim = TP_DIM[rule.kind] if tp > 1 and not gathered else None
        for i, (hf_name, t) in enumerate(zip(_hf_names(rule, layer, arch), hf)):
            out.append(ShardEntry(hf_name, name, rule.kind, i, stage, tuple(t.shape), dim, gathered))
    return out


def split_local(entry_kind: str, local: torch.Tensor, arch: "ModelArch") -> list[torch.Tensor]:
    """A Megatron rank's local shard -> its HF local shards (views where possible), one per
    HF output of the rule, each an equal chunk of the HF tensor along the entry's dim."""
    if entry_kind in ("replicated", "column", "row"):
        return [local]
    if entry_kind == "vocab":
        return [local[: arch.vocab_size] if local.shape[0] > arch.vocab_size else local]
    if entry_kind == "qkv":
        qpg, d = arch.num_heads // arch.num_kv_heads, arch.head_dim
        rest = tuple(local.shape[1:])
        grouped = local.reshape(-1, (qpg + 2) * d, *rest)
        return [p.reshape(-1, *rest) for p in grouped.split([qpg * d, d, d], dim=1)]
    if entry_kind == "fc1":
        return list(local.chunk(2, dim=0))
    raise ValueError(f"unknown conversion kind '{entry_kind}'")


class MegatronShardSource(_RoundExport, MeshedWeightSource):
    """The trainer's weights as vLLM's m2n wants them (``m2n_source.py:35-52``): each rank
    yields its **local** shards under HF names, no gather over tensor or pipeline
    parallelism. The mesh is one pipeline stage's ranks, ``(dp, tp)`` (Megatron's rank
    order: tp fastest, then dp, then pp, so a stage is a contiguous interval); a tensor
    sharded by tp is ``(REPLICATE, dim)`` over it (data-parallel replicas take turns
    sending), the rest ``REPLICATED``. Stage ``s``'s tensors start at rank ``s * dp * tp``
    (:meth:`mesh_starts`; all 0 without pipeline parallelism)."""

    def __init__(self, engine: "MegatronEngine") -> None:
        r = engine.ranks
        if dist.is_initialized() and dist.get_rank() != r.world_rank():
            raise ValueError(f"m2n weight source: global rank {dist.get_rank()} is not Megatron's rank "
                             f"{r.world_rank()} (tp fastest, then dp, then pp)")
        self.engine = engine
        self.arch = engine.arch
        self.stage_ranks = r.dp * r.tp
        self.layout = shard_layout(engine.arch, r.tp, r.pp, engine.arch.padded_vocab(r.tp))
        self.dtype = engine.config.params_dtype

    def mesh(self) -> M2NMesh:
        return M2NMesh((self.engine.ranks.dp, self.engine.ranks.tp), 0)

    def mesh_starts(self) -> list[int] | None:
        if self.engine.ranks.pp == 1:
            return None
        return [e.stage * self.stage_ranks for e in self.layout]

    def metadata(self) -> list[ParamMeta]:
        return [M2NParamMeta(e.hf_name, self.dtype, e.shape, None if e.dim is None else (REPLICATE, e.dim))
                for e in self.layout]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._tracked(self._pairs())

    @torch.no_grad()
    def _pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        r = self.engine.ranks
        local = local_params(self.engine.model)
        split: dict[str, list[torch.Tensor]] = {}
        for e in self.layout:
            if e.stage != r.pp_rank:
                continue
            if e.megatron_name not in split:
                t = local[e.megatron_name].detach()
                if e.gathered:  # padded vocabulary: see ShardEntry
                    t = _tp_gather(e.kind, t, r.tp_group).to(t.device)
                split[e.megatron_name] = split_local(e.kind, t, self.arch)
            yield e.hf_name, split[e.megatron_name][e.index]

    def nbytes(self) -> int:
        return sum(math.prod(e.shape) for e in self.layout) * self.dtype.itemsize

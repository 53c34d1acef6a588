"""Packed batches: many sequences concatenated, no padding between them.

A :class:`PackedBatch` holds ``input_ids`` ``[T]`` (all sequences back to back),
``cu_seqlens`` ``[N+1]`` (sequence ``i`` is ``input_ids[cu[i]:cu[i+1]]``) and any number
of per-token fields ``[T]`` (loss mask, behaviour log-probs, advantages ...).

Per-token log-probs follow one alignment everywhere: ``logp[j]`` is the log-probability
of token ``j`` given the tokens before it in its sequence; the first token of every
sequence has no prediction and gets 0 (and must be masked out of losses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass
class PackedBatch:
    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    fields: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 1:
            raise ValueError(f"input_ids must be 1-D (packed), got shape {tuple(self.input_ids.shape)}")
        cu = self.cu_seqlens
        if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != self.input_ids.numel():
            raise ValueError(f"cu_seqlens must start at 0 and end at {self.input_ids.numel()} tokens, got {cu.tolist()[:8]}")
        if cu.numel() > 1 and bool((cu[1:] <= cu[:-1]).any()):
            raise ValueError("cu_seqlens must be strictly increasing (no empty sequences)")
        for name, value in self.fields.items():
            if value.shape[:1] != self.input_ids.shape:
                raise ValueError(f"field '{name}' has {value.shape[0] if value.dim() else 0} entries, expected one per token ({self.input_ids.numel()})")

    @classmethod
    def from_sequences(cls, sequences: Sequence[Sequence[int] | torch.Tensor],
                       fields: dict[str, Sequence[torch.Tensor]] | None = None) -> "PackedBatch":
        """Pack a list of token sequences (and per-sequence field tensors)."""
        if not sequences:
            raise ValueError("cannot pack an empty list of sequences")
        ids = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
        lens = torch.tensor([len(s) for s in ids], dtype=torch.long)
        cu = torch.zeros(len(ids) + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(lens, 0)
        packed = {k: torch.cat([torch.as_tensor(x) for x in v]) for k, v in (fields or {}).items()}
        return cls(torch.cat(ids), cu, packed)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def seqlens(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def select(self, indices: Sequence[int]) -> "PackedBatch":
        """A new batch of the given sequences, in the given order."""
        if not len(indices):
            raise ValueError("select: no sequences given")
        cu = self.cu_seqlens.tolist()
        spans = [torch.arange(cu[i], cu[i + 1]) for i in indices]
        take = torch.cat(spans)
        lens = torch.tensor([cu[i + 1] - cu[i] for i in indices], dtype=torch.long)
        new_cu = torch.zeros(len(indices) + 1, dtype=torch.long)
        new_cu[1:] = torch.cumsum(lens, 0)
        return PackedBatch(self.input_ids[take], new_cu, {k: v[take] for k, v in self.fields.items()})

    def sequence(self, i: int) -> torch.Tensor:
        return self.input_ids[int(self.cu_seqlens[i]): int(self.cu_seqlens[i + 1])]

    def to_payload(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "cu_seqlens": self.cu_seqlens, **{f"f.{k}": v for k, v in self.fields.items()}}

    @classmethod
    def from_payload(cls, payload: dict[str, torch.Tensor]) -> "PackedBatch":
        fields = {k[2:]: v for k, v in payload.items() if k.startswith("f.")}
        return cls(payload["input_ids"], payload["cu_seqlens"], fields)

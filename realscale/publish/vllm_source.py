"""The trainer's weights as a vLLM ``WeightSource``: what vLLM's trainer-side weight-transfer
engines (``nccl``, realscale's ``gloo``) send each round.

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

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

if TYPE_CHECKING:
    from realscale.train.engine import MegatronEngine


class MegatronWeightSource(WeightSource):
    """HF-named full tensors of a :class:`MegatronEngine`, re-iterable."""

    def __init__(self, engine: "MegatronEngine", bucket_bytes: int = 64 << 20) -> None:
        self.engine = engine
        self.bucket_bytes = bucket_bytes
        self._meta: list[ParamMeta] | None = None

    def metadata(self) -> list[ParamMeta]:
        if self._meta is None:
            self._meta = [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self]
        return self._meta

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.engine.export_hf_weights(bucket_bytes=self.bucket_bytes):
            yield from bucket

    def nbytes(self) -> int:
        """Bytes of one full copy as sent (after :meth:`metadata`)."""
        return sum(torch.Size(m.shape).numel() * m.dtype.itemsize for m in self.metadata())

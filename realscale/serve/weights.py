"""One generation-server rank's weights: a single flat buffer in the resharder's order.

Every rank of an embedded server with ``tp`` ranks holds the Megatron tensor-parallel
shard of every tensor of the model's :class:`~realscale.parallel.model_spec.ModelSpec`
(``spec_from_hf_config``; vocabulary padded to a multiple of 128, zero rows), packed into
**one flat 1-D buffer** (:attr:`RankWeights.flat`) in
``shard_index(spec, Layout(Mesh(0, tp), Strategy(tp=tp)), tp_rank)`` order. The decoder's
tensors are views of it (``unpack_shard``), so:

- a resharder writes new weights straight into ``flat`` (in place, or through
  :meth:`RankWeights.copy_flat`), with no conversion and no model code involved;
- two ranks hold bit-identical weights iff their buffers are identical, which
  :func:`tensor_hashes` (one hash per tensor) lets tests check against the trainer's
  shards packed with ``realscale.parallel.reshard_exec.pack_shard``.

Filling it from HF-named tensors (a model directory, or SGLang's bucketed broadcast of
full tensors): :class:`HFLoader` takes the tensors in any order and any bucketing and
writes each spec tensor as soon as all its HF sources have arrived (the fused QKV needs
q, k and v; ``linear_fc1`` needs gate and up), converting with
:func:`realscale.models.convert.hf_to_megatron` for this rank. Shapes are checked
against the HF shapes the spec implies before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from realscale.models.convert import SafetensorsReader, hf_sources, hf_to_megatron, megatron_to_hf
from realscale.models.family import ModelArch, arch_from_hf
from realscale.parallel.mesh import Layout, LayoutError, Mesh, Strategy
from realscale.parallel.model_spec import ModelSpec, TensorSpec, spec_from_hf_config
from realscale.parallel.reshard import ShardIndex, shard_index
from realscale.parallel.reshard_exec import pack_shard, unpack_shard

Named = list[tuple[str, torch.Tensor]]


class UnsupportedModelError(ValueError):
    """The model uses a feature the embedded server does not implement."""


def read_hf_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{model_dir}: no config.json (expected an HF model directory)")
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def server_layout(tp: int) -> Layout:
    """The layout of one server's ranks: ``Strategy(dp=1, tp=tp, pp=1)`` on ``tp`` ranks."""
    return Layout(Mesh(0, tp), Strategy(dp=1, tp=tp, pp=1))


def model_spec(hf_cfg: dict[str, Any], tp: int, dtype: torch.dtype) -> tuple[ModelSpec, ModelArch]:
    """The spec and architecture of an HF config, refusing what the server cannot run
    (with a one-line reason) and a ``tp`` that does not divide the model."""
    try:
        arch = arch_from_hf(hf_cfg)
    except (ValueError, KeyError) as exc:
        raise UnsupportedModelError(f"the embedded server cannot serve this model: {exc}") from None
    spec = spec_from_hf_config(hf_cfg, itemsize=torch.empty(0, dtype=dtype).element_size())
    try:
        spec.check_strategy(Strategy(tp=tp))
    except LayoutError as exc:
        raise UnsupportedModelError(f"tp={tp}: {exc}") from None
    return spec, arch


def _megatron_full_shape(t: TensorSpec) -> tuple[int, ...]:
    """The spec's full shape as a Megatron parameter (fused dims flattened)."""
    if t.name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight")):
        return (t.shape[0] * t.shape[1], *t.shape[2:])
    return t.shape


def hf_shapes(spec: ModelSpec, arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """HF name -> shape, derived from the spec (no weights touched: meta tensors)."""
    out: dict[str, tuple[int, ...]] = {}
    for t in spec.tensors:
        kind, names = hf_sources(t.name, arch)
        full = torch.empty(_megatron_full_shape(t), device="meta")
        for name, hf in zip(names, megatron_to_hf(kind, full, arch)):
            out[name] = tuple(hf.shape)
    if arch.tie_embeddings:  # a tied checkpoint or state_dict may still name the head
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def tensor_hashes(spec: ModelSpec, index: ShardIndex, flat: torch.Tensor) -> dict[str, str]:
    """Spec tensor name -> blake2b of its shard's bytes in ``flat`` (``index`` order)."""
    out: dict[str, str] = {}
    for ti, (lo, hi, off) in sorted(index.entries.items(), key=lambda e: e[1][2]):
        t = spec.tensors[ti]
        outer, _, inner = t.view3()
        part = flat[off:off + outer * (hi - lo) * inner].detach().cpu().contiguous()
        out[t.name] = hashlib.blake2b(part.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()
    return out


def shard_hashes(spec: ModelSpec, layout: Layout, gpu: int, full: dict[str, torch.Tensor]) -> dict[str, str]:
    """What :func:`tensor_hashes` says of rank ``gpu`` of ``layout`` once it holds the full
    tensors ``full`` (:func:`full_megatron_tensors`): the expected hashes of a server rank."""
    idx = shard_index(spec, layout, gpu)
    if idx is None:
        raise LayoutError(f"rank {gpu} holds no shard under {layout}")
    return tensor_hashes(spec, idx, pack_shard(spec, layout, gpu, full))


@dataclass
class RankWeights:
    """This rank's shard of the model in one flat buffer (module docstring)."""

    spec: ModelSpec
    arch: ModelArch
    tp: int
    tp_rank: int
    index: ShardIndex
    flat: torch.Tensor

    @classmethod
    def allocate(cls, hf_cfg: dict[str, Any], tp: int, tp_rank: int, dtype: torch.dtype,
                 device: torch.device) -> "RankWeights":
        spec, arch = model_spec(hf_cfg, tp, dtype)
        index = shard_index(spec, server_layout(tp), tp_rank)
        assert index is not None  # every rank of the layout holds a shard
        return cls(spec, arch, tp, tp_rank, index, torch.zeros(index.numel, dtype=dtype, device=device))

    @property
    def layout(self) -> Layout:
        return server_layout(self.tp)

    def rows(self, name: str) -> tuple[int, int]:
        """Rows ``[lo, hi)`` of tensor ``name``'s split dim that this rank holds."""
        ti = next(i for i, t in enumerate(self.spec.tensors) if t.name == name)
        lo, hi, _ = self.index.entries[ti]
        return lo, hi

    def tensors(self) -> dict[str, torch.Tensor]:
        """Spec name -> view of :attr:`flat` (local shard shape)."""
        return unpack_shard(self.spec, self.index, self.flat)

    def copy_flat(self, buf: torch.Tensor) -> None:
        """Overwrite the weights with a whole flat buffer (same order, e.g. a reshard's)."""
        if buf.numel() != self.flat.numel():
            raise ValueError(f"flat buffer of {buf.numel()} elements; rank {self.tp_rank} holds {self.flat.numel()}")
        with torch.no_grad():
            self.flat.copy_(buf.reshape(-1))

    def hashes(self) -> dict[str, str]:
        return tensor_hashes(self.spec, self.index, self.flat)

    def loader(self) -> "HFLoader":
        return HFLoader(self)

    def load_dir(self, model_dir: str) -> int:
        """Load this rank's shard of every tensor from an HF safetensors directory."""
        try:
            reader = SafetensorsReader(model_dir)
        except FileNotFoundError as exc:
            raise ValueError(str(exc)) from None
        loader = self.loader()
        for name in loader.wanted():
            loader.add([(name, reader.get(name))])
        loader.finish()
        return len(self.index.entries)


class HFLoader:
    """Writes HF-named tensors into a :class:`RankWeights`, each spec tensor as soon as
    every HF tensor it is made of has arrived (module docstring). A tensor sent again
    (a later update, or a tied ``lm_head.weight`` beside the embedding) is written again;
    a fused tensor whose siblings never come is reported by :meth:`incomplete`."""

    def __init__(self, weights: RankWeights) -> None:
        self.w = weights
        self.shapes = hf_shapes(weights.spec, weights.arch)
        self.views = weights.tensors()
        self.rows = {t.name: t.shape[0] for t in weights.spec.tensors}  # padded vocab for the vocab tensors
        self.sources = {t.name: hf_sources(t.name, weights.arch) for t in weights.spec.tensors}
        self.users: dict[str, list[str]] = {}
        for name, (_, srcs) in self.sources.items():
            for src in srcs:
                self.users.setdefault(src, []).append(name)
        self.todo = set(self.sources)  # spec tensors not written since their last source arrived
        self.pending: dict[str, torch.Tensor] = {}

    def wanted(self) -> list[str]:
        """The HF names that make up the model (each once)."""
        return list(self.users)

    def check(self, named: Named) -> None:
        """Refuse unknown names and wrong shapes before anything is written."""
        bad = [n for n, _ in named if n not in self.shapes]
        if bad:
            raise KeyError(f"unknown parameter name(s): {', '.join(bad[:5])}")
        for name, t in named:
            if tuple(t.shape) != self.shapes[name]:
                raise ValueError(f"{name}: shape {tuple(t.shape)} does not match the model's {self.shapes[name]}")

    def add(self, named: Named) -> int:
        """Take a bucket; returns how many spec tensors were written because of it."""
        self.check(named)
        ready: list[str] = []
        for name, t in named:
            key = "model.embed_tokens.weight" if name == "lm_head.weight" and self.w.arch.tie_embeddings else name
            self.pending[key] = t
            for user in self.users[key]:
                self.todo.add(user)
                if user not in ready and all(s in self.pending for s in self.sources[user][1]):
                    ready.append(user)
        for name in ready:
            self._write(name)
            self.todo.discard(name)
        # release the sources no unwritten tensor still needs
        self.pending = {k: v for k, v in self.pending.items() if any(u in self.todo for u in self.users[k])}
        return len(ready)

    def _write(self, name: str) -> None:
        kind, srcs = self.sources[name]
        view = self.views[name]
        value = hf_to_megatron(kind, [self.pending[s] for s in srcs], self.w.arch, self.w.tp_rank, self.w.tp,
                               padded_vocab=self.rows[name])
        if value.numel() != view.numel():
            raise ValueError(f"{name}: converted shard has {value.numel()} elements, rank {self.w.tp_rank} "
                             f"holds {view.numel()}")
        with torch.no_grad():
            view.copy_(value.reshape(view.shape))

    def incomplete(self) -> list[str]:
        """HF names still awaited by tensors of which some sources arrived (q without k, v)."""
        waiting = [u for u in self.todo if any(s in self.pending for s in self.sources[u][1])]
        return sorted({s for u in waiting for s in self.sources[u][1] if s not in self.pending})

    def end_update(self) -> None:
        """An update ends: raise if a fused tensor got only some of its sources (and forget them)."""
        miss = self.incomplete()
        self.pending.clear()
        if miss:
            raise ValueError(f"the update ended with fused tensors half sent; missing: {', '.join(miss[:5])}"
                             f"{' ...' if len(miss) > 5 else ''} (send q/k/v and gate/up of a layer together)")

    def finish(self) -> None:
        """Raise unless every tensor of the model was written (a whole-model load)."""
        if self.todo:
            miss = sorted({s for u in self.todo for s in self.sources[u][1] if s not in self.pending})
            raise ValueError(f"{len(self.todo)} tensor(s) not loaded; missing HF tensor(s): "
                             f"{', '.join(miss[:5])}{' ...' if len(miss) > 5 else ''}")


def full_megatron_tensors(named: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec,
                          arch: ModelArch) -> dict[str, torch.Tensor]:
    """Spec name -> full (unsharded) tensor in the spec's shape, from HF-named tensors:
    the input of ``pack_shard`` (what any layout's shards are cut from)."""
    hf = dict(named)
    out = {}
    for t in spec.tensors:
        kind, names = hf_sources(t.name, arch)
        value = hf_to_megatron(kind, [hf[n] for n in names], arch, 0, 1, padded_vocab=t.shape[0])
        out[t.name] = value.reshape(t.shape)
    return out

"""HF safetensors <-> megatron-core shards, for any (tp, pp), one tensor at a time.

Import (:func:`load_hf_weights`): each rank reads only the HF tensors its own
parameters need, one at a time, slices its tensor-parallel part and copies it in; no
process ever holds the whole model. Export (:func:`export_hf_weights`): each parameter is
all-gathered over its TP group, sent from its pipeline stage to global rank 0, turned
back into HF tensors (QKV split per query group, gate/up split, vocabulary padding
stripped) and yielded there in buckets of a configurable size — the stream the
generation servers consume (:mod:`realscale.inference.weight_sync`).

Megatron layouts handled here (megatron-core 0.16 GPT, local or TE spec):

- ``linear_qkv.weight`` is ``[groups * (q_per_group + 2) * head_dim, hidden]``: for each
  query group its query heads, then its key head, then its value head. TP splits whole
  groups.
- ``linear_fc1.weight`` is ``[2 * ffn / tp, hidden]`` per rank: this rank's gate rows, then
  its up rows.
- embedding / output rows are padded to the padded vocabulary and split over TP.
- column-parallel (QKV, fc1) split dim 0; row-parallel (proj, fc2) split dim 1; norms are
  replicated.
- mixture of experts (megatron's ``SequentialMLP``): ``mlp.router.weight`` is HF's
  ``mlp.gate.weight`` (replicated); expert ``e``'s ``linear_fc1`` / ``linear_fc2`` are laid
  out like a dense MLP's, split over the expert tp group. Each expert-parallel rank holds
  its own experts under *local* indices (``local_experts.0`` ...); :func:`local_params`
  and the names used here carry the *global* index, and export gathers the experts over
  the expert-parallel group.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from realscale.models.family import ModelArch
from realscale.parallel.device import comm_empty, group_backend, to_comm

Bucket = list[tuple[str, torch.Tensor]]


# --------------------------------------------------------------------------- the mapping


@dataclass(frozen=True)
class Rule:
    """How one megatron parameter relates to HF tensors."""

    pattern: re.Pattern[str]
    hf: tuple[str, ...]  # HF names, "{i}" = global layer index (0-based)
    kind: str  # replicated | vocab | column | row | qkv | qkv_bias | fc1


def _rules() -> list[Rule]:
    L = r"decoder\.layers\.(\d+)\."
    E = r"mlp\.experts\.local_experts\.\d+\."
    p = "model.layers.{i}."
    table = [
        (r"embedding\.word_embeddings\.weight", ("model.embed_tokens.weight",), "vocab"),
        (r"output_layer\.weight", ("lm_head.weight",), "vocab"),
        (r"decoder\.final_layernorm\.weight", ("model.norm.weight",), "replicated"),
        (L + r"(input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight)",
         (p + "input_layernorm.weight",), "replicated"),
        (L + r"(pre_mlp_layernorm\.weight|mlp\.linear_fc1\.layer_norm_weight)",
         (p + "post_attention_layernorm.weight",), "replicated"),
        (L + r"self_attention\.linear_qkv\.weight",
         (p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"), "qkv"),
        (L + r"self_attention\.linear_qkv\.bias",
         (p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"), "qkv"),
        (L + r"self_attention\.q_layernorm\.weight", (p + "self_attn.q_norm.weight",), "replicated"),
        (L + r"self_attention\.k_layernorm\.weight", (p + "self_attn.k_norm.weight",), "replicated"),
        (L + r"self_attention\.linear_proj\.weight", (p + "self_attn.o_proj.weight",), "row"),
        (L + r"mlp\.linear_fc1\.weight", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "fc1"),
        (L + r"mlp\.linear_fc2\.weight", (p + "mlp.down_proj.weight",), "row"),
        (L + r"mlp\.router\.weight", (p + "mlp.gate.weight",), "replicated"),
        (L + E + r"linear_fc1\.weight", (p + "mlp.experts.{e}.gate_proj.weight", p + "mlp.experts.{e}.up_proj.weight"),
         "fc1"),
        (L + E + r"linear_fc2\.weight", (p + "mlp.experts.{e}.down_proj.weight",), "row"),
    ]
    return [Rule(re.compile(pat + "$"), hf, kind) for pat, hf, kind in table]


RULES = _rules()

TP_DIM = {"vocab": 0, "column": 0, "qkv": 0, "fc1": 0, "row": 1, "replicated": None}


def match(name: str) -> tuple[Rule, int | None]:
    """The rule for megatron parameter ``name`` and the layer index it names (local)."""
    for rule in RULES:
        m = rule.pattern.search(name)
        if m:
            return rule, int(m.group(1)) if m.groups() else None
    raise KeyError(f"no HF mapping for megatron parameter '{name}'")


_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def expert_of(name: str) -> int | None:
    """The expert index in a parameter name (``...local_experts.<e>...``), or None."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


def _hf_names(rule: Rule, layer: int | None, arch: ModelArch, expert: int | None = None) -> tuple[str, ...]:
    names = tuple(n.format(i=layer, e=expert) for n in rule.hf)
    if rule.kind == "vocab" and names == ("lm_head.weight",) and arch.tie_embeddings:
        return ("model.embed_tokens.weight",)
    return names


def hf_sources(name: str, arch: ModelArch) -> tuple[str, tuple[str, ...]]:
    """``(kind, HF names)`` of megatron parameter ``name`` (global layer indices): what
    :func:`hf_to_megatron` needs to build it. A tied output layer names the embedding."""
    rule, layer = match(name)
    return rule.kind, _hf_names(rule, layer, arch, expert_of(name))


# --------------------------------------------------------------------------- pure converters


def _qkv_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """HF q, k, v (weight or bias) -> megatron's per-group interleaved layout."""
    g, d = arch.num_kv_heads, arch.head_dim
    rest = q.shape[1:]
    qg = q.reshape(g, (arch.num_heads // g) * d, *rest)
    return torch.cat([qg, k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)


def hf_to_megatron(kind: str, hf: list[torch.Tensor], arch: ModelArch, tp_rank: int, tp: int,
                   padded_vocab: int) -> torch.Tensor:
    """This TP rank's megatron tensor from the HF tensor(s) of one rule."""
    if kind == "replicated":
        return hf[0]
    if kind == "vocab":
        full = hf[0]
        if full.shape[0] > padded_vocab:
            raise ValueError(f"vocabulary {full.shape[0]} exceeds the padded size {padded_vocab}")
        pad = full.new_zeros(padded_vocab - full.shape[0], *full.shape[1:])
        return torch.cat([full, pad]).chunk(tp, dim=0)[tp_rank]
    if kind in ("column", "row"):
        return hf[0].chunk(tp, dim=TP_DIM[kind])[tp_rank]
    if kind == "qkv":
        groups = _qkv_groups(*hf, arch)  # [g, rows_per_group, ...]
        mine = groups.chunk(tp, dim=0)[tp_rank]
        return mine.reshape(-1, *groups.shape[2:])
    if kind == "fc1":
        gate, up = hf
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    raise ValueError(f"unknown conversion kind '{kind}'")


def gather_layout(kind: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """TP shards (in rank order) -> the full megatron tensor in TP=1 layout."""
    if kind == "replicated":
        return shards[0]
    if kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=TP_DIM[kind])


def megatron_to_hf(kind: str, full: torch.Tensor, arch: ModelArch) -> list[torch.Tensor]:
    """The HF tensor(s) of one rule from the full (TP=1 layout) megatron tensor."""
    if kind in ("replicated", "column", "row"):
        return [full]
    if kind == "vocab":
        return [full[: arch.vocab_size]]
    if kind == "qkv":
        g, d = arch.num_kv_heads, arch.head_dim
        qpg = arch.num_heads // g
        grouped = full.reshape(g, (qpg + 2) * d, *full.shape[1:])
        q, k, v = grouped.split([qpg * d, d, d], dim=1)
        rest = full.shape[1:]
        return [q.reshape(g * qpg * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)]
    if kind == "fc1":
        gate, up = full.chunk(2, dim=0)
        return [gate, up]
    raise ValueError(f"unknown conversion kind '{kind}'")


# --------------------------------------------------------------------------- reading HF files


class SafetensorsReader:
    """Reads single tensors from an HF directory (one file or an indexed shard set)."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index, encoding="utf-8") as fh:
                self.where = dict(json.load(fh)["weight_map"])
        else:
            single = os.path.join(model_dir, "model.safetensors")
            if not os.path.exists(single):
                raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
            from safetensors import safe_open

            with safe_open(single, "pt") as fh:
                self.where = {name: "model.safetensors" for name in fh.keys()}
        self._open: dict[str, Any] = {}

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise KeyError(f"{self.model_dir}: tensor '{name}' not found in the checkpoint")
        fname = self.where[name]
        if fname not in self._open:
            from safetensors import safe_open

            self._open[fname] = safe_open(os.path.join(self.model_dir, fname), "pt")
        return self._open[fname].get_tensor(name)


def _global_layer(model: torch.nn.Module, local: int) -> int:
    """Megatron numbers layers globally from 1 on every stage (``layer_number``)."""
    return int(model.decoder.layers[local].layer_number) - 1


def _global_expert(model: torch.nn.Module, local_layer: int, local_expert: int) -> int:
    """The global index of expert ``local_expert`` of this rank (megatron's MoELayer)."""
    return int(model.decoder.layers[local_layer].mlp.local_expert_indices[local_expert])


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, model_dir: str, arch: ModelArch, tp_rank: int, tp: int,
                    etp_rank: int | None = None, etp: int | None = None) -> int:
    """Copy this rank's part of every HF tensor into ``model`` (one stage's GPTModel).
    Returns the number of parameter elements loaded; every parameter must be covered.
    Experts are split over the expert tp group (``etp_rank`` of ``etp``; default the tp's)."""
    reader = SafetensorsReader(model_dir)
    padded = model.vocab_size
    loaded = 0
    for name, param in model.named_parameters():
        rule, local = match(name)
        layer = None if local is None else _global_layer(model, local)
        expert = expert_of(name)
        rank, size = (tp_rank, tp) if expert is None or etp is None else (etp_rank, etp)
        if expert is not None:
            expert = _global_expert(model, local, expert)
        hf = [reader.get(n) for n in _hf_names(rule, layer, arch, expert)]
        value = hf_to_megatron(rule.kind, hf, arch, rank, size, padded)
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{name}: converted shape {tuple(value.shape)} != parameter shape {tuple(param.shape)}")
        param.copy_(value)
        loaded += param.numel()
    return loaded


# --------------------------------------------------------------------------- export


def split_buckets(named: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group a stream of named tensors into buckets of about ``bucket_bytes`` each."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: Bucket = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


@dataclass(frozen=True)
class ExportGroups:
    """The process groups export needs, from :mod:`realscale.parallel` (model code never
    asks for ranks itself). ``None`` groups mean a single process."""

    tp_group: Any = None
    pp_group: Any = None
    pp_ranks: tuple[int, ...] = (0,)  # global rank of each pipeline stage (same tp/dp rank)
    pp_rank: int = 0
    is_sender_column: bool = True  # tp_rank == 0 and dp_rank == 0: the ranks that move data to rank 0
    # mixture of experts: experts are gathered over the expert tp group, then each is
    # broadcast from the expert-parallel rank that holds it to the rest of its group
    etp_group: Any = None
    ep_group: Any = None


def _param_plan(arch: ModelArch, pp: int) -> list[tuple[str, int]]:
    """Every megatron parameter (TP=1 names with *global* layer indices) and its stage."""
    per_stage = arch.num_layers // pp
    plan = [("embedding.word_embeddings.weight", 0)]
    layer_params = ["input_layernorm.weight", "self_attention.linear_qkv.weight"]
    if arch.family.qkv_bias:
        layer_params.append("self_attention.linear_qkv.bias")
    if arch.family.qk_norm:
        layer_params += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    layer_params += ["self_attention.linear_proj.weight", "pre_mlp_layernorm.weight"]
    if arch.moe is None:
        layer_params += ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    else:
        layer_params.append("mlp.router.weight")
        for e in range(arch.moe.num_experts):
            layer_params += [f"mlp.experts.local_experts.{e}.linear_fc1.weight",
                             f"mlp.experts.local_experts.{e}.linear_fc2.weight"]
    for layer in range(arch.num_layers):
        plan += [(f"decoder.layers.{layer}.{p}", layer // per_stage) for p in layer_params]
    plan.append(("decoder.final_layernorm.weight", pp - 1))
    if not arch.tie_embeddings:
        plan.append(("output_layer.weight", pp - 1))
    return plan


def local_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This stage's parameters renamed to global layer (and expert) indices and local-spec
    names (the names of :mod:`realscale.parallel.model_spec`)."""
    out = {}
    for name, param in model.named_parameters():
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        if m:
            suffix = m.group(2).replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
            suffix = suffix.replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")
            expert = expert_of(name)
            if expert is not None:
                glob = _global_expert(model, int(m.group(1)), expert)
                suffix = _EXPERT.sub(f".local_experts.{glob}.", "." + suffix, count=1)[1:]
            name = f"decoder.layers.{_global_layer(model, int(m.group(1)))}.{suffix}"
        out[name] = param
    return out


def _expert_broadcast(full: torch.Tensor | None, name: str, arch: ModelArch, model: torch.nn.Module,
                      dtype: torch.dtype, ep_group: Any) -> torch.Tensor:
    """Expert ``name``'s full tensor on every rank of the expert-parallel group, sent by
    the rank that holds it (``full`` there, None elsewhere)."""
    ep = dist.get_world_size(ep_group)
    assert arch.moe is not None
    owner = expert_of(name) // (arch.moe.num_experts // ep)
    backend = group_backend(ep_group)
    if full is None:
        shape = _full_shape(name, arch, model)
        full = comm_empty(math.prod(shape), dtype, backend).view(shape)
    else:
        full = to_comm(full, backend)
    dist.broadcast(full, src=dist.get_process_group_ranks(ep_group)[owner], group=ep_group)
    return full


def _tp_gather(kind: str, shard: torch.Tensor, tp_group: Any) -> torch.Tensor:
    if kind == "replicated" or tp_group is None or dist.get_world_size(tp_group) == 1:
        return gather_layout(kind, [shard])
    backend = group_backend(tp_group)
    shards = [comm_empty(shard.shape, shard.dtype, backend) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(shards, to_comm(shard, backend), group=tp_group)
    return gather_layout(kind, shards)


@torch.no_grad()
def iter_hf_tensors(model: torch.nn.Module, arch: ModelArch, groups: ExportGroups,
                    pp: int = 1, stage_local: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) on global rank 0; every rank of the model must iterate it
    (collectives inside), the others receive nothing.

    ``stage_local``: each pipeline stage's sender-column rank (tp and dp rank 0) yields
    the tensors its own stage holds, gathered over TP only; nothing travels down the
    pipeline (a weight push sends every stage's part from that stage)."""

    local = local_params(model)
    tied_done = False
    for name, stage in _param_plan(arch, pp):
        rule, layer = match(name)
        full: torch.Tensor | None = None
        if stage_local and stage != groups.pp_rank:
            continue
        expert = expert_of(name) is not None
        if stage == groups.pp_rank and name in local:
            tp_group = groups.etp_group if expert else groups.tp_group
            full = _tp_gather(rule.kind, local[name].detach(), tp_group)
        if stage == groups.pp_rank and expert and groups.ep_group is not None:
            full = _expert_broadcast(full, name, arch, model, _dtype(local), groups.ep_group)
        if pp > 1 and groups.is_sender_column and not stage_local:
            # the stage that owns the tensor sends it down the pipeline column to stage 0;
            # both ends' tensors on the device the group's backend needs (NCCL: this GPU)
            backend = group_backend(groups.pp_group)
            if full is None:
                full = comm_empty(math.prod(_full_shape(name, arch, model)), _dtype(local),
                                  backend).view(_full_shape(name, arch, model))
            else:
                full = to_comm(full, backend)
            if stage != 0:
                dist.broadcast(full, src=groups.pp_ranks[stage], group=groups.pp_group)
        if not groups.is_sender_column or (groups.pp_rank != 0 and not stage_local):
            continue
        assert full is not None
        hf_names = _hf_names(rule, layer, arch, expert_of(name))
        if rule.kind == "vocab" and arch.tie_embeddings:
            if tied_done:
                continue
            tied_done = True
        for hf_name, tensor in zip(hf_names, megatron_to_hf(rule.kind, full, arch)):
            yield hf_name, tensor.contiguous()


def _dtype(local: dict[str, torch.Tensor]) -> torch.dtype:
    return next(iter(local.values())).dtype


def _full_shape(name: str, arch: ModelArch, model: torch.nn.Module) -> tuple[int, ...]:
    """Shape of a parameter in TP=1 layout, computable on every stage."""
    h = arch.hidden_size
    padded = model.vocab_size  # already padded for this TP degree
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return (padded, h)
    if name.endswith(("layernorm.weight", "final_layernorm.weight")):
        if "q_layernorm" in name or "k_layernorm" in name:
            return (arch.head_dim,)
        return (h,)
    if name.endswith("linear_qkv.weight"):
        return (arch.qkv_rows, h)
    if name.endswith("linear_qkv.bias"):
        return (arch.qkv_rows,)
    if name.endswith("linear_proj.weight"):
        return (h, arch.num_heads * arch.head_dim)
    ffn = arch.ffn_hidden_size
    if arch.moe is not None:
        if name.endswith("router.weight"):
            return (arch.moe.num_experts, h)
        ffn = arch.moe.ffn_hidden_size
    if name.endswith("linear_fc1.weight"):
        return (2 * ffn, h)
    if name.endswith("linear_fc2.weight"):
        return (h, ffn)
    raise KeyError(f"no shape rule for '{name}'")


def export_hf_weights(model: torch.nn.Module, arch: ModelArch, groups: ExportGroups, pp: int = 1,
                      bucket_bytes: int = 512 << 20,
                      cast: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      stage_local: bool = False) -> Iterator[Bucket]:
    """HF-named full tensors in buckets of about ``bucket_bytes``, yielded on global rank 0
    (``stage_local``: each stage's own, on its sender-column rank; :func:`iter_hf_tensors`)."""
    stream = iter_hf_tensors(model, arch, groups, pp, stage_local)
    if cast is not None:
        stream = ((n, cast(t)) for n, t in stream)
    return split_buckets(stream, bucket_bytes)


def save_hf(buckets: Iterator[Bucket], out_dir: str, hf_config: dict[str, Any],
            max_shard_bytes: int = 2 << 30) -> list[str]:
    """Write buckets as an HF safetensors directory (sharded with an index when large)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    files: list[str] = []
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal shard, size
        if not shard:
            return
        fname = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({k: fname for k in shard})
        shard, size = {}, 0

    for bucket in buckets:
        for name, tensor in bucket:
            nbytes = tensor.numel() * tensor.element_size()
            if shard and size + nbytes > max_shard_bytes:
                flush()
            shard[name] = tensor.clone()
            size += nbytes
    flush()
    if len(files) == 1:
        os.replace(os.path.join(out_dir, files[0]), os.path.join(out_dir, "model.safetensors"))
        files = ["model.safetensors"]
    else:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as fh:
            json.dump({"metadata": {}, "weight_map": weight_map}, fh, indent=1)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(hf_config, fh, indent=1)
    return files

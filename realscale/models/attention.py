"""Packed-sequence attention for megatron's local layer spec (no Transformer Engine).

Megatron's local ``DotProductAttention`` refuses packed sequences (``packed_seq_params``
must be None, megatron/core/transformer/dot_product_attention.py:153 in megatron-core
0.16.1), so a packed micro-batch used to reach it as one row with a dense block-causal
``[T, T]`` mask: scores for every pair of tokens in the row, almost all of them masked
out. A default-recipe micro-batch holds ~30 answers of ~18 tokens in a 512-token row, so
96% of that work was thrown away, and attention was ~40% of a training step on CPU.

:class:`PackedSDPAttention` takes megatron's own packed contract instead (THD:
``query [t, heads, d]`` and ``cu_seqlens``, exactly what the TE spec receives, so the
engine builds one kind of micro-batch for both specs) and computes attention per
sequence with ``torch.nn.functional.scaled_dot_product_attention`` (causal, grouped
query heads natively): sequences are sorted by length and cut into a few groups whose
lengths are within 2x of each other; each group is padded to its longest member and runs
as one batched call. Padding costs at most 4x a group's exact work, and a padded key
sits after every real one, so the causal mask alone keeps real queries off it. The same
code runs on GPUs without Transformer Engine (SDPA's flash / memory-efficient kernels),
where the dense mask needed ``[heads, T, T]`` scores per layer.

Which rows each group reads and writes (:class:`AttentionPlan`) depends only on the
micro-batch, so the engine builds it on the host once and moves it to the device once
(:class:`PlannedPackedParams`); each layer then only launches kernels. Built per layer
from device-side ``cu_seqlens`` it cost, on a GPU, a ``.tolist()`` and several host
copies per layer, each a wait for the stream (not measured here: no GPU ran it).

Departures from ``DotProductAttention``: no ``attention_bias``, no learned softmax
offset (sinks) and no query-key layer scaling (none of the families we load use them;
each is refused by name), and softmax runs in SDPA's precision (fp32 accumulation) rather
than an explicit fp32 upcast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from realscale.models.shared_prefix import SharedRows

# A sequence joins the current group while it is at least this fraction of the group's longest.
GROUP_RATIO = 0.5


def length_groups(lengths: list[int], ratio: float = GROUP_RATIO) -> list[list[int]]:
    """Sequence indices grouped for padded batching: longest first, a new group whenever a
    sequence is shorter than ``ratio`` of its group's longest (so padding at most
    ``1/ratio^2`` times a group's exact attention work)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if lengths[i] == 0:
            continue
        if groups and lengths[i] >= ratio * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass(frozen=True)
class AttentionGroup:
    """One batched SDPA call of a plan: ``index [g, L]`` the row of each (sequence, offset)
    (a padded slot points at its sequence's last token: it sits after every real key, so
    the causal mask hides it, and it is never read back), and the outputs written back:
    slot ``src [w]`` of the flattened ``[g * L]`` into row ``dest [w]``."""

    index: torch.Tensor
    src: torch.Tensor
    dest: torch.Tensor


@dataclass(frozen=True)
class AttentionPlan:
    """Which rows each batched attention call reads and writes, for a packed row of
    ``rows`` positions: built on the host once per micro-batch and moved to the device once
    (:meth:`to`), so that no layer copies indices to the GPU or reads a device tensor back
    (each ``.to(cuda)`` of a pageable host tensor and each ``.tolist()`` of a CUDA tensor
    waits for the stream: dozens of stalls per layer otherwise)."""

    rows: int
    groups: tuple[AttentionGroup, ...]

    def to(self, device: torch.device | str) -> "AttentionPlan":
        device = torch.device(device)
        if device.type == "cpu":
            return self
        # on CUDA from pinned memory, so the copies queue behind the stream's work instead
        # of waiting for it
        pinned = device.type == "cuda"
        move = lambda x: x.pin_memory().to(device, non_blocking=True) if pinned else x.to(device)  # noqa: E731
        return AttentionPlan(self.rows, tuple(AttentionGroup(move(g.index), move(g.src), move(g.dest))
                                              for g in self.groups))


def attention_plan(cu_seqlens: torch.Tensor, rows: int, shared: SharedRows | None = None) -> AttentionPlan:
    """The plan (on the host) for ``rows`` packed positions split by ``cu_seqlens`` [n + 1],
    or laid out by ``shared`` (:mod:`realscale.models.shared_prefix`; ``cu_seqlens`` is then
    ``[0, rows]``, or ``[0, r, rows]`` when sequence parallelism pads the ``r`` layout rows
    with a sequence of its own). Sequences are grouped by length (:func:`length_groups`)."""
    cu = cu_seqlens.detach().cpu().tolist()
    if cu[-1] != rows:
        raise ValueError(f"cu_seqlens ends at {cu[-1]}, the packed row has {rows} tokens")
    if shared is None:
        token_rows = torch.arange(rows)
        starts, lengths, owned_from = cu[:-1], [b - a for a, b in zip(cu[:-1], cu[1:])], [0] * (len(cu) - 1)
    else:
        r = shared.num_rows
        if r > rows:
            raise ValueError(f"the shared-prefix layout has {r} rows, the packed row only {rows}")
        token_rows = shared.token_rows.cpu()
        starts, lengths, owned_from = shared.seq_start.tolist(), shared.seq_len.tolist(), shared.seq_shared.tolist()
        if r < rows:  # sequence parallelism's padding: one more sequence, after the layout's rows
            starts.append(token_rows.numel())
            lengths.append(rows - r)
            owned_from.append(0)
            token_rows = torch.cat([token_rows, torch.arange(r, rows)])
    groups = []
    for group in length_groups(lengths):
        longest = lengths[group[0]]
        offsets = torch.arange(longest)
        first = torch.tensor([starts[i] for i in group])
        size = torch.tensor([lengths[i] for i in group])
        index = token_rows[first[:, None] + torch.minimum(offsets[None, :], size[:, None] - 1)]  # [g, L]
        own = torch.tensor([owned_from[i] for i in group])
        written = (offsets[None, :] < size[:, None]) & (offsets[None, :] >= own[:, None])
        groups.append(AttentionGroup(index, written.flatten().nonzero().flatten(), index[written]))
    return AttentionPlan(rows, tuple(groups))


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                            scale: float, dropout_p: float = 0.0, shared: SharedRows | None = None,
                            plan: AttentionPlan | None = None) -> torch.Tensor:
    """Causal attention within each packed sequence. ``query [t, hq, d]``, ``key``/``value``
    ``[t, hk, d]`` (``hq`` a multiple of ``hk``), ``cu_seqlens [n + 1]`` (int); returns
    ``[t, hq, d]``. With ``shared`` the ``t`` rows are a shared-prefix layout
    (:mod:`realscale.models.shared_prefix`; ``cu_seqlens`` is then ``[0, t]``): each
    sequence attends over the rows of all its tokens and writes back the rows it owns.
    ``plan``: :func:`attention_plan` of these, already on the query's device (else built
    here). A pure tensor function: the tests compare it with per-sequence attention."""
    t, hq, _ = query.shape
    if plan is None:
        plan = attention_plan(cu_seqlens, t, shared).to(query.device)
    elif plan.rows != t:
        raise ValueError(f"the attention plan is for {plan.rows} rows, the packed row has {t}")
    out = query.new_empty(t, hq, value.shape[-1])
    for grp in plan.groups:
        q = query[grp.index].transpose(1, 2)  # [g, hq, L, d]
        k = key[grp.index].transpose(1, 2)
        v = value[grp.index].transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                           enable_gqa=hq != key.shape[1]).transpose(1, 2)  # [g, L, hq, d]
        out[grp.dest] = o.reshape(-1, hq, o.shape[-1])[grp.src]
    return out


@dataclass
class PlannedPackedParams(PackedSeqParams):
    """Megatron's packed-row description with the attention plan :class:`PackedSDPAttention`
    runs (already on the device: built once per micro-batch, from a shared-prefix layout
    where there is one, read by every layer). For RoPE the engine hands megatron the row as
    one THD sequence (``*_padded``)."""

    plan: AttentionPlan | None = None


class PackedSDPAttention(DotProductAttention):
    """``DotProductAttention`` that also takes THD packed sequences (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for refused, why in ((self.softmax_offset is not None, "a learned softmax offset (attention sinks)"),
                             (self.config.apply_query_key_layer_scaling, "query-key layer scaling")):
            if refused:
                raise ValueError(f"PackedSDPAttention does not implement {why}; use the Transformer Engine spec")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, None)
        if packed_seq_params.qkv_format != "thd" or attention_bias is not None or attention_mask is not None:
            raise ValueError("PackedSDPAttention takes THD packed sequences with neither a mask nor a bias "
                             f"(got qkv_format={packed_seq_params.qkv_format!r})")
        cu = packed_seq_params.cu_seqlens_q
        plan = getattr(packed_seq_params, "plan", None)  # (the engine's: queries and keys packed alike)
        if plan is None and packed_seq_params.cu_seqlens_kv is not None and not torch.equal(
                packed_seq_params.cu_seqlens_kv, cu):
            raise ValueError("PackedSDPAttention needs the same packing for queries and keys")
        p = self.attention_dropout.p if self.training else 0.0
        out = packed_causal_attention(query, key, value, cu, self.softmax_scale, p, plan=plan)
        return out.reshape(out.shape[0], -1)  # [t, hq * d]: the attention module restores [t, 1, h]

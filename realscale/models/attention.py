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


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                            scale: float, dropout_p: float = 0.0, shared: SharedRows | None = None) -> torch.Tensor:
    """Causal attention within each packed sequence. ``query [t, hq, d]``, ``key``/``value``
    ``[t, hk, d]`` (``hq`` a multiple of ``hk``), ``cu_seqlens [n + 1]`` (int); returns
    ``[t, hq, d]``. With ``shared`` the ``t`` rows are a shared-prefix layout
    (:mod:`realscale.models.shared_prefix`; ``cu_seqlens`` is then ``[0, t]``): each
    sequence attends over the rows of all its tokens and writes back the rows it owns. A
    pure tensor function: the tests compare it with per-sequence attention."""
    t, hq, d = query.shape
    hk = key.shape[1]
    if int(cu_seqlens[-1]) != t:
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])}, the packed row has {t} tokens")
    if shared is None:
        rows = torch.arange(t, device=query.device)
        starts, lengths = cu_seqlens[:-1].tolist(), (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        owned_from = [0] * len(lengths)
    else:
        if shared.num_rows > t:
            raise ValueError(f"the shared-prefix layout has {shared.num_rows} rows, the packed row only {t}")
        if shared.num_rows < t:  # sequence parallelism's padding: one more sequence, after the layout's rows
            r = shared.num_rows
            whole = lambda n: torch.tensor([0, n], device=cu_seqlens.device)  # noqa: E731
            return torch.cat([
                packed_causal_attention(query[:r], key[:r], value[:r], whole(r), scale, dropout_p, shared),
                packed_causal_attention(query[r:], key[r:], value[r:], whole(t - r), scale, dropout_p)])
        rows = shared.token_rows.to(query.device)
        starts, lengths, owned_from = shared.seq_start.tolist(), shared.seq_len.tolist(), shared.seq_shared.tolist()
    out = query.new_empty(t, hq, value.shape[-1])
    for group in length_groups(lengths):
        longest = lengths[group[0]]
        # row of (sequence, offset); padded slots point at the sequence's last token and are
        # never read back (they sit after every real key, so the causal mask hides them)
        offsets = torch.arange(longest, device=query.device)
        first = torch.tensor([starts[i] for i in group], device=query.device)
        size = torch.tensor([lengths[i] for i in group], device=query.device)
        index = rows[first[:, None] + torch.minimum(offsets[None, :], size[:, None] - 1)]  # [g, L]
        q = query[index].transpose(1, 2)  # [g, hq, L, d]
        k = key[index].transpose(1, 2)
        v = value[index].transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                           enable_gqa=hq != hk).transpose(1, 2)  # [g, L, hq, d]
        own = torch.tensor([owned_from[i] for i in group], device=query.device)
        written = (offsets[None, :] < size[:, None]) & (offsets[None, :] >= own[:, None])
        out[index[written]] = o[written]
    return out


@dataclass
class SharedPrefixParams(PackedSeqParams):
    """Megatron's packed-row description with a shared-prefix layout attached: the row is one
    THD sequence (for RoPE, which the engine feeds per-row positions) whose attention
    :class:`PackedSDPAttention` runs per sequence of ``shared``."""

    shared: SharedRows | None = None


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
        if packed_seq_params.cu_seqlens_kv is not None and not torch.equal(packed_seq_params.cu_seqlens_kv, cu):
            raise ValueError("PackedSDPAttention needs the same packing for queries and keys")
        p = self.attention_dropout.p if self.training else 0.0
        out = packed_causal_attention(query, key, value, cu, self.softmax_scale, p,
                                      getattr(packed_seq_params, "shared", None))
        return out.reshape(out.shape[0], -1)  # [t, hq * d]: the attention module restores [t, 1, h]

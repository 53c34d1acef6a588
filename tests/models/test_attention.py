"""Packed-sequence attention for the local layer spec (realscale/models/attention.py).

Megatron's own local ``DotProductAttention`` refuses packed sequences
(megatron/core/transformer/dot_product_attention.py:153, megatron-core 0.16.1: "Packed
sequence is not supported by DotProductAttention"), and its THD contract for the TE spec
is ``query [t, heads, d]`` with ``cu_seqlens`` (megatron/core/transformer/attention.py:
1066-1069 squeezes the batch dimension, 1189-1194 restores ``[t, 1, h]``). These tests
hold our module to per-sequence causal attention under that contract.
"""

from __future__ import annotations

import math

import pytest
import torch

from realscale.models.attention import length_groups, packed_causal_attention


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """Each sequence on its own: plain causal softmax attention, kv heads repeated."""
    rep = q.shape[1] // k.shape[1]
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        if a == b:
            continue
        qq = q[a:b].transpose(0, 1)
        kk = k[a:b].repeat_interleave(rep, 1).transpose(0, 1)
        vv = v[a:b].repeat_interleave(rep, 1).transpose(0, 1)
        s = qq @ kk.transpose(1, 2) / math.sqrt(q.shape[-1])
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        out.append((s.softmax(-1) @ vv).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("lengths,hq,hk", [([5, 17, 1, 9, 40, 33, 2], 4, 2), ([7], 2, 2), ([3, 0, 64, 64, 1], 6, 1)])
def test_equals_attention_within_each_sequence_values_and_gradients(lengths, hq, hk) -> None:
    g = torch.Generator().manual_seed(0)
    cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
    t, d = cu[-1], 8
    q, k, v = (torch.randn(t, h, d, generator=g, dtype=torch.float64, requires_grad=True) for h in (hq, hk, hk))
    got = packed_causal_attention(q, k, v, torch.tensor(cu), 1 / math.sqrt(d))
    want = _reference(q, k, v, cu)
    assert got.shape == (t, hq, d)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    weights = torch.randn(t, hq, d, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((got * weights).sum(), (q, k, v)),
                    torch.autograd.grad((want * weights).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_a_token_never_sees_another_sequence() -> None:
    """Changing one sequence's keys and values changes no other sequence's output."""
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 6, 10, 25])
    q, k, v = (torch.randn(25, 2, 4, generator=g) for _ in range(3))
    before = packed_causal_attention(q, k, v, cu, 0.5)
    k2, v2 = k.clone(), v.clone()
    k2[6:10] += 3.0
    v2[6:10] -= 3.0
    after = packed_causal_attention(q, k2, v2, cu, 0.5)
    assert torch.equal(before[:6], after[:6]) and torch.equal(before[10:], after[10:])
    assert not torch.allclose(before[6:10], after[6:10])


def test_groups_bound_the_padding() -> None:
    lengths = [512, 3, 300, 260, 17, 9, 8, 1, 140, 0]
    groups = length_groups(lengths)
    assert sorted(i for grp in groups for i in grp) == [i for i, n in enumerate(lengths) if n]
    for grp in groups:
        longest = max(lengths[i] for i in grp)
        assert all(lengths[i] >= longest / 2 for i in grp)  # padded work <= 4x the exact work
    assert len(groups) <= math.ceil(math.log2(512)) + 1


def test_bad_packing_is_refused() -> None:
    q = torch.zeros(10, 2, 4)
    with pytest.raises(ValueError, match="cu_seqlens ends at 9, the packed row has 10 tokens"):
        packed_causal_attention(q, q, q, torch.tensor([0, 4, 9]), 0.5)


def test_the_local_spec_takes_packed_sequences() -> None:
    """The engine hands both specs THD micro-batches; the local spec's core attention must
    be ours (megatron's would assert on them)."""
    from realscale.models.attention import PackedSDPAttention
    from realscale.models.family import load_arch
    from realscale.models.megatron_gpt import layer_spec
    from realscale.models.tiny import resolve_model_path

    arch = load_arch(resolve_model_path("tiny-qwen2"))
    spec = layer_spec(arch, use_te=False)
    assert spec.submodules.self_attention.submodules.core_attention is PackedSDPAttention

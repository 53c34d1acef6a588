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

from realscale.models.attention import attention_plan, length_groups, packed_causal_attention


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


def test_with_its_plan_on_the_device_no_layer_reads_or_copies_from_the_host() -> None:
    """The engine builds the plan once per micro-batch and moves it to the device; a layer
    then neither copies an index from the host (a wait for the stream on CUDA, from
    pageable memory) nor reads one back (``.tolist()``/``int()`` of a CUDA tensor: a sync).
    Run on the meta device, where either would raise or show as an op touching a host
    tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class HostOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
            out = func(*args, **(kwargs or {}))
            tensors = [x for x in tree_flatten((args, kwargs, out))[0] if isinstance(x, torch.Tensor)]
            if any(x.device.type == "cpu" for x in tensors):
                self.seen.append(str(func))
            return out

    cu = torch.tensor([0, 5, 22, 23, 40, 41])
    plan = attention_plan(cu, 41).to("meta")
    assert all(x.device.type == "meta" for g in plan.groups for x in (g.index, g.src, g.dest))
    q, k = torch.empty(41, 4, 8, device="meta"), torch.empty(41, 2, 8, device="meta")
    cu_dev = cu.to("meta")
    with HostOps() as ops:
        out = packed_causal_attention(q, k, k, cu_dev, 0.5, plan=plan)
    assert out.shape == (41, 4, 8) and ops.seen == []
    with pytest.raises(ValueError, match="plan is for 41 rows, the packed row has 40"):
        packed_causal_attention(q[:40], k[:40], k[:40], cu_dev, 0.5, plan=plan)


@pytest.mark.parametrize("shared", [False, True])
def test_the_engine_builds_the_plan_once_on_the_host_and_moves_it(shared: bool) -> None:
    """``MegatronEngine._packed_params`` on the local spec: the boundaries megatron's RoPE
    reads back as ints (rope_utils.py:204 ``.tolist()``, 218 ``.item()``, megatron-core
    0.16.1) stay on the host, the plan goes to the device (``meta`` here, as the GPU)."""
    from types import SimpleNamespace

    from realscale.models.attention import PlannedPackedParams
    from realscale.models.shared_prefix import share_prefixes
    from realscale.train.engine import MegatronEngine

    ids = torch.tensor([1, 2, 3, 4, 1, 2, 3, 5, 7, 8])
    cu = torch.tensor([0, 4, 8, 10])
    layout = share_prefixes(ids, cu) if shared else None
    row_cu = torch.tensor([0, layout.num_rows]) if layout is not None else cu
    fake = SimpleNamespace(use_te=False, device=torch.device("meta"))
    params = MegatronEngine._packed_params(fake, row_cu, layout)
    assert isinstance(params, PlannedPackedParams)
    on_host = MegatronEngine._packed_params(SimpleNamespace(use_te=False, device=torch.device("cpu")), row_cu, layout)
    want = attention_plan(row_cu, int(row_cu[-1]), layout)  # built from the layout, where there is one
    assert [[x.tolist() for x in (g.index, g.src, g.dest)] for g in on_host.plan.groups] == [
        [x.tolist() for x in (g.index, g.src, g.dest)] for g in want.groups]
    for host in (params.cu_seqlens_q, params.cu_seqlens_kv, params.cu_seqlens_q_padded, params.cu_seqlens_kv_padded):
        assert host.device.type == "cpu"
    assert params.plan.rows == int(row_cu[-1]) == params.max_seqlen_q
    assert {x.device.type for g in params.plan.groups for x in (g.index, g.src, g.dest)} == {"meta"}
    te = MegatronEngine._packed_params(SimpleNamespace(use_te=True, device=torch.device("meta")), cu)
    assert te.cu_seqlens_q.device.type == "meta" and te.max_seqlen_q == 4  # TE's kernels read them on the device


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

"""GAE: hand values, and the C++ kernel == vectorised torch == Python loop on random packs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from realscale import kernels
from realscale.algo.gae import gae, gae_reference, gae_torch

IMPLS = [gae, gae_torch, gae_reference]
needs_kernel = pytest.mark.skipif(kernels.load("gae") is None, reason="csrc/gae.cpp not built")

R = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
V = torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64)
CU = torch.tensor([0, 3])


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_values(impl):
    # t2: delta = 1 - .5 = .5; t1: delta = .9*.5 - .5 = -.05, A = -.05 + .72*.5 = .31;
    # t0: A = -.05 + .72*.31 = .1732.
    adv, ret = impl(R, V, CU, 0.9, 0.8)
    torch.testing.assert_close(adv, torch.tensor([0.1732, 0.31, 0.5], dtype=torch.float64))
    torch.testing.assert_close(ret, adv + 0.5)


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_values_with_mask_and_bootstrap(impl):
    mask = torch.tensor([True, False, True])
    # Masked t1 is skipped: t0's next value is t2's. With bootstrap 1 after the end:
    # t2: delta = 1 + .9*1 - .5 = 1.4; t0: delta = .9*.5 - .5 = -.05, A = -.05 + .72*1.4.
    adv, ret = impl(R, V, CU, 0.9, 0.8, mask=mask, bootstrap=torch.tensor([1.0], dtype=torch.float64))
    torch.testing.assert_close(adv, torch.tensor([-0.05 + 0.72 * 1.4, 0.0, 1.4], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([-0.05 + 0.72 * 1.4 + 0.5, 0.0, 1.9], dtype=torch.float64))


@pytest.mark.parametrize("impl", IMPLS)
def test_sequences_do_not_leak_into_each_other(impl):
    r = torch.tensor([1.0, 2.0, 3.0, 4.0])
    v = torch.zeros(4)
    adv, _ = impl(r, v, torch.tensor([0, 2, 2, 4]), 1.0, 1.0)  # an empty sequence in the middle
    torch.testing.assert_close(adv, torch.tensor([3.0, 2.0, 7.0, 4.0]))


@st.composite
def packs(draw):
    lengths = draw(st.lists(st.integers(0, 40), min_size=0, max_size=12))
    n = sum(lengths)
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    r = torch.randn(n, generator=g).to(dtype)
    v = torch.randn(n, generator=g).to(dtype)
    cu = torch.tensor([0] + lengths).cumsum(0)
    mask = torch.rand(n, generator=g) > draw(st.sampled_from([0.0, 0.3, 0.9])) if draw(st.booleans()) else None
    boot = torch.randn(len(lengths), generator=g).to(dtype) if draw(st.booleans()) else None
    gamma = draw(st.sampled_from([0.0, 0.5, 0.99, 1.0]) | st.floats(0, 1))
    lam = draw(st.sampled_from([0.0, 0.95, 1.0]) | st.floats(0, 1))
    return r, v, cu, gamma, lam, mask, boot


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)


@settings(max_examples=150, deadline=None)
@given(packs())
def test_torch_scan_matches_reference(pack):
    r, v, cu, gamma, lam, mask, boot = pack
    ref = gae_reference(r, v, cu, gamma, lam, mask=mask, bootstrap=boot)
    out = gae_torch(r, v, cu, gamma, lam, mask=mask, bootstrap=boot)
    torch.testing.assert_close(out[0], ref[0], **_tol(r.dtype))
    torch.testing.assert_close(out[1], ref[1], **_tol(r.dtype))


@needs_kernel
@settings(max_examples=150, deadline=None)
@given(packs())
def test_kernel_matches_reference(pack):
    r, v, cu, gamma, lam, mask, boot = pack
    ref = gae_reference(r, v, cu, gamma, lam, mask=mask, bootstrap=boot)
    out = gae(r, v, cu, gamma, lam, mask=mask, bootstrap=boot)
    assert out[0].dtype == r.dtype
    # Both accumulate in float64; the kernel rounds once at the end, like the reference.
    torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-6, atol=1e-6)


@needs_kernel
def test_kernel_multithreaded_split_on_a_large_long_tailed_pack():
    # > 64k tokens, so the kernel splits the pack across threads by tokens.
    g = torch.Generator().manual_seed(0)
    lengths = torch.distributions.LogNormal(6.0, 1.0).sample((300,)).long().clamp(1, 20000)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    n = int(cu[-1])
    assert n > 1 << 16
    r, v = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) > 0.1
    for kw in ({}, {"mask": mask}):
        ker = gae(r, v, cu, 0.99, 0.95, **kw)
        ref = gae_torch(r, v, cu, 0.99, 0.95, **kw)
        torch.testing.assert_close(ker[0], ref[0])
        torch.testing.assert_close(ker[1], ref[1])


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_inputs_are_named(impl):
    r, v = torch.zeros(4), torch.zeros(4)
    cu = torch.tensor([0, 4])
    cases = [
        ((r, v[:3], cu, 1.0, 1.0), {}, "values: expected 4"),
        ((r, v, torch.tensor([0, 3]), 1.0, 1.0), {}, "cu_seqlens: last offset 3"),
        ((r, v, torch.tensor([0, 3, 2, 4]), 1.0, 1.0), {}, r"cu_seqlens: offsets must not decrease"),
        ((r, v, torch.tensor([1, 4]), 1.0, 1.0), {}, "cu_seqlens: must start at 0"),
        ((r, v, cu, 1.5, 1.0), {}, r"gamma: must lie in \[0, 1\]"),
        ((r, v, cu, 1.0, -0.1), {}, r"lam: must lie in \[0, 1\]"),
        ((r, v, cu, 1.0, 1.0), {"bootstrap": torch.zeros(2)}, "bootstrap: expected 1"),
        ((r, v, cu, 1.0, 1.0), {"mask": torch.ones(3, dtype=torch.bool)}, "mask: expected 4"),
        ((r.view(2, 2), v.view(2, 2), cu, 1.0, 1.0), {}, "rewards: expected a 1-D"),
    ]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            impl(*args, **kw)
    with pytest.raises(TypeError, match="values: dtype"):
        impl(r, v.double(), cu, 1.0, 1.0)


@needs_kernel
def test_kernel_checks_its_own_inputs():
    mod = kernels.load("gae")
    with pytest.raises(RuntimeError, match="cu_seqlens\\[-1\\]"):
        mod.gae(torch.zeros(4), torch.zeros(4), torch.tensor([0, 3]), 1.0, 1.0, None, None)


@pytest.mark.gpu
@settings(max_examples=50, deadline=None)
@given(packs())
def test_cuda_kernel_matches_reference(pack):
    r, v, cu, gamma, lam, mask, boot = pack
    assert kernels.load("gae", cuda=True) is not None, "csrc/cuda/gae.cu not built on this CUDA machine"
    ref = gae_reference(r, v, cu, gamma, lam, mask=mask, bootstrap=boot)
    out = gae(r.cuda(), v.cuda(), cu.cuda(), gamma, lam, mask=None if mask is None else mask.cuda(),
              bootstrap=None if boot is None else boot.cuda())
    torch.testing.assert_close(out[0].cpu(), ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[1].cpu(), ref[1], rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_torch_scan_on_cuda_matches_reference():
    g = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 100, 100, 1000, 1300])
    r, v = torch.randn(1300, generator=g), torch.randn(1300, generator=g)
    ref = gae_reference(r, v, cu, 0.99, 0.95)
    out = gae_torch(r.cuda(), v.cuda(), cu.cuda(), 0.99, 0.95)
    torch.testing.assert_close(out[0].cpu(), ref[0], rtol=1e-5, atol=1e-5)

"""The PPO loss against hand-computed values, a naive autograd version, and gradcheck."""

from __future__ import annotations

import math

import pytest
import torch

from realscale.algo.kl import kl_penalty
from realscale.algo.losses import loss_kwargs_from_config, loss_normalizer, ppo_loss
from realscale.config import AlgoConfig

# Six tokens in two sequences; token 5 is masked out (garbage there must not leak in).
# With logp_prox = 0, r = exp(logp). Per token (eps 0.2 / eps_high 0.28):
#   t0 r=1.5 A=+1: max(-1.5, -1.28) = -1.28  clipped
#   t1 r=0.5 A=+1: max(-0.5, -0.8)  = -0.5   gradient -A r = -0.5
#   t2 r=0.5 A=-2: max(1.0, 1.6)    = 1.6    clipped
#   t3 r=1.1 A=-1: max(1.1, 1.1)    = 1.1    gradient 1.1
#   t4 r=3.0 A=-1: max(3.0, 1.28)   = 3.0    gradient 3.0; dual clip c=2 bounds it at 2
R = [1.5, 0.5, 0.5, 1.1, 3.0, 100.0]
A = [1.0, 1.0, -2.0, -1.0, -1.0, 5.0]
MASK = [1, 1, 1, 1, 1, 0]
CU = [0, 2, 6]


def _inputs(dtype=torch.float64):
    logp = torch.tensor([math.log(x) for x in R], dtype=dtype, requires_grad=True)
    zeros = torch.zeros(6, dtype=dtype)
    return logp, zeros, torch.tensor(A, dtype=dtype), torch.tensor(MASK, dtype=torch.bool)


def test_standard_ppo_hand_values_and_gradient():
    logp, prox, adv, mask = _inputs()
    loss, stats = ppo_loss(logp, prox, adv, mask, eps_clip=0.2, eps_clip_high=0.28)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 1.6 + 1.1 + 3.0) / 5)
    loss.backward()
    expected = torch.tensor([0.0, -0.5, 0.0, 1.1, 3.0, 0.0], dtype=torch.float64) / 5
    torch.testing.assert_close(logp.grad, expected)
    assert stats["clip_frac"].item() == pytest.approx(2 / 5)
    assert stats["dual_clip_frac"].item() == 0.0
    assert stats["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 0.5 + 1.1 + 3.0) / 5)
    assert stats["n_tokens"].item() == 5


def test_dual_clip_hand_values():
    logp, prox, adv, mask = _inputs()
    loss, stats = ppo_loss(logp, prox, adv, mask, eps_clip=0.2, eps_clip_high=0.28, dual_clip=2.0)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 1.6 + 1.1 + 2.0) / 5)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -0.5, 0.0, 1.1, 0.0, 0.0], dtype=torch.float64) / 5)
    assert stats["dual_clip_frac"].item() == pytest.approx(1 / 5)
    assert stats["clip_frac"].item() == pytest.approx(2 / 5)


def test_symmetric_clip_is_the_default():
    logp, prox, adv, mask = _inputs()
    loss, _ = ppo_loss(logp, prox, adv, mask, eps_clip=0.2)
    # t0 is now clipped at 1.2 instead of 1.28.
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.6 + 1.1 + 3.0) / 5)


def _decoupled_inputs():
    logp, prox, adv, mask = _inputs()
    w = torch.tensor([1.0, 2.0, 0.5, 1.0, 1.0, 7.0], dtype=torch.float64)  # t5 masked: ignored
    behav = prox - w.log()
    return logp, prox, behav, adv, mask


@pytest.mark.parametrize("cap,mode,expected,capped", [
    (0.0, "mask", (-1.28 - 2 * 0.5 + 0.5 * 1.6 + 1.1 + 3.0) / 5, 0.0),
    (1.5, "mask", (-1.28 + 0.5 * 1.6 + 1.1 + 3.0) / 5, 1 / 5),  # t1 dropped, denominator kept
    (1.5, "clamp", (-1.28 - 1.5 * 0.5 + 0.5 * 1.6 + 1.1 + 3.0) / 5, 1 / 5),
])
def test_decoupled_behaviour_weight_and_cap(cap, mode, expected, capped):
    logp, prox, behav, adv, mask = _decoupled_inputs()
    loss, stats = ppo_loss(logp, behav, adv, mask, logp_prox=prox, eps_clip=0.2, eps_clip_high=0.28,
                           imp_weight_cap=cap, imp_weight_mode=mode)
    assert loss.item() == pytest.approx(expected)
    assert stats["behav_capped_frac"].item() == pytest.approx(capped)
    loss.backward()
    w_used = {0.0: 2.0, 1.5: 0.0 if mode == "mask" else 1.5}[cap]
    assert logp.grad[1].item() == pytest.approx(-0.5 * w_used / 5)
    assert logp.grad[4].item() == pytest.approx(3.0 / 5)


def test_decoupled_with_prox_equal_behav_is_standard_ppo_exactly():
    g = torch.Generator().manual_seed(0)
    n = 4000
    logp = (torch.randn(n, generator=g) * 0.1 - 1).requires_grad_()
    behav = logp.detach() + torch.randn(n, generator=g) * 0.2
    adv = torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) > 0.2
    cu = torch.tensor([0, 1000, 2500, 4000])
    for agg in ("token_mean", "seq_mean_token_mean"):
        kw = dict(eps_clip=0.2, eps_clip_high=0.3, dual_clip=3.0, agg=agg, cu_seqlens=cu)
        l_std, _ = ppo_loss(logp, behav, adv, mask, **kw)
        (g_std,) = torch.autograd.grad(l_std, logp)
        l_dec, stats = ppo_loss(logp, behav, adv, mask, logp_prox=behav.clone(), imp_weight_cap=5.0, **kw)
        (g_dec,) = torch.autograd.grad(l_dec, logp)
        assert torch.equal(l_std, l_dec)
        assert torch.equal(g_std, g_dec)
        assert stats["behav_imp_weight_mean"].item() == pytest.approx(1.0)


def test_seq_mean_token_mean_hand_value():
    logp, prox, adv, mask = _inputs()
    loss, _ = ppo_loss(logp, prox, adv, mask, eps_clip=0.2, eps_clip_high=0.28, agg="seq_mean_token_mean",
                       cu_seqlens=torch.tensor(CU))
    seq0 = (-1.28 - 0.5) / 2
    seq1 = (1.6 + 1.1 + 3.0) / 3
    assert loss.item() == pytest.approx((seq0 + seq1) / 2)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_global_normalizer_makes_micro_batches_sum_to_the_batch_mean(agg):
    g = torch.Generator().manual_seed(1)
    lens = [5, 17, 3, 40, 11, 9]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    n = int(cu[-1])
    logp = (torch.randn(n, generator=g) * 0.3).double().requires_grad_()
    behav = logp.detach() + torch.randn(n, generator=g).double() * 0.3
    prox = logp.detach() + torch.randn(n, generator=g).double() * 0.1
    adv = torch.randn(n, generator=g).double()
    mask = torch.rand(n, generator=g) > 0.3
    kw = dict(eps_clip=0.2, agg=agg, imp_weight_cap=2.0)
    full, _ = ppo_loss(logp, behav, adv, mask, logp_prox=prox, cu_seqlens=cu, **kw)
    (g_full,) = torch.autograd.grad(full, logp)
    # Two micro-batches: sequences 0-2 and 3-5; the normalizer counts the whole batch.
    total = loss_normalizer(mask, cu, agg)
    split = int(cu[3])
    parts = []
    for lo, hi, cu_part in ((0, split, cu[:4]), (split, n, cu[3:] - split)):
        assert loss_normalizer(mask[lo:hi], cu_part, agg) <= total
        part, _ = ppo_loss(logp[lo:hi], behav[lo:hi], adv[lo:hi], mask[lo:hi], logp_prox=prox[lo:hi],
                           cu_seqlens=cu_part, normalizer=total, **kw)
        parts.append(part)
    summed = parts[0] + parts[1]
    (g_sum,) = torch.autograd.grad(summed, logp)
    torch.testing.assert_close(summed, full)
    torch.testing.assert_close(g_sum, g_full)


def _naive_loss(logp, prox, behav, adv, mask, eps, eps_high, dual, cap, mode):
    """Straight from the formula, through plain autograd."""
    r = torch.exp(logp - prox)
    w = torch.exp(prox - behav)
    keep = mask.clone()
    if cap > 0 and mode == "mask":
        keep = keep & (w <= cap)
    if cap > 0 and mode == "clamp":
        w = w.clamp(max=cap)
    per = torch.max(-adv * r, -adv * r.clamp(1 - eps, 1 + eps_high))
    if dual > 0:
        per = torch.where(adv < 0, torch.min(per, -dual * adv), per)
    return (per * w * keep).sum() / mask.sum()


@pytest.mark.parametrize("dual,cap,mode", [(0.0, 0.0, "mask"), (3.0, 1.3, "mask"), (2.0, 1.3, "clamp")])
def test_matches_naive_autograd_on_random_inputs(dual, cap, mode):
    g = torch.Generator().manual_seed(2)
    n = 5000
    logp = (torch.randn(n, generator=g) * 0.5).double().requires_grad_()
    prox = logp.detach() + torch.randn(n, generator=g).double() * 0.3
    behav = prox + torch.randn(n, generator=g).double() * 0.3
    adv = torch.randn(n, generator=g).double()
    mask = torch.rand(n, generator=g) > 0.25
    ours, _ = ppo_loss(logp, behav, adv, mask, logp_prox=prox, eps_clip=0.2, eps_clip_high=0.25,
                       dual_clip=dual, imp_weight_cap=cap, imp_weight_mode=mode)
    (g_ours,) = torch.autograd.grad(ours, logp)
    ref = _naive_loss(logp, prox, behav, adv, mask, 0.2, 0.25, dual, cap, mode)
    (g_ref,) = torch.autograd.grad(ref, logp)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(g_ours, g_ref)


@pytest.mark.parametrize("agg,kl", [("token_mean", 0.0), ("seq_mean_token_mean", 0.1)])
def test_gradcheck(agg, kl):
    g = torch.Generator().manual_seed(3)
    n = 24
    logp = (torch.randn(n, generator=g) * 0.4).double().requires_grad_()
    prox = logp.detach() + torch.randn(n, generator=g).double() * 0.3
    behav = prox + torch.randn(n, generator=g).double() * 0.2
    ref = prox + torch.randn(n, generator=g).double() * 0.2
    adv = torch.randn(n, generator=g).double()
    mask = torch.rand(n, generator=g) > 0.2
    cu = torch.tensor([0, 7, 15, 24])

    def f(x):
        return ppo_loss(x, behav, adv, mask, logp_prox=prox, dual_clip=2.0, imp_weight_cap=3.0, agg=agg,
                        cu_seqlens=cu, logp_ref=ref, kl_coef=kl)[0]

    assert torch.autograd.gradcheck(f, (logp,))


@pytest.mark.parametrize("est,value", [("k1", -math.log(2)), ("k2", 0.5 * math.log(2) ** 2),
                                       ("k3", 1 - math.log(2))])
def test_kl_penalty_hand_values(est, value):
    logp = torch.zeros(3, dtype=torch.float64)
    ref = torch.full((3,), math.log(2), dtype=torch.float64)
    torch.testing.assert_close(kl_penalty(logp, ref, est), torch.full((3,), value, dtype=torch.float64))


def test_kl_term_in_the_loss():
    logp, prox, adv, mask = _inputs()
    ref = torch.full((6,), math.log(2), dtype=torch.float64)
    base, _ = ppo_loss(logp, prox, adv, mask, eps_clip_high=0.28)
    with_kl, stats = ppo_loss(logp, prox, adv, mask, eps_clip_high=0.28, logp_ref=ref, kl_coef=0.5)
    # Valid tokens have logp = log r; k3 with d = log2 - log r is 2/r - log(2/r) - 1.
    k3 = [2 / r - math.log(2 / r) - 1 for r in R[:5]]
    assert stats["kl"].item() == pytest.approx(sum(k3) / 5)
    assert with_kl.item() == pytest.approx(base.item() + 0.5 * sum(k3) / 5)


def test_garbage_on_masked_tokens_does_not_leak():
    logp, prox, adv, mask = _inputs()
    prox = prox.clone()
    prox[5] = float("-inf")
    behav = prox.clone()
    behav[5] = float("nan")
    loss, stats = ppo_loss(logp, behav, adv, mask, logp_prox=prox, eps_clip_high=0.28)
    assert torch.isfinite(loss)
    assert all(torch.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("kwargs,match", [
    (dict(eps_clip=0.0), "eps_clip"),
    (dict(dual_clip=0.5), "dual_clip"),
    (dict(imp_weight_mode="drop"), "imp_weight_mode"),
    (dict(agg="seq_mean"), "agg"),
    (dict(agg="seq_mean_token_mean"), "cu_seqlens: required"),
    (dict(normalizer=0), "normalizer"),
    (dict(kl_coef=0.1), "logp_ref: required"),
    (dict(kl_estimator="k4"), "kl_estimator"),
])
def test_bad_arguments_are_named(kwargs, match):
    logp, prox, adv, mask = _inputs()
    with pytest.raises(ValueError, match=match):
        ppo_loss(logp, prox, adv, mask, **kwargs)


def test_bad_shapes_are_named():
    logp, prox, adv, mask = _inputs()
    with pytest.raises(ValueError, match="advantages: expected 6"):
        ppo_loss(logp, prox, adv[:5], mask)
    with pytest.raises(ValueError, match="logp: expected a 1-D"):
        ppo_loss(logp.detach().view(2, 3), prox, adv, mask)
    with pytest.raises(ValueError, match="cu_seqlens: last offset"):
        ppo_loss(logp, prox, adv, mask, agg="seq_mean_token_mean", cu_seqlens=torch.tensor([0, 2, 5]))


def test_kwargs_from_config():
    kw = loss_kwargs_from_config(AlgoConfig(eps_clip_high=0.28, dual_clip=3.0, decoupled=False))
    assert kw["eps_clip_high"] == 0.28 and kw["dual_clip"] == 3.0 and kw["imp_weight_cap"] == 0.0
    logp, prox, adv, mask = _inputs()
    ppo_loss(logp, prox, adv, mask, **kw)  # every key is accepted


def _random_case(seed, n=3000, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logp = (torch.randn(n, generator=g) * 0.5).to(dtype)
    prox = logp + (torch.randn(n, generator=g) * 0.6).to(dtype)
    behav = prox + (torch.randn(n, generator=g) * 0.5).to(dtype)
    adv = torch.randn(n, generator=g).to(dtype)
    mask = torch.rand(n, generator=g) > 0.25
    cu = torch.tensor([0, 100, 100, 1700, n])
    return logp, prox, behav, adv, mask, cu


needs_ppo_kernel = pytest.mark.skipif(
    __import__("realscale.kernels", fromlist=["load"]).load("ppo_loss") is None, reason="csrc/ppo_loss.cpp not built")


@needs_ppo_kernel
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("dual,cap,mode", [(0.0, 0.0, "mask"), (3.0, 1.5, "mask"), (2.0, 1.5, "clamp")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_kernel_matches_torch_path(monkeypatch, decoupled, agg, dual, cap, mode, dtype):
    logp, prox, behav, adv, mask, cu = _random_case(7, dtype=dtype)
    kw = dict(logp_prox=prox if decoupled else None, eps_clip=0.2, eps_clip_high=0.27, dual_clip=dual,
              imp_weight_cap=cap, imp_weight_mode=mode, agg=agg, cu_seqlens=cu, normalizer=2345.0)
    outs = []
    for no_kernels in ("0", "1"):
        monkeypatch.setenv("REALSCALE_NO_KERNELS", no_kernels)
        x = logp.clone().requires_grad_()
        loss, stats = ppo_loss(x, behav, adv, mask, **kw)
        (grad,) = torch.autograd.grad(loss, x)
        outs.append((loss, grad, stats))
    (l_k, g_k, s_k), (l_t, g_t, s_t) = outs
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else {}
    torch.testing.assert_close(l_k, l_t, **tol)
    torch.testing.assert_close(g_k, g_t, **tol)
    assert s_k.keys() == s_t.keys()
    for key in s_k:
        torch.testing.assert_close(s_k[key], s_t[key], **tol, msg=key)
    assert s_k["clip_frac"] > 0 and (dual == 0 or s_k["dual_clip_frac"] > 0)

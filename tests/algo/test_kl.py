"""The KL estimators of realscale/algo/kl.py: each equals its formula, k1 and k3 are
unbiased for KL(pi || ref) under tokens drawn from pi (exactly, summed over a whole
vocabulary), k2 and k3 are never negative, gradients reach the policy only, and the
masked batch sum counts trained tokens only."""

from __future__ import annotations

import pytest
import torch

from realscale.algo.kl import ESTIMATORS, kl_penalty, masked_kl_sum

FORMULAS = {
    "k1": lambda d: -d,
    "k2": lambda d: d * d / 2,
    "k3": lambda d: torch.exp(d) - d - 1,
}


@pytest.mark.parametrize("est", ESTIMATORS)
def test_each_estimator_is_its_formula(est: str) -> None:
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(200, generator=g, dtype=torch.float64) * 5
    ref = -torch.rand(200, generator=g, dtype=torch.float64) * 5
    torch.testing.assert_close(kl_penalty(logp, ref, est), FORMULAS[est](ref - logp))


def test_k3_is_accurate_for_small_differences() -> None:
    """In float32, exp(d) - d - 1 loses k3 ~ d**2 / 2 to rounding for small d (all of it at
    d = 1e-4); the expm1 form keeps it within 0.1%."""
    logp = torch.zeros(4)
    d = torch.tensor([1e-3, -1e-3, 1e-4, -1e-4])
    torch.testing.assert_close(kl_penalty(logp, d, "k3"), d * d / 2, rtol=1e-3, atol=0)
    naive = torch.exp(d) - d - 1
    assert bool(((naive / (d * d / 2) - 1).abs() > 0.04).all())


@pytest.mark.parametrize("est", ["k1", "k3"])
def test_unbiased_estimators_average_to_the_true_kl(est: str) -> None:
    """sum_x pi(x) k(x) over every token x is KL(pi || ref) exactly for k1 and k3."""
    g = torch.Generator().manual_seed(1)
    logits_pi = torch.randn(4, 50, generator=g, dtype=torch.float64)
    logits_ref = logits_pi + torch.randn(4, 50, generator=g, dtype=torch.float64) * 0.7
    logp, logq = logits_pi.log_softmax(-1), logits_ref.log_softmax(-1)
    true_kl = (logp.exp() * (logp - logq)).sum(-1)
    expected = (logp.exp() * kl_penalty(logp, logq, est)).sum(-1)
    torch.testing.assert_close(expected, true_kl)
    # k2 is biased: its expectation is not the KL (so the check above can tell estimators apart)
    k2 = (logp.exp() * kl_penalty(logp, logq, "k2")).sum(-1)
    assert not torch.allclose(k2, true_kl, rtol=1e-3)


def test_k2_and_k3_are_never_negative_and_zero_at_equal_policies() -> None:
    g = torch.Generator().manual_seed(2)
    logp = torch.randn(1000, generator=g)
    ref = torch.randn(1000, generator=g) * 3
    for est in ("k2", "k3"):
        assert bool((kl_penalty(logp, ref, est) >= 0).all()), est
    for est in ESTIMATORS:
        assert bool((kl_penalty(logp, logp.clone(), est) == 0).all()), est


def test_gradient_reaches_the_policy_not_the_reference() -> None:
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0], requires_grad=True)
    kl_penalty(logp, ref, "k3").sum().backward()
    d = (ref - logp).detach()
    torch.testing.assert_close(logp.grad, -(torch.exp(d) - 1))  # d/dlogp of exp(d) - d - 1
    assert ref.grad is None


def test_masked_sum_counts_only_trained_tokens() -> None:
    logp = torch.tensor([0.0, -1.0, -2.0, -3.0])
    ref = torch.tensor([5.0, -1.5, -1.0, -3.0])  # the first token (a prompt) is far off, and masked
    mask = torch.tensor([0, 1, 1, 1])
    total = masked_kl_sum(logp, ref, mask, "k1")
    assert total.dtype == torch.float64
    torch.testing.assert_close(total, torch.tensor([0.5 - 1.0 + 0.0, 3.0], dtype=torch.float64))


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="estimator: 'k4'"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match="logp_ref: shape"):
        kl_penalty(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="mask: shape"):
        masked_kl_sum(torch.zeros(2), torch.zeros(2), torch.ones(3))

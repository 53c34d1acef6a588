"""Per-token KL estimators between the policy and a reference model (Schulman, "Approximating
KL divergence", 2020), for tokens sampled from the policy.

With ``d = logp_ref - logp`` (the log of ``pi_ref / pi_theta``):

- k1 = -d                      unbiased, can be negative, high variance
- k2 = d**2 / 2                biased, non-negative, low variance
- k3 = exp(d) - d - 1          unbiased, non-negative (the GRPO choice)

k3 is evaluated with ``expm1`` so that it stays >= 0 and accurate when d is tiny.
Gradients flow into ``logp`` only; ``logp_ref`` is treated as data.
"""

from __future__ import annotations

import torch
from torch import Tensor

ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logp: Tensor, logp_ref: Tensor, estimator: str = "k3", clamp: float | None = 20.0) -> Tensor:
    """Per-token KL estimate of ``KL(pi_theta || pi_ref)``, same shape as ``logp``.

    ``clamp`` bounds ``d`` to [-clamp, clamp] before ``exp`` so one wildly off token
    cannot produce inf (None: no bound).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator: {estimator!r} is not one of {', '.join(ESTIMATORS)}")
    if logp.shape != logp_ref.shape:
        raise ValueError(f"logp_ref: shape {tuple(logp_ref.shape)} != logp shape {tuple(logp.shape)}")
    d = logp_ref.detach().to(logp.dtype) - logp
    if clamp is not None:
        d = d.clamp(-clamp, clamp)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    return torch.expm1(d) - d


def masked_kl_sum(logp: Tensor, logp_ref: Tensor, mask: Tensor, estimator: str = "k3") -> Tensor:
    """``[sum of the per-token KL over the masked tokens, their count]`` (float64, on
    ``logp``'s device): add these over micro-batches and data-parallel ranks, then divide,
    for the mean KL of a whole batch."""
    if mask.shape != logp.shape:
        raise ValueError(f"mask: shape {tuple(mask.shape)} != logp shape {tuple(logp.shape)}")
    valid = mask.to(device=logp.device, dtype=torch.bool)
    per_token = kl_penalty(logp.detach(), logp_ref.to(logp.device), estimator)
    return torch.stack([torch.where(valid, per_token, 0.0).double().sum(), valid.double().sum()])

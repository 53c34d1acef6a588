"""The critic's objective: a clipped value loss on packed tokens (PPO2, Schulman et al. 2017,
as in OpenAI baselines and verl)::

    v_clip = v_old + clip(v - v_old, -c, c)
    loss   = sum_t mask_t * 0.5 * max((v_t - R_t)^2, (v_clip_t - R_t)^2) / normalizer

``v_old`` are the critic's values before the update (the ones GAE used), ``R`` the GAE
returns. The max keeps the loss from rewarding a value that jumped more than ``c`` away
from ``v_old``; ``c = 0`` turns the clip off (plain squared error). ``normalizer`` is
the global count of trained tokens, as for the policy loss, so micro-batch losses add up
to the batch's token mean.
"""

from __future__ import annotations

import torch
from torch import Tensor

from realscale.algo.packed import check_1d, check_same_device


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float = 0.2,
               normalizer: float | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """(loss, detached statistics): ``value_loss``, ``value_clip_frac`` (share of tokens
    where the clipped term is the larger), ``value_mean``, ``return_mean``, ``value_error``
    (mean |v - R|), all over this call's masked tokens."""
    check_1d("values", values, floating=True)
    n = values.numel()
    for name, x in (("old_values", old_values), ("returns", returns)):
        check_1d(name, x, n, floating=True)
    check_1d("mask", mask, n)
    check_same_device(values=values, old_values=old_values, returns=returns, mask=mask)
    if clip < 0:
        raise ValueError(f"clip: must be >= 0 (0: no clip), got {clip!r}")
    valid = mask.to(torch.bool)
    v = values.float()
    old, ret = old_values.detach().float(), returns.detach().float()
    err = (v - ret) ** 2
    if clip > 0:
        v_clipped = old + (v - old).clamp(-clip, clip)
        err_clipped = (v_clipped - ret) ** 2
        clipped = valid & (err_clipped > err)
        err = torch.maximum(err, err_clipped)
    else:
        clipped = torch.zeros_like(valid)
    m = valid.float()
    count = m.sum()
    denom = count.clamp(min=1) if normalizer is None else normalizer
    loss = 0.5 * torch.dot(m, torch.where(valid, err, 0.0)) / denom
    inv = 1.0 / count.clamp(min=1)
    with torch.no_grad():
        stats = {"value_loss": loss.detach(), "value_clip_frac": clipped.float().sum() * inv,
                 "value_mean": (v.detach() * m).sum() * inv, "return_mean": (ret * m).sum() * inv,
                 "value_error": ((v.detach() - ret).abs() * m).sum() * inv}
    return loss, stats


__all__ = ["value_loss"]

"""Critic-free advantages from per-sequence rewards: GRPO and leave-one-out (RLOO); and
normalisation over the global batch.

GRPO (Shao et al., arXiv 2402.03300): ``A_i = (r_i - mean_g) / (std_g + eps)``, with the
std optional (Dr. GRPO, arXiv 2503.20783, drops it). The std is the unbiased (n-1) one,
as verl and TRL compute it; a group of one, or of equal rewards, has advantage 0.

Leave-one-out (Ahmadian et al., arXiv 2402.14740): ``A_i = r_i - mean_{j != i} r_j``,
which equals ``n/(n-1) * (r_i - mean_g)``.

Groups are given either as one ``group_size`` (the sequences of a group are adjacent,
the usual layout of n samples per prompt) or as ``cu_groups`` offsets when groups differ
in size (e.g. after filtering). The result is one advantage per sequence; spread it over
the tokens with :func:`broadcast_to_tokens`.

Global-batch normalisation (AReaL, arXiv 2505.24298: its critic-free PPO takes the
sequence reward as every token's advantage and normalises over the whole batch instead of
per group): ``A <- (A - mean) / (std + eps)`` with mean and (unbiased) std over every
trained token of the step. Split as :func:`masked_moments` (count, sum, sum of squares:
they add up across micro-batches and data-parallel ranks, so an all-reduce of three
numbers gives the global statistics) and :func:`normalize_by_moments`;
:func:`batch_normalized_advantages` is the one-process composition.
"""

from __future__ import annotations

import torch
from torch import Tensor

from realscale.algo.packed import check_1d, check_cu_seqlens, seq_ids, seq_lengths, segment_sum


def _group_offsets(rewards: Tensor, group_size: int | None, cu_groups: Tensor | None) -> Tensor:
    """``cu_groups`` from whichever of the two group descriptions was given."""
    check_1d("rewards", rewards, floating=True)
    if (group_size is None) == (cu_groups is None):
        raise ValueError("give exactly one of group_size (equal groups) or cu_groups (offsets)")
    if cu_groups is not None:
        check_cu_seqlens(cu_groups, rewards.numel(), name="cu_groups")
        return cu_groups.to(device=rewards.device, dtype=torch.long)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size: expected a positive int, got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(f"rewards: {rewards.numel()} sequences do not split into groups of {group_size}")
    return torch.arange(0, rewards.numel() + 1, group_size, device=rewards.device, dtype=torch.long)


def _group_mean_and_std(rewards: Tensor, cu: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sequence (group mean, unbiased group std, group size), in float64 for exactness."""
    r = rewards.double()
    sizes = seq_lengths(cu)
    gid = seq_ids(cu, r.numel())
    n = sizes.clamp(min=1).double()
    mean = segment_sum(r, cu) / n
    centred = r - mean[gid]
    var = segment_sum(centred * centred, cu) / (sizes - 1).clamp(min=1).double()
    return mean[gid], var.sqrt()[gid], sizes[gid]


def grpo_advantages(rewards: Tensor, group_size: int | None = None, *, cu_groups: Tensor | None = None,
                    std_norm: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-normalised advantages, one per sequence, dtype of ``rewards``."""
    cu = _group_offsets(rewards, group_size, cu_groups)
    if eps < 0:
        raise ValueError(f"eps: must be >= 0, got {eps!r}")
    mean, std, _ = _group_mean_and_std(rewards, cu)
    adv = rewards.double() - mean
    if std_norm:
        # A group with equal rewards (std 0) teaches nothing: exactly 0, not 0/0 or noise/eps.
        adv = torch.where(std > 0, adv / (std + eps), 0.0)
    return adv.to(rewards.dtype)


def loo_advantages(rewards: Tensor, group_size: int | None = None, *,
                   cu_groups: Tensor | None = None) -> Tensor:
    """Leave-one-out advantages ``r_i - mean of the other rewards of its group``."""
    cu = _group_offsets(rewards, group_size, cu_groups)
    sizes = seq_lengths(cu)
    if bool((sizes == 1).any()):
        g = int(torch.nonzero(sizes == 1)[0, 0])
        raise ValueError(f"loo_advantages: group {g} has one sample; leave-one-out needs at least 2")
    mean, _, size = _group_mean_and_std(rewards, cu)
    n = size.double()
    return (n / (n - 1).clamp(min=1) * (rewards.double() - mean)).to(rewards.dtype)


def broadcast_to_tokens(per_seq: Tensor, cu_seqlens: Tensor, mask: Tensor | None = None) -> Tensor:
    """Spread one value per sequence over that sequence's tokens (0 where ``mask`` is off)."""
    check_1d("per_seq", per_seq)
    if per_seq.numel() != cu_seqlens.numel() - 1:
        raise ValueError(f"per_seq: {per_seq.numel()} values for {cu_seqlens.numel() - 1} sequences")
    n = int(cu_seqlens[-1])
    check_cu_seqlens(cu_seqlens, n)
    out = per_seq[seq_ids(cu_seqlens.to(per_seq.device, torch.long), n)]
    if mask is not None:
        check_1d("mask", mask, n)
        out = out * mask.to(out.dtype)
    return out


def masked_moments(x: Tensor, mask: Tensor) -> Tensor:
    """``[count, sum, sum of squares]`` of ``x`` over ``mask`` (float64): additive across
    pieces of a batch, so their sum (or all-reduce) gives the whole batch's moments."""
    check_1d("x", x, floating=True)
    check_1d("mask", mask, x.numel())
    m = mask.to(torch.bool)
    v = x.double()[m]
    return torch.stack([v.new_tensor(float(v.numel())), v.sum(), (v * v).sum()])


def normalize_by_moments(x: Tensor, mask: Tensor, moments: Tensor, eps: float = 1e-6) -> Tensor:
    """``(x - mean) / (std + eps)`` on ``mask`` (0 elsewhere), mean and unbiased std from
    :func:`masked_moments` of the whole batch; fewer than two tokens: only centred."""
    check_1d("mask", mask, x.numel())
    n, total, sq = (float(v) for v in moments.double())
    mean = total / max(n, 1.0)
    var = (sq - n * mean * mean) / (n - 1) if n > 1 else 0.0
    std = max(var, 0.0) ** 0.5
    out = (x.double() - mean) / (std + eps) if n > 1 else x.double() - mean
    return torch.where(mask.to(torch.bool), out, 0.0).to(x.dtype)


def batch_normalized_advantages(advantages: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """Advantages normalised to mean 0, std 1 over the masked tokens of this batch."""
    return normalize_by_moments(advantages, mask, masked_moments(advantages, mask), eps)

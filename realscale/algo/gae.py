"""Generalised advantage estimation (Schulman et al., arXiv 1506.02438) on packed sequences.

For each sequence, backwards over its tokens::

    delta_t = r_t + gamma * V_next - V_t
    A_t     = delta_t + gamma * lam * A_next,      R_t = A_t + V_t

Departures from the padded [B, T] form that AReaL / verl use:

- Sequences are packed (no padding): ``cu_seqlens`` holds the offsets.
- ``mask`` marks the tokens that are actions (e.g. response tokens). Masked-out tokens
  (prompt, tool output) are skipped: "next" means the next *unmasked* token of the same
  sequence, and skipped tokens get ``A = R = 0`` (AReaL carries the last value through
  them instead; both are ignored by a masked loss).
- ``bootstrap`` gives V after the last token of each sequence (the value of the state a
  truncated sequence stopped in); it defaults to 0, a finished episode.

Three implementations agree (tests/algo/test_gae.py): the C++ kernel (csrc/gae.cpp, or
csrc/cuda/gae.cu on a GPU), :func:`gae_torch` (a vectorised scan, no loop over tokens),
and :func:`gae_reference` (a plain Python loop, the readable definition).
"""

from __future__ import annotations

import torch
from torch import Tensor

from realscale import kernels
from realscale.algo.packed import check_1d, check_cu_seqlens, check_same_device, seq_lengths


def _check(rewards: Tensor, values: Tensor, cu_seqlens: Tensor, gamma: float, lam: float,
           mask: Tensor | None, bootstrap: Tensor | None) -> None:
    check_1d("rewards", rewards, floating=True)
    check_1d("values", values, rewards.numel(), floating=True)
    if values.dtype != rewards.dtype:
        raise TypeError(f"values: dtype {values.dtype} != rewards dtype {rewards.dtype}")
    check_cu_seqlens(cu_seqlens, rewards.numel())
    if mask is not None:
        check_1d("mask", mask, rewards.numel())
    if bootstrap is not None:
        check_1d("bootstrap", bootstrap, cu_seqlens.numel() - 1, floating=True)
    check_same_device(rewards=rewards, values=values, mask=mask, bootstrap=bootstrap)
    for name, x in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= float(x) <= 1.0:
            raise ValueError(f"{name}: must lie in [0, 1], got {x!r}")


def gae(rewards: Tensor, values: Tensor, cu_seqlens: Tensor, gamma: float, lam: float, *,
        mask: Tensor | None = None, bootstrap: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(advantages, returns) of packed sequences; the compiled kernel when built.

    ``rewards``/``values``/``mask``: one entry per token; ``bootstrap``: one per sequence.
    Falls back to :func:`gae_torch` when the kernel is not built (or REALSCALE_NO_KERNELS=1).
    """
    _check(rewards, values, cu_seqlens, gamma, lam, mask, bootstrap)
    mod = kernels.load("gae", cuda=rewards.is_cuda)
    if mod is None:
        return gae_torch(rewards, values, cu_seqlens, gamma, lam, mask=mask, bootstrap=bootstrap)
    cu = cu_seqlens.to(device=rewards.device, dtype=torch.long)
    m = None if mask is None else mask.to(torch.bool)
    boot = None if bootstrap is None else bootstrap.to(rewards.dtype)
    adv, ret = mod.gae(rewards, values.to(rewards.dtype), cu, float(gamma), float(lam), m, boot)
    return adv, ret


def gae_torch(rewards: Tensor, values: Tensor, cu_seqlens: Tensor, gamma: float, lam: float, *,
              mask: Tensor | None = None, bootstrap: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Vectorised GAE: a segmented reverse scan by doubling, ceil(log2(longest)) rounds.

    The recurrence ``A_t = delta_t + c_t * A_{t+1}`` (c_t = gamma*lam inside a sequence,
    0 at its last token) is a linear scan: after round k, ``A_t`` holds the sum of the
    next 2^k terms and ``C_t`` the product of their c's, and one round doubles both.
    Products of c's only shrink (c <= 1), so unlike a "divide by c^t" closed form it
    cannot overflow on long sequences.
    """
    _check(rewards, values, cu_seqlens, gamma, lam, mask, bootstrap)
    dtype = rewards.dtype
    values = values.to(dtype)
    cu = cu_seqlens.to(device=rewards.device, dtype=torch.long)
    lengths = seq_lengths(cu)
    b = lengths.numel()
    if mask is not None:  # compact to the unmasked tokens; "next" is then just the next element
        keep = mask.to(torch.bool)
        idx = torch.nonzero(keep).squeeze(1)
        seq_of_token = torch.repeat_interleave(torch.arange(b, device=cu.device), lengths,
                                               output_size=rewards.numel())
        lengths = torch.zeros(b, dtype=torch.long, device=cu.device).index_add_(
            0, seq_of_token[idx], torch.ones_like(idx))
        r, v = rewards[idx], values[idx]
    else:
        r, v = rewards, values
    n = r.numel()
    ends = torch.cumsum(lengths, 0)
    nonempty = lengths > 0
    last = ends[nonempty] - 1  # index of each non-empty sequence's last token
    next_v = torch.empty_like(v)
    next_v[:-1] = v[1:]
    boot = torch.zeros(b, dtype=dtype, device=r.device) if bootstrap is None else bootstrap.to(dtype)
    next_v[last] = boot[nonempty]
    delta = r + gamma * next_v - v
    coef = torch.full_like(r, gamma * lam)
    coef[last] = 0.0
    adv = delta
    longest = int(lengths.max()) if b else 0
    # Every C_t is 0 or (gamma*lam)^j with j >= step, so once (gamma*lam)^step is below
    # eps^2 the terms still missing are below rounding: stop (this also keeps the
    # products out of the denormal range, where CPU multiplies crawl).
    tiny = torch.finfo(dtype).eps ** 2
    step = 1
    while step < longest and (gamma * lam) ** step > tiny:
        # A_t += C_t * A_{t+step}; C_t *= C_{t+step}. The products go to fresh tensors
        # first because the slices overlap. Beyond the end of the pack C_t is already 0
        # (it includes the last sequence's final c), so those slots need no update.
        adv[:-step] += coef[:-step] * adv[step:]
        if 2 * step < longest:  # the last round's C is never read
            coef[:-step] = coef[:-step] * coef[step:]
            coef[max(n - step, 0):] = 0.0
        step *= 2
    ret = adv + v
    if mask is None:
        return adv, ret
    full_adv = torch.zeros_like(rewards)
    full_ret = torch.zeros_like(rewards)
    full_adv[idx] = adv
    full_ret[idx] = ret
    return full_adv, full_ret


def gae_reference(rewards: Tensor, values: Tensor, cu_seqlens: Tensor, gamma: float, lam: float, *,
                  mask: Tensor | None = None, bootstrap: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The definition, as a Python loop over tokens in float64: for tests, not for speed."""
    _check(rewards, values, cu_seqlens, gamma, lam, mask, bootstrap)
    r, v = rewards.double().tolist(), values.double().tolist()
    m = [True] * len(r) if mask is None else mask.bool().tolist()
    cu = [int(x) for x in cu_seqlens.tolist()]
    boot = [0.0] * (len(cu) - 1) if bootstrap is None else bootstrap.double().tolist()
    adv, ret = [0.0] * len(r), [0.0] * len(r)
    for s in range(len(cu) - 1):
        next_v, a = boot[s], 0.0
        for t in range(cu[s + 1] - 1, cu[s] - 1, -1):
            if not m[t]:
                continue
            a = r[t] + gamma * next_v - v[t] + gamma * lam * a
            next_v = v[t]
            adv[t], ret[t] = a, a + v[t]
    out = torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)
    return out[0].to(rewards.dtype), out[1].to(rewards.dtype)

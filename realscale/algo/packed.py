"""Checks and helpers for packed tensors (many sequences concatenated, ``cu_seqlens`` offsets).

Every public function of :mod:`realscale.algo` validates its inputs through here, so a
wrong shape, dtype or offset table fails with a message that names the argument.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_1d(name: str, x: Tensor, n: int | None = None, floating: bool = False) -> None:
    """``x`` is a 1-D tensor (of ``n`` elements, of a floating dtype when asked)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D packed tensor, got shape {tuple(x.shape)}")
    if n is not None and x.numel() != n:
        raise ValueError(f"{name}: expected {n} elements (one per token), got {x.numel()}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")


def check_same_device(**tensors: Tensor | None) -> None:
    """All given tensors live on one device (``None`` entries are ignored)."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{k} on {v}" for k, v in devices.items())
        raise ValueError(f"tensors must be on one device, got {listing}")


def check_cu_seqlens(cu_seqlens: Tensor, n_tokens: int, name: str = "cu_seqlens") -> None:
    """``cu_seqlens`` is an int tensor of B+1 offsets from 0 to ``n_tokens``, never decreasing.

    Reads B+1 small integers (one device sync on a GPU); the kernels need them anyway.
    """
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of offsets, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name}: expected a 1-D tensor of B+1 offsets, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got {cu_seqlens.dtype}")
    cu = cu_seqlens.detach().cpu()
    if int(cu[0]) != 0:
        raise ValueError(f"{name}: must start at 0, got {int(cu[0])}")
    if int(cu[-1]) != n_tokens:
        raise ValueError(f"{name}: last offset {int(cu[-1])} != number of tokens {n_tokens}")
    if cu.numel() > 1 and bool((cu[1:] < cu[:-1]).any()):
        bad = int(torch.nonzero(cu[1:] < cu[:-1])[0, 0]) + 1
        raise ValueError(f"{name}: offsets must not decrease, but {name}[{bad}]={int(cu[bad])} "
                         f"< {name}[{bad - 1}]={int(cu[bad - 1])}")


def seq_lengths(cu_seqlens: Tensor) -> Tensor:
    """Length of every sequence, int64."""
    return (cu_seqlens[1:] - cu_seqlens[:-1]).long()


def seq_ids(cu_seqlens: Tensor, n_tokens: int) -> Tensor:
    """The sequence index of every token (int64, ``n_tokens`` long)."""
    b = cu_seqlens.numel() - 1
    ids = torch.arange(b, device=cu_seqlens.device)
    return torch.repeat_interleave(ids, seq_lengths(cu_seqlens), output_size=n_tokens)


def segment_sum(x: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Sum of ``x`` over each sequence (float64-exact enough for counts; dtype of ``x``).

    Differences of a cumulative sum would be faster but lose precision on long packs,
    so this scatters with index_add, which is exact per segment up to float rounding.
    """
    b = cu_seqlens.numel() - 1
    out = torch.zeros(b, dtype=x.dtype, device=x.device)
    return out.index_add_(0, seq_ids(cu_seqlens, x.numel()), x)

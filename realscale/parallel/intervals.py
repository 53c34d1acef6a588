"""Copy many ``[start, start + length)`` intervals of a flat buffer into or out of a
contiguous packed buffer: the inner loop of resharding.

``gather(flat, starts, lengths, out)`` writes the intervals one after another into
``out``; ``scatter(flat, starts, lengths, packed)`` is the inverse. The compiled kernels
(``csrc/interval_copy.cpp``, ``csrc/cuda/interval_copy.cu``) are used when built; the
fallbacks below are the reference the tests compare them with.
"""

from __future__ import annotations

import numpy as np
import torch

from realscale import kernels

# Below this many intervals a loop of slice copies beats building an index tensor.
_LOOP_MAX = 32


def _as_index(starts: np.ndarray | torch.Tensor, lengths: np.ndarray | torch.Tensor,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.as_tensor(starts, dtype=torch.int64).to(device)
    n = torch.as_tensor(lengths, dtype=torch.int64).to(device)
    if s.dim() != 1 or s.shape != n.shape:
        raise ValueError(f"intervals: starts and lengths must be 1-D of equal length, got {tuple(s.shape)} "
                         f"and {tuple(n.shape)}")
    return s, n


def _check_bounds(flat: torch.Tensor, s: torch.Tensor, n: torch.Tensor, packed: torch.Tensor) -> None:
    if flat.dim() != 1 or packed.dim() != 1:
        raise ValueError("intervals: flat and packed buffers must be 1-D")
    if flat.dtype != packed.dtype:
        raise ValueError(f"intervals: flat and packed buffers differ in dtype ({flat.dtype} vs {packed.dtype})")
    if s.numel() == 0:
        return
    if bool((n < 0).any()) or bool((s < 0).any()) or int((s + n).max()) > flat.numel():
        raise ValueError(f"intervals: an interval lies outside the flat buffer of {flat.numel()} elements")
    if int(n.sum()) > packed.numel():
        raise ValueError(f"intervals: intervals hold {int(n.sum())} elements but the packed buffer has "
                         f"{packed.numel()}")


def _flat_index(s: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """All element indices of the intervals, in order (repeat_interleave + a ramp)."""
    total = int(n.sum())
    first = torch.repeat_interleave(s - (torch.cumsum(n, 0) - n), n)
    return first + torch.arange(total, device=s.device)


def gather_fallback(flat: torch.Tensor, s: torch.Tensor, n: torch.Tensor, out: torch.Tensor) -> None:
    if s.numel() <= _LOOP_MAX:
        pos = 0
        for a, k in zip(s.tolist(), n.tolist()):
            out[pos:pos + k].copy_(flat[a:a + k])
            pos += k
        return
    idx = _flat_index(s, n)
    torch.index_select(flat, 0, idx, out=out[: idx.numel()])


def scatter_fallback(flat: torch.Tensor, s: torch.Tensor, n: torch.Tensor, packed: torch.Tensor) -> None:
    if s.numel() <= _LOOP_MAX:
        pos = 0
        for a, k in zip(s.tolist(), n.tolist()):
            flat[a:a + k].copy_(packed[pos:pos + k])
            pos += k
        return
    idx = _flat_index(s, n)
    flat.index_copy_(0, idx, packed[: idx.numel()])


def _module(t: torch.Tensor):
    return kernels.load("interval_copy", cuda=t.is_cuda)


def gather(flat: torch.Tensor, starts, lengths, out: torch.Tensor) -> torch.Tensor:
    """``out[: sum(lengths)] = concat(flat[s:s+n] for s, n in intervals)``; returns ``out``."""
    s, n = _as_index(starts, lengths, flat.device)
    mod = _module(flat)
    if mod is not None and flat.is_contiguous() and out.is_contiguous():
        mod.gather(flat, s, n, out)
    else:
        _check_bounds(flat, s, n, out)
        gather_fallback(flat, s, n, out)
    return out


def scatter(flat: torch.Tensor, starts, lengths, packed: torch.Tensor) -> torch.Tensor:
    """``flat[s:s+n] = next n elements of packed`` for each interval; returns ``flat``."""
    s, n = _as_index(starts, lengths, flat.device)
    mod = _module(flat)
    if mod is not None and flat.is_contiguous() and packed.is_contiguous():
        mod.scatter(flat, s, n, packed)
    else:
        _check_bounds(flat, s, n, packed)
        scatter_fallback(flat, s, n, packed)
    return flat

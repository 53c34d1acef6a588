"""Interval gather/scatter: the C++ (and CUDA) kernels against the Python fallback."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from realscale import kernels
from realscale.parallel import intervals


def _random_intervals(rng: np.random.Generator, n_flat: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    # Disjoint intervals (scatter targets must not overlap), random order.
    cuts = np.sort(rng.choice(np.arange(1, n_flat), size=2 * count, replace=False))
    starts, ends = cuts[0::2], cuts[1::2]
    perm = rng.permutation(count)
    return starts[perm].astype(np.int64), (ends - starts)[perm].astype(np.int64)


@pytest.mark.parametrize("count", [0, 3, 500])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_kernel_matches_fallback(count, dtype):
    rng = np.random.default_rng(count)
    flat = (torch.arange(5000) % 127).to(dtype)
    s, n = _random_intervals(rng, 5000, count) if count else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    total = int(n.sum())
    want = torch.cat([flat[a:a + k] for a, k in zip(s, n)]) if count else flat[:0]
    ref = torch.empty(total, dtype=dtype)
    intervals.gather_fallback(flat, torch.as_tensor(s), torch.as_tensor(n), ref)
    assert torch.equal(ref, want)
    mod = kernels.load("interval_copy")
    if mod is None:
        pytest.skip("interval_copy kernel not built")
    out = torch.empty(total, dtype=dtype)
    mod.gather(flat, torch.as_tensor(s), torch.as_tensor(n), out)
    assert torch.equal(out, ref)
    back_k, back_f = torch.zeros_like(flat), torch.zeros_like(flat)
    mod.scatter(back_k, torch.as_tensor(s), torch.as_tensor(n), out)
    intervals.scatter_fallback(back_f, torch.as_tensor(s), torch.as_tensor(n), ref)
    assert torch.equal(back_k, back_f)
    mask = torch.zeros(5000, dtype=torch.bool)
    for a, k in zip(s, n):
        mask[a:a + k] = True
    assert torch.equal(back_k[mask], flat[mask])


def test_out_of_bounds_is_refused_by_both_paths(monkeypatch):
    flat, out = torch.zeros(10), torch.zeros(10)
    with pytest.raises((ValueError, RuntimeError), match="outside the flat buffer"):
        intervals.gather(flat, [8], [5], out)
    monkeypatch.setenv("REALSCALE_NO_KERNELS", "1")
    with pytest.raises(ValueError, match="outside the flat buffer"):
        intervals.gather(flat, [8], [5], out)
    with pytest.raises(ValueError, match="packed buffer has 2"):
        intervals.scatter(flat, [0], [5], torch.zeros(2))


@pytest.mark.gpu
def test_cuda_kernel_matches_fallback():
    mod = kernels.load("interval_copy", cuda=True)
    if mod is None:
        pytest.skip("interval_copy_cuda not built")
    rng = np.random.default_rng(0)
    flat = torch.randn(1 << 20, device="cuda")
    s, n = _random_intervals(rng, 1 << 20, 4000)
    st, nt = torch.as_tensor(s, device="cuda"), torch.as_tensor(n, device="cuda")
    out, ref = torch.empty(int(n.sum()), device="cuda"), torch.empty(int(n.sum()), device="cuda")
    mod.gather(flat, st, nt, out)
    intervals.gather_fallback(flat, st, nt, ref)
    assert torch.equal(out, ref)
    back = torch.zeros_like(flat)
    mod.scatter(back, st, nt, out)
    back_f = torch.zeros_like(flat)
    intervals.scatter_fallback(back_f, st, nt, ref)
    assert torch.equal(back, back_f)

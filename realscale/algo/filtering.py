"""Dynamic sampling (DAPO, Yu et al., arXiv 2503.14476): drop groups that teach nothing.

A group whose rewards are all equal has zero GRPO advantage everywhere, so it only
dilutes the batch. DAPO drops those; a success-rate window ``[lb, ub]`` generalises it
(``lb > 0`` drops groups that never succeed, ``ub < 1`` drops groups that always do).
A sample counts as a success when its reward is above ``success_threshold``.

The trainer keeps drawing groups until a batch is full; this function only decides and
counts. All counts are Python ints so they can go straight into the step's metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from realscale.algo.advantages import _group_offsets
from realscale.algo.packed import seq_ids, seq_lengths, segment_sum


@dataclass(frozen=True)
class FilterResult:
    """Which groups and sequences to keep, and why the others were dropped."""

    keep_groups: Tensor  # bool, one per group
    keep_seqs: Tensor  # bool, one per sequence (its group's verdict)
    n_groups: int
    n_kept: int
    n_all_equal: int  # dropped because every reward in the group was equal
    n_out_of_range: int  # dropped because the success rate lay outside [lb, ub] (and not all equal)

    def stats(self) -> dict[str, float]:
        """Metrics for the step log."""
        return {"filter/n_groups": self.n_groups, "filter/n_kept": self.n_kept,
                "filter/n_all_equal": self.n_all_equal, "filter/n_out_of_range": self.n_out_of_range,
                "filter/kept_frac": self.n_kept / max(self.n_groups, 1)}


def dynamic_sampling_filter(rewards: Tensor, group_size: int | None = None, *, cu_groups: Tensor | None = None,
                            drop_all_equal: bool = True, success_lb: float = 0.0, success_ub: float = 1.0,
                            success_threshold: float = 0.0, atol: float = 0.0) -> FilterResult:
    """Decide which groups of per-sequence ``rewards`` to keep.

    ``atol``: rewards within this distance of the group's first reward count as equal.
    """
    cu = _group_offsets(rewards, group_size, cu_groups)
    if not 0.0 <= success_lb <= success_ub <= 1.0:
        raise ValueError(f"success window: need 0 <= success_lb <= success_ub <= 1, got "
                         f"[{success_lb!r}, {success_ub!r}]")
    if atol < 0:
        raise ValueError(f"atol: must be >= 0, got {atol!r}")
    sizes = seq_lengths(cu)
    gid = seq_ids(cu, rewards.numel())
    r = rewards.double()
    first = r[cu[:-1].clamp(max=max(r.numel() - 1, 0))] if r.numel() else r.new_zeros(sizes.numel())
    off = ((r - first[gid]).abs() > atol).double()
    all_equal = segment_sum(off, cu) == 0
    rate = segment_sum((r > success_threshold).double(), cu) / sizes.clamp(min=1).double()
    in_range = (rate >= success_lb) & (rate <= success_ub)
    drop_eq = all_equal if drop_all_equal else torch.zeros_like(all_equal)
    keep = ~drop_eq & in_range & (sizes > 0)
    n_groups = int(sizes.numel())
    n_eq = int(drop_eq.sum())
    n_kept = int(keep.sum())
    return FilterResult(keep_groups=keep, keep_seqs=keep[gid], n_groups=n_groups, n_kept=n_kept,
                        n_all_equal=n_eq, n_out_of_range=n_groups - n_kept - n_eq)

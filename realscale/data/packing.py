"""Split a batch of variable-length sequences into balanced micro-batches under a token budget.

The trainer packs sequences without padding, so a micro-batch costs about its token count.
:func:`pack_micro_batches` returns, for every data-parallel rank, the same number of
micro-batches (Megatron's pipeline schedule runs all dp ranks in lockstep), each a list of
sequence indices (the data itself is never copied), such that

- no micro-batch holds more than ``max_tokens`` tokens;
- the count per rank is the smallest the budget allows: ``ceil(ceil(total / max_tokens) / dp)``
  rounded up to ``multiple_of`` (pipeline degree) and at least ``min_micro_batches``; one
  more step of ``multiple_of`` only when indivisible sequences make that bound unreachable;
- micro-batch loads are balanced (max/min close to 1), and so are the ranks' totals.

How, and how it departs from AReaL/verl: they run Karmarkar-Karp (largest differencing),
which carries k partial sums per item (O(n k) memory and time: gigabytes at n = 65,536)
and ignores the budget, then retry with more micro-batches until it fits. Here the count is
fixed first at the lower bound, then one balanced partition into ``dp * k`` bins is made by
LPT (longest first into the least-loaded bin) and refined by exchanges between the fullest
bin and the emptiest ones (:func:`_balanced_partition_py`, twin of ``csrc/packing.cpp``).
Perfect balance (max - min <= 1) always fits the budget at the lower bound, so refinement
is what reaches the bound. Bins are then dealt to ranks, heaviest first, to the lightest
rank with a free slot, so rank totals are balanced too.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import heapq
import itertools
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from realscale import kernels

log = logging.getLogger(__name__)

# Work caps of the refinement. Feasible attempts on the lognormal benchmark take about
# 1.2-1.7 passes per bin and rarely scan far; the caps make a nearly infeasible attempt
# (budget slack under a few tokens per micro-batch) fail fast so one more micro-batch is
# tried, instead of grinding for seconds.
_ITERS_PER_BIN = 3
_MAX_SCAN = 128

# Refinement stops once max - min load <= this fraction of the mean (max/min ~ 1.001).
DEFAULT_TOLERANCE = 1e-3


Plan = list[list[list[int]]]  # plan[rank][micro_batch] -> sequence indices


# --------------------------------------------------------------------------- validation


def _as_lengths(seqlens: Any) -> np.ndarray:
    """``seqlens`` as a 1-D int64 array; a clear error names the first bad entry."""
    if hasattr(seqlens, "detach"):  # a torch tensor: avoid importing torch here
        seqlens = seqlens.detach().cpu().numpy()
    arr = np.asarray(seqlens)
    if arr.ndim != 1:
        raise ValueError(f"seqlens must be a 1-D sequence of lengths, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            bad = next(i for i, v in enumerate(arr.tolist()) if not _is_integral(v))
            raise ValueError(f"seqlens[{bad}] = {arr.tolist()[bad]!r} is not an integer length")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 1:
        bad = int(np.argmin(arr))
        raise ValueError(f"seqlens[{bad}] = {int(arr[bad])}: every sequence needs at least 1 token")
    return arr


def _is_integral(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) or (isinstance(v, float) and math.isfinite(v) and v == int(v))


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


# --------------------------------------------------------------------------- the partition


def _best_exchange(a_bin: list[tuple[int, int]], b_bin: list[tuple[int, int]], gap: int,
                   limit: int) -> tuple[int, int] | None:
    """(pos in a_bin, pos in b_bin or -1 for a plain move) shifting d tokens from a to b with
    0 < d <= limit (< gap), d closest to min(gap / 2, limit); None when there is none."""
    best, found = None, None
    target2 = min(gap, 2 * limit)  # twice the ideal d
    floor_score = target2 & 1
    for i, (a, _) in enumerate(a_bin):
        if a <= limit:
            score = abs(2 * a - target2)
            if best is None or score < best:
                best, found = score, (i, -1)
        pos = bisect.bisect_left(b_bin, ((2 * a - target2 + 1) >> 1, -1))
        for j in (pos - 1, pos):
            if 0 <= j < len(b_bin):
                d = a - b_bin[j][0]
                if 0 < d <= limit:
                    score = abs(2 * d - target2)
                    if best is None or score < best:
                        best, found = score, (i, j)
        if best is not None and best <= floor_score:
            break
    return found


def _apply_exchange(bins: list[list[tuple[int, int]]], load: list[int], order: list[tuple[int, int]],
                    hi: int, lo: int, exchange: tuple[int, int]) -> None:
    for b in (hi, lo):
        del order[bisect.bisect_left(order, (load[b], b))]
    pos_a, pos_b = exchange
    item_a = bins[hi].pop(pos_a)
    load[hi] -= item_a[0]
    load[lo] += item_a[0]
    if pos_b >= 0:
        item_b = bins[lo].pop(pos_b)
        load[lo] -= item_b[0]
        load[hi] += item_b[0]
        bisect.insort(bins[hi], item_b)
    bisect.insort(bins[lo], item_a)
    for b in (hi, lo):
        bisect.insort(order, (load[b], b))


def _kick(bins: list[list[tuple[int, int]]], load: list[int], order: list[tuple[int, int]], hi: int,
          capacity: int) -> bool:
    """Bring an over-budget bin that balancing exchanges cannot help within budget, loading
    the partner least; see csrc/packing.cpp::kick. False when no exchange fixes it."""
    need = load[hi] - capacity
    best_load, best = None, None
    for lo_load, lo in order:
        if lo == hi:
            continue
        if best_load is not None and lo_load + need >= best_load:
            break
        b_bin = bins[lo]
        for i, (a, _) in enumerate(bins[hi]):
            if a < need:
                continue
            if best_load is None or lo_load + a < best_load:
                best_load, best = lo_load + a, (lo, (i, -1))
            j = bisect.bisect_right(b_bin, (a - need, _INT64_MAX)) - 1
            if j >= 0 and lo_load + a - b_bin[j][0] < best_load:
                best_load, best = lo_load + a - b_bin[j][0], (lo, (i, j))
    if best is None:
        return False
    _apply_exchange(bins, load, order, hi, best[0], best[1])
    return True


def _lpt(lens: np.ndarray, k: int) -> tuple[list[list[tuple[int, int]]], list[int]]:
    """Longest first into the least-loaded bin (ties: lower index, lower bin id)."""
    order = np.argsort(-lens, kind="stable")
    heap = [(0, b) for b in range(k)]
    bins: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    lens_list = lens.tolist()
    for i in order.tolist():
        load, b = heap[0]
        bins[b].append((lens_list[i], i))
        heapq.heapreplace(heap, (load + lens_list[i], b))
    load_of = [0] * k
    for load, b in heap:
        load_of[b] = load
    for items in bins:
        items.sort()
    return bins, load_of


def _best_fit(lens: np.ndarray, k: int, capacity: int) -> tuple[list[list[tuple[int, int]]], list[int]]:
    """Best fit decreasing into at most k bins; see csrc/packing.cpp::best_fit."""
    room: list[tuple[int, int]] = []  # sorted (room left, bin id) of open bins
    bins: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    load = [0] * k
    lens_list = lens.tolist()
    opened = 0
    for i in np.argsort(-lens, kind="stable").tolist():
        n_i = lens_list[i]
        pos = bisect.bisect_left(room, (n_i, -1))
        if pos < len(room):
            b = room.pop(pos)[1]
        elif opened < k:
            b, opened = opened, opened + 1
        else:
            b = room.pop()[1]
        bins[b].append((n_i, i))
        load[b] += n_i
        bisect.insort(room, (capacity - load[b], b))
    for items in bins:
        items.sort()
    return bins, load


def _refine(bins: list[list[tuple[int, int]]], load: list[int], capacity: int, spread: int,
            max_iters: int, max_scan: int) -> int:
    """Exchange items from the fullest bin to the emptiest ones until balanced; a top bin
    that no exchange can lower is frozen (left out of ``order``) so the rest keep going."""
    order = sorted((load[b], b) for b in range(len(load)))
    iters, kicks, max_kicks = 0, 0, 16 + len(load) // 8
    while iters < max_iters and len(order) > 1:
        top_load, hi = order[-1]
        if top_load - order[0][0] <= max(spread, 1) and top_load <= capacity:
            break  # good enough: polishing further costs time and buys nothing measurable
        if top_load - order[0][0] <= 1:
            break
        # Over budget, the partner must stay within it: see csrc/packing.cpp::refine.
        over = top_load > capacity
        exchange = None
        for lo_load, lo in itertools.islice(order, max_scan):
            gap = top_load - lo_load
            limit = min(gap - 1, capacity - lo_load) if over else gap - 1
            if limit <= 0:
                break
            exchange = _best_exchange(bins[hi], bins[lo], gap, limit)
            if exchange is not None:
                _apply_exchange(bins, load, order, hi, lo, exchange)
                break
        if exchange is None:
            if over and kicks < max_kicks and _kick(bins, load, order, hi, capacity):
                kicks += 1
            else:
                order.pop()  # as low as exchanges take it: freeze, keep raising the rest
        iters += 1
    return iters


def _balanced_partition_py(lens: np.ndarray, num_bins: int, capacity: int, spread: int,
                           max_iters: int, max_scan: int) -> tuple[np.ndarray, int]:
    """Pure-Python twin of ``csrc/packing.cpp::balanced_partition``: same result."""
    bins, load = _best_fit(lens, num_bins, capacity) if capacity < _NO_CAPACITY else _lpt(lens, num_bins)
    iters = _refine(bins, load, capacity, spread, max_iters, max_scan)
    assign = np.empty(len(lens), dtype=np.int64)
    for b, items in enumerate(bins):
        for _, i in items:
            assign[i] = b
    return assign, iters


_NO_CAPACITY = 2**62
_INT64_MAX = 2**63 - 1


def balanced_partition(lens: Any, num_bins: int, *, capacity: int | None = None,
                       tolerance: float = DEFAULT_TOLERANCE, use_kernel: bool = True) -> np.ndarray:
    """Bin id (0..num_bins-1) per sequence, with bin token totals as equal as the
    heuristic can make them, and (best effort) none above ``capacity``. Refinement stops
    once all bins are within capacity and max - min <= tolerance * mean load. C++ kernel
    when built, else the Python twin."""
    num_bins = _check_positive_int("num_bins", num_bins)
    capacity = _NO_CAPACITY if capacity is None else _check_positive_int("capacity", capacity)
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    lens = _as_lengths(lens)
    spread = int(tolerance * int(lens.sum()) / num_bins)
    max_iters = _ITERS_PER_BIN * num_bins + 64
    mod = kernels.load("packing") if use_kernel else None
    if mod is not None:
        import torch

        assign, _ = mod.balanced_partition(torch.from_numpy(np.ascontiguousarray(lens)), num_bins, capacity,
                                           spread, max_iters, _MAX_SCAN)
        return assign.numpy()
    assign, _ = _balanced_partition_py(lens, num_bins, capacity, spread, max_iters, _MAX_SCAN)
    return assign


# --------------------------------------------------------------------------- micro-batches


def micro_batches_lower_bound(seqlens: Any, max_tokens: int, *, dp: int = 1, multiple_of: int = 1,
                              min_micro_batches: int = 1) -> int:
    """The fewest micro-batches per rank any packing can use (sequences longer than the
    budget count one micro-batch each)."""
    lens = _as_lengths(seqlens)
    over = lens > max_tokens
    bins = int(over.sum()) + -(-int(lens[~over].sum()) // max_tokens)
    k = max(-(-bins // dp), min_micro_batches, 1)
    return -(-k // multiple_of) * multiple_of


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Building thousands of small lists can trigger a full cyclic-GC pass over every
    object in the process (hundreds of ms with torch loaded) though none of them can form a
    cycle; pause the collector for that stretch only."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _group_by_bin(seq_ids: np.ndarray, assign: np.ndarray, num_bins: int) -> list[list[int]]:
    """Members of every bin, ascending: one stable sort instead of n list appends."""
    flat = seq_ids[np.argsort(assign, kind="stable")].tolist()
    ends = np.cumsum(np.bincount(assign, minlength=num_bins)).tolist()
    return [flat[start:end] for start, end in zip([0] + ends[:-1], ends)]


def _deal_to_ranks(bin_loads: np.ndarray, dp: int, per_rank: int) -> list[list[int]]:
    """Bins to ranks, heaviest first to the lightest rank with a free slot."""
    heap = [(0, r) for r in range(dp)]
    ranks: list[list[int]] = [[] for _ in range(dp)]
    for b in np.argsort(-bin_loads, kind="stable").tolist():
        load, r = heapq.heappop(heap)
        ranks[r].append(b)
        if len(ranks[r]) < per_rank:
            heapq.heappush(heap, (load + int(bin_loads[b]), r))
    return ranks


def pack_micro_batches(seqlens: Sequence[int] | np.ndarray | Any, max_tokens: int, *, dp: int = 1,
                       multiple_of: int = 1, min_micro_batches: int = 1,
                       allow_oversize: bool = False, use_kernel: bool = True) -> Plan:
    """Pack sequences into micro-batches: ``plan[rank][mb]`` is a sorted list of indices.

    Args:
        seqlens: token count of every sequence (list, numpy or torch 1-D; each >= 1).
        max_tokens: token budget of one micro-batch.
        dp: data-parallel ranks; each gets the same number of micro-batches.
        multiple_of: micro-batches per rank must be a multiple of this (pipeline degree).
        min_micro_batches: at least this many micro-batches per rank.
        allow_oversize: a sequence longer than ``max_tokens`` becomes a micro-batch of
            its own instead of an error.
        use_kernel: use the C++ partition when built (``False``: the Python twin).

    A rank's micro-batches are ordered heaviest first. When there are fewer sequences
    than micro-batches (e.g. ``min_micro_batches`` above the count needed) some
    micro-batches are empty lists; the caller decides how to run those.
    """
    lens = _as_lengths(seqlens)
    max_tokens = _check_positive_int("max_tokens", max_tokens)
    dp = _check_positive_int("dp", dp)
    multiple_of = _check_positive_int("multiple_of", multiple_of)
    min_micro_batches = _check_positive_int("min_micro_batches", min_micro_batches)
    over = np.flatnonzero(lens > max_tokens)
    if over.size and not allow_oversize:
        i = int(over[0])
        raise ValueError(f"sequence {i} has {int(lens[i])} tokens, more than max_tokens={max_tokens} "
                         f"({over.size} such sequences); raise the budget or pass allow_oversize=True")
    fits = np.flatnonzero(lens <= max_tokens)
    per_rank = micro_batches_lower_bound(lens, max_tokens, dp=dp, multiple_of=multiple_of,
                                         min_micro_batches=min_micro_batches)
    while True:
        num_bins = dp * per_rank - over.size  # 0 only when every sequence is oversized
        if num_bins == 0:
            assign, loads = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
            break
        assign = balanced_partition(lens[fits], num_bins, capacity=max_tokens, use_kernel=use_kernel)
        loads = np.bincount(assign, weights=lens[fits], minlength=num_bins).astype(np.int64)
        if not loads.size or loads.max() <= max_tokens:
            break
        log.debug("packing: %d micro-batches per rank miss the budget (max load %d > %d); adding %d",
                  per_rank, int(loads.max()), max_tokens, multiple_of)
        per_rank += multiple_of
    all_loads = np.concatenate([loads, lens[over]])
    ranks = _deal_to_ranks(all_loads, dp, per_rank)
    with _gc_paused():
        members = _group_by_bin(fits, assign, num_bins) + [[int(i)] for i in over]
        return [[members[b] for b in rank] for rank in ranks]


@dataclass(frozen=True)
class PackStats:
    """How good a plan is: counts against the lower bound and load balance."""

    micro_batches_per_rank: int
    lower_bound_per_rank: int
    max_load: int
    min_load: int
    rank_max_load: int
    rank_min_load: int

    @property
    def balance(self) -> float:
        """max/min micro-batch load (inf when some micro-batch is empty)."""
        return self.max_load / self.min_load if self.min_load else math.inf

    @property
    def rank_balance(self) -> float:
        return self.rank_max_load / self.rank_min_load if self.rank_min_load else math.inf


def pack_stats(seqlens: Any, plan: Plan, max_tokens: int, *, multiple_of: int = 1,
               min_micro_batches: int = 1) -> PackStats:
    """Check ``plan`` covers every sequence exactly once and summarise it."""
    lens = _as_lengths(seqlens)
    seen = np.zeros(len(lens), dtype=np.int64)
    mb_loads, rank_loads = [], []
    for rank in plan:
        total = 0
        for mb in rank:
            seen[mb] += 1
            mb_loads.append(int(lens[mb].sum()))
            total += mb_loads[-1]
        rank_loads.append(total)
    if not np.all(seen == 1):
        bad = int(np.flatnonzero(seen != 1)[0])
        raise ValueError(f"plan places sequence {bad} {int(seen[bad])} times")
    counts = {len(rank) for rank in plan}
    if len(counts) != 1:
        raise ValueError(f"ranks have different micro-batch counts: {sorted(counts)}")
    return PackStats(
        micro_batches_per_rank=counts.pop(),
        lower_bound_per_rank=micro_batches_lower_bound(lens, max_tokens, dp=len(plan), multiple_of=multiple_of,
                                                       min_micro_batches=min_micro_batches),
        max_load=max(mb_loads), min_load=min(mb_loads),
        rank_max_load=max(rank_loads), rank_min_load=min(rank_loads),
    )

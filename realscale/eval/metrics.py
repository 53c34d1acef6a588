"""Scores of n sampled answers per problem: pass@k, avg@n, maj@n (pure functions).

- **pass@k** — the unbiased estimator of Chen et al. 2021 (arXiv 2107.03374): with ``n``
  samples of which ``c`` are right, ``1 - C(n-c, k) / C(n, k)``, the chance that ``k``
  samples drawn without replacement from the ``n`` hold a right one; computed as a product
  (no huge binomials). Averaged over problems.
- **avg@n** — the mean of ``c / n`` over problems (the expected accuracy of one sample).
- **maj@n** — majority voting: the most frequent extracted answer of the ``n`` samples
  (ties go to the answer seen first; samples with no answer do not vote) is the problem's
  answer; the problem counts when that answer was judged right.
- **intervals** — problems, not answers, are the sampling unit (answers to one problem are
  correlated), so avg@n's 95% interval is the normal interval of the mean of the
  per-problem accuracies ``c / n``: ``1.96 * sd / sqrt(problems)``; two evaluations of the
  same problems compare by the paired per-problem differences (:func:`paired_difference`),
  which removes the problems' own spread of difficulty.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` right answers among ``n`` samples."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def answer_key(answer: str | None) -> str | None:
    """What two answers must share to count as the same vote: whitespace and thousands
    commas dropped, numbers written canonically (``"1,200.0"`` and ``"1200"`` agree)."""
    if answer is None:
        return None
    text = re.sub(r"\s+", "", answer).strip("$.")
    plain = text.replace(",", "")
    try:
        value = float(plain)
    except ValueError:
        return text or None
    return str(int(value)) if value.is_integer() else repr(value)


def majority_correct(keys: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """Whether the majority answer among ``keys`` was judged right (False when nobody voted)."""
    votes = Counter(k for k in keys if k is not None)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(k for k in keys if k is not None and votes[k] == top)  # first seen wins a tie
    return bool(correct[list(keys).index(winner)])


Z95 = 1.959963984540054  # the normal distribution's two-sided 95% point


def mean_interval(values: Sequence[float]) -> tuple[float, float]:
    """``(mean, half-width of its 95% interval)`` of per-problem values (half-width 0 for one value)."""
    if not values:
        raise ValueError("mean_interval: no values")
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, Z95 * math.sqrt(var / len(values))


def paired_difference(before: Sequence[float], after: Sequence[float]) -> tuple[float, float]:
    """``(mean of after - before, half-width of its 95% interval)`` over the same problems."""
    if len(before) != len(after):
        raise ValueError(f"paired_difference: {len(before)} problems before, {len(after)} after")
    return mean_interval([a - b for a, b in zip(after, before)])


def aggregate(correct: Sequence[Sequence[bool]], keys: Sequence[Sequence[str | None]] | None,
              ks: Sequence[int]) -> dict[str, float]:
    """Benchmark scores over problems: ``avg@n`` and its 95% interval's half-width
    ``avg@n_ci95``, ``pass@k`` for each k, ``maj@n`` (when ``keys`` are given). Every
    problem must have the same number of samples n."""
    if not correct:
        raise ValueError("aggregate: no problems")
    n = len(correct[0])
    if any(len(c) != n for c in correct):
        raise ValueError("aggregate: problems have different numbers of samples")
    avg, half = mean_interval([sum(c) / n for c in correct])
    out = {f"avg@{n}": avg, f"avg@{n}_ci95": half}
    for k in sorted(set(ks)):
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(c), k) for c in correct) / len(correct)
    if keys is not None:
        out[f"maj@{n}"] = sum(majority_correct(kk, c) for kk, c in zip(keys, correct)) / len(correct)
    return out

"""pass@k (unbiased), avg@n, maj@n against hand-computed values."""

from __future__ import annotations

import itertools
import math

import pytest

from realscale.eval.metrics import (Z95, aggregate, answer_key, majority_correct, mean_interval,
                                    paired_difference, pass_at_k)


@pytest.mark.parametrize("n,c,k,want", [
    (5, 2, 2, 1 - 3 / 10),        # 1 - C(3,2)/C(5,2)
    (4, 1, 1, 0.25),              # pass@1 = c/n
    (10, 3, 5, 1 - 21 / 252),     # 1 - C(7,5)/C(10,5)
    (16, 0, 8, 0.0),
    (16, 16, 1, 1.0),
    (4, 3, 2, 1.0),               # n - c < k: every draw of 2 holds a right answer
    (8, 1, 4, 0.5),               # 1 - C(7,4)/C(8,4) = 1 - 35/70
])
def test_pass_at_k_hand_computed(n: int, c: int, k: int, want: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_right_answer() -> None:
    """The estimator's definition, by enumerating every k-subset of 7 samples."""
    for c in range(8):
        samples = [True] * c + [False] * (7 - c)
        for k in range(1, 8):
            subsets = list(itertools.combinations(samples, k))
            assert pass_at_k(7, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
            assert pass_at_k(7, c, k) == pytest.approx(1 - math.comb(7 - c, k) / math.comb(7, k))


def test_pass_at_k_refuses_bad_arguments() -> None:
    for args in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*args)


def test_majority_vote() -> None:
    assert majority_correct(["42", "41", "42", None], [True, False, True, False]) is True
    assert majority_correct(["41", "42", "41"], [False, True, False]) is False
    assert majority_correct(["7", "8"], [False, True]) is False  # a tie goes to the answer seen first
    assert majority_correct([None, None], [False, False]) is False
    assert answer_key("1,200.0") == answer_key(" 1200 ") == "1200"
    assert answer_key("\\frac{1}{2}") == "\\frac{1}{2}" and answer_key(None) is None


def test_aggregate_over_problems() -> None:
    correct = [[True, False, False, False], [True, True, True, False], [False] * 4]
    keys = [["1", "2", "2", "2"], ["5", "5", "5", "6"], ["0", None, None, None]]
    got = aggregate(correct, keys, ks=[1, 2, 4])
    assert got["avg@4"] == pytest.approx((1 / 4 + 3 / 4 + 0) / 3)
    assert got["pass@1"] == pytest.approx(got["avg@4"])
    assert got["pass@2"] == pytest.approx(((1 - 3 / 6) + 1.0 + 0.0) / 3)
    assert got["pass@4"] == pytest.approx(2 / 3)
    assert got["maj@4"] == pytest.approx(1 / 3)  # only the second problem's majority ("5") is right
    with pytest.raises(ValueError):
        aggregate([[True], [True, False]], None, [1])


def test_intervals_over_problems() -> None:
    """avg@n's interval treats problems as the unit: hand-computed sd / sqrt(problems)."""
    correct = [[True, False, False, False], [True, True, True, False], [False] * 4]
    got = aggregate(correct, None, ks=[1])
    per = [0.25, 0.75, 0.0]
    mean = sum(per) / 3
    sd = math.sqrt(sum((p - mean) ** 2 for p in per) / 2)
    assert got["avg@4_ci95"] == pytest.approx(Z95 * sd / math.sqrt(3))
    assert Z95 == pytest.approx(1.96, abs=1e-3)
    assert mean_interval([0.5]) == (0.5, 0.0)
    with pytest.raises(ValueError):
        mean_interval([])
    # pairing removes the problems' own spread: a uniform gain of 0.25 has no width at all,
    # while the unpaired intervals of the two evaluations are wide
    before, after = [0.0, 0.25, 0.5, 0.75], [0.25, 0.5, 0.75, 1.0]
    assert paired_difference(before, after) == (pytest.approx(0.25), pytest.approx(0.0))
    assert mean_interval(before)[1] > 0.25
    with pytest.raises(ValueError, match="3 problems before, 2 after"):
        paired_difference([0.0] * 3, [0.0] * 2)

"""The exact fast path: what it parses, and that it agrees with math-verify wherever it decides."""

from __future__ import annotations

import logging
import random
from fractions import Fraction

import pytest

from realscale.reward.math_fast import fast_check, parse_plain


@pytest.mark.parametrize("text, value, is_float, is_pct", [
    ("1,234", Fraction(1234), False, False),
    ("1234.0", Fraction(1234), True, False),
    ("$1234", Fraction(1234), False, False),
    (r"\$1,234", Fraction(1234), False, False),
    (r"1\,234", Fraction(1234), False, False),
    ("1{,}000{,}000", Fraction(10**6), False, False),
    (r"50\%", Fraction(50), False, True),
    (r"\frac{1}{2}", Fraction(1, 2), False, False),
    (r"\dfrac12", Fraction(1, 2), False, False),
    (r"-\frac{-3}{4}", Fraction(3, 4), False, False),
    ("−7", Fraction(-7), False, False),
    (".5", Fraction(1, 2), True, False),
    (r"10\text{ dollars}", Fraction(10), False, False),
    (r"$\boxed{12}$", Fraction(12), False, False),
])
def test_parse_plain_accepts_plain_numbers(text: str, value: Fraction, is_float: bool, is_pct: bool) -> None:
    num = parse_plain(text)
    assert num is not None and (num.value, num.is_float, num.is_pct) == (value, is_float, is_pct)


@pytest.mark.parametrize("text", ["(1,2)", "1,2", "1,23", "3/0", "x", r"\sqrt{2}", "1e5", "2^{10}",
                                  "1234567890123456", "0.1234567890123456", r"\frac{1}{2}\%", ""])
def test_parse_plain_leaves_everything_else_to_math_verify(text: str) -> None:
    assert parse_plain(text) is None


@pytest.mark.parametrize("gold, pred, verdict", [
    ("1234", r"\boxed{1,234}", True),
    ("1234", "1234.0", True),
    ("10", "11", False),
    ("0.5", r"\frac{1}{2}", True),
    (r"\frac13", "0.333333", None),  # math-verify rounds to 6 places: left to it
    (r"\frac13", "0.33", False),
    ("50", r"50\%", True),
    ("12.5", "12.5%", True),
    ("0.5", r"50\%", True),
    ("1", r"100\%", None),
    ("60", r"40\%", False),
    ("12.5%", "12.5", False),  # math-verify's Float branch: 0.125 vs 12.5
])
def test_fast_check_verdicts(gold: str, pred: str, verdict: bool | None) -> None:
    assert fast_check(gold, pred) is verdict


def _forms(value: Fraction, rng: random.Random) -> list[str]:
    """Ways to write ``value`` that math-verify parses as intended."""
    out = []
    if value.denominator == 1:
        n = int(value)
        out += [str(n), f"{n:,}", f"{n}.0", f"{n}.00"]
        if n >= 0:
            out += [f"{n}\\%"]
    else:
        sign = "-" if value < 0 else ""
        num, den = abs(value.numerator), value.denominator
        out += [f"{sign}\\frac{{{num}}}{{{den}}}", f"{value.numerator}/{den}"]
        if 10**6 % den == 0 or den in (2, 4, 5, 8, 20, 25):
            out.append(f"{float(value):.6f}".rstrip("0"))
    return out


def _intended_divergence(gold: str, pred: str) -> bool:
    """"12.5%" for a reference "12.5": we accept it as math-verify does for integers ("50%" vs
    "50"); math-verify's Float branch divides by 100 first and rejects it."""
    g, p = parse_plain(gold), parse_plain(pred)
    return g is not None and p is not None and p.is_pct and not g.is_pct and p.value == g.value


def test_fast_path_agrees_with_math_verify_wherever_it_decides() -> None:
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    rng = random.Random(0)
    values = [Fraction(rng.randint(-2000, 20000)) for _ in range(12)]
    values += [Fraction(rng.randint(1, 99), rng.choice([2, 3, 4, 5, 7, 8, 20])) for _ in range(8)]
    values += [Fraction(-3, 4), Fraction(0), Fraction(100)]
    pairs = []
    for v in values:
        forms = _forms(v, rng)
        near = _forms(v + rng.choice([1, -1, Fraction(1, 2)]), rng)
        pairs += [(rng.choice(forms), f) for f in forms] + [(rng.choice(forms), f) for f in near[:2]]
    decided = 0
    for gold, pred in pairs:
        ours = fast_check(gold, pred)
        if ours is None:
            continue
        if _intended_divergence(gold, pred):
            continue
        decided += 1
        theirs = verify(parse("\\boxed{" + gold + "}"), parse("\\boxed{" + pred + "}"))
        assert ours == theirs, (gold, pred, ours, theirs)
    # The fast path must take the common forms; what it leaves is mostly "no" verdicts with a percent.
    assert decided >= 0.9 * len(pairs)

"""Decide answer equality for plain numbers exactly, without sympy.

Most answers in GSM8K-like data are integers, decimals, fractions or percents. Parsing
them with a few anchored regexes and comparing :class:`fractions.Fraction` values is ~100x
cheaper than math-verify's LaTeX -> sympy route. The fast path must never contradict
math-verify where math-verify is right, so it copies math-verify's numeric rules
(``sympy_numeric_eq`` in math_verify/grader.py) and answers "don't know" (None) whenever
it is not sure:

- a decimal on either side: math-verify rounds both to 6 places. We answer True on exact
  equality, False when the values differ by more than 2e-6 (rounded values must then
  differ), and None in between.
- integers on both sides (percents included): math-verify compares the numbers before
  the percent sign, so "50%" equals "50".
- otherwise (fractions): exact comparison of the values, a percent meaning /100.
- "100%" against "1" (equal only once the percent is divided out) is left to math-verify,
  whose symbolic fallback may or may not equate them; values beyond 1e12 or 15
  significant digits are left to it too, because sympy Floats carry 15 digits.
- one deliberate difference: "12.5%" for a reference "12.5" is accepted, as math-verify
  itself accepts "50%" for "50" (its Float branch divides by 100 first and rejects it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

_MAX_ABS = Fraction(10**12)
_MAX_DIGITS = 15
_FLOAT_TOL = Fraction(2, 10**6)

_WRAPPERS = re.compile(r"^\\(?:boxed|text|textbf|mathrm|mathbf|displaystyle)\s*\{(.*)\}$", re.S)
_DELIMS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_UNIT_SUFFIX = re.compile(r"\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z .]*\}\s*$")
_THIN_SPACE = re.compile(r"(?<=\d)(?:\\,|\\!|\\ |\{,\})(?=\d{3}(?!\d))")
_DECIMAL = re.compile(r"^([+-]?)(\d{1,3}(?:,\d{3})+|\d+)?(?:\.(\d+))?$")
_SLASH = re.compile(r"^([+-]?)(\d+)/(\d+)$")
_FRAC = re.compile(r"^([+-]?)\\[dt]?frac(?:\{\s*([+-]?\d+)\s*\}\{\s*(\d+)\s*\}|(\d)(\d))$")


@dataclass(frozen=True)
class Num:
    """A plain number as written: its value (before any percent), and how it was written."""

    value: Fraction
    is_float: bool  # written with a decimal point: sympy makes it a Float
    is_pct: bool

    @property
    def effective(self) -> Fraction:
        return self.value / 100 if self.is_pct else self.value

    @property
    def is_int(self) -> bool:
        return not self.is_float and self.value.denominator == 1


def _unwrap(s: str) -> str:
    """Strip math delimiters and whole-answer wrappers (\\boxed{}, \\text{}) until none is left."""
    while True:
        before = s
        s = s.strip()
        for left, right in _DELIMS:
            if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
                s = s[len(left) : -len(right)].strip()
        m = _WRAPPERS.match(s)
        if m and "{" not in m.group(1) and "}" not in m.group(1):  # one wrapper, not "\text{a}+\text{b}"
            s = m.group(1)
        if s == before:
            return s


def _normalise(answer: str) -> tuple[str, bool]:
    """(bare number text, is_percent) with units, dollar signs and thin spaces removed."""
    s = _unwrap(answer)
    s = _UNIT_SUFFIX.sub("", s).strip().rstrip(".").strip()
    is_pct = False
    for pct in ("\\%", "%"):
        if s.endswith(pct):
            s, is_pct = s[: -len(pct)].strip(), True
            break
    s = s.replace("−", "-")
    sign = ""
    if s[:1] in "+-" and s[:1]:
        sign, s = s[0], s[1:].strip()
    for dollar in ("\\$", "$"):
        if s.startswith(dollar):
            s = s[len(dollar) :].strip()
    s = _THIN_SPACE.sub(",", s)
    return sign + s, is_pct


def _digits_ok(*parts: str | None) -> bool:
    return sum(len(p.lstrip("0")) for p in parts if p) <= _MAX_DIGITS


def _parse_number(s: str) -> tuple[Fraction, bool] | None:
    """(value, is_float) of an integer, decimal or fraction literal, else None."""
    m = _DECIMAL.match(s)
    if m and (m.group(2) or m.group(3)):
        sign, whole, frac = m.group(1), (m.group(2) or "").replace(",", ""), m.group(3)
        if not _digits_ok(whole, frac):
            return None
        value = Fraction(int(whole or "0")) + (Fraction(int(frac), 10 ** len(frac)) if frac else 0)
        return (-value if sign == "-" else value), frac is not None
    m = _SLASH.match(s)
    if m:
        sign, num, den = m.groups()
    else:
        m = _FRAC.match(s)
        if not m:
            return None
        sign = m.group(1)
        num, den = (m.group(2), m.group(3)) if m.group(2) is not None else (m.group(4), m.group(5))
        if num.startswith(("-", "+")):
            sign = "-" if (num[0] == "-") != (sign == "-") else ""
            num = num[1:]
    if int(den) == 0 or not _digits_ok(num, den):
        return None
    value = Fraction(int(num), int(den))
    return (-value if sign == "-" else value), False


@lru_cache(maxsize=65536)
def parse_plain(answer: str) -> Num | None:
    """The answer as a :class:`Num` when it is a plain number, else None (not a fast-path case)."""
    if len(answer) > 200:
        return None
    text, is_pct = _normalise(answer)
    parsed = _parse_number(text)
    if parsed is None:
        return None
    value, is_float = parsed
    if abs(value) > _MAX_ABS or (is_pct and not is_float and value.denominator != 1):
        return None
    return Num(value, is_float, is_pct)


def fast_equal(gold: Num, pred: Num) -> bool | None:
    """math-verify's verdict on two plain numbers, or None when it can't be decided here."""
    if _percent_of_same_number(gold, pred):
        return True
    if gold.is_float or pred.is_float:
        a, b = gold.effective, pred.effective
        if a == b:
            return True
        return False if abs(a - b) > _FLOAT_TOL else None
    if gold.is_int and pred.is_int:  # math-verify compares "50%" and "50" as 50 and 50
        if gold.value == pred.value:
            return True
        # "100%" vs "1": equal only after the /100, which math-verify may or may not find.
        return None if gold.effective == pred.effective else False
    return gold.effective == pred.effective


def _percent_of_same_number(gold: Num, pred: Num) -> bool:
    """An answer "12.5%" to a reference "12.5": the question asked for a percentage.

    math-verify accepts this for integers ("50%" vs "50") but not for decimals, because
    its Float branch divides by 100 first; we accept both, the same way."""
    return pred.is_pct and not gold.is_pct and pred.value == gold.value


def fast_check(gold_answer: str, pred_answer: str) -> bool | None:
    """Equality of two extracted answers when both are plain numbers; None when undecided."""
    gold = parse_plain(gold_answer)
    if gold is None:
        return None
    pred = parse_plain(pred_answer)
    if pred is None:
        return None
    return fast_equal(gold, pred)

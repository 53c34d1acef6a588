"""Answer extraction: boxed (nested, escaped, truncated), "the answer is", ####, last number."""

from __future__ import annotations

import time

import pytest

from realscale.reward.math_extract import extract_answer, last_boxed, reference_answer


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{\frac{\frac{1}{2}}{3}}", r"\frac{\frac{1}{2}}{3}"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are content, not structure
    (r"\boxed{1} then \boxed{2}", "2"),
    (r"\boxed{7} and a cut-off \boxed{12", "7"),
    (r"\boxed 5.", "5."),
    (r"\fbox{9}", "9"),
    (r"\boxed{\boxed{8}}", "8"),
    ("no box here", None),
    (r"\boxedx", None),
])
def test_last_boxed(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


@pytest.mark.parametrize("completion, expected", [
    (r"Thus \boxed{1,234}.", ("1,234", "boxed")),
    ("The answer is 1234.", ("1234", "answer_is")),
    ("The answer is 3.5.", ("3.5", "answer_is")),
    (r"The final answer is $\frac{2}{3}$. I hope it is correct.", (r"\frac{2}{3}", "answer_is")),
    ("**Final Answer:** $10$", ("10", "answer_is")),
    ("steps\n#### 72\n", ("72", "gsm")),
    ("She had 5 apples and ate 2, leaving 3.", ("3", "last_number")),
    ("It costs $1,200, or 12%", ("12%", "last_number")),
    ("In 2023, it was 1,000,000.", ("1,000,000", "last_number")),
    ("I don't know.", None),
    ("", None),
])
def test_extract_answer(completion: str, expected: tuple[str, str] | None) -> None:
    assert extract_answer(completion) == expected


def test_reference_answer_unwraps_box_and_gsm_marker() -> None:
    assert reference_answer(r"$\boxed{\frac12}$") == r"\frac12"
    assert reference_answer("Work...\n#### 18") == "18"
    assert reference_answer("  (1, 2] ") == "(1, 2]"


def test_hostile_completions_are_scanned_in_linear_time() -> None:
    # Patterns that make backtracking regexes explode must stay fast here.
    hostile = ["{" * 200_000, r"\boxed{" * 50_000, "the answer is " + "\\(" * 50_000, "1," * 100_000]
    start = time.perf_counter()
    for text in hostile:
        extract_answer(text)
    assert time.perf_counter() - start < 5.0

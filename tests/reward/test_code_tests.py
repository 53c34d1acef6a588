"""code_tests: every dataset form parses to the right judge; comparisons are strict."""

from __future__ import annotations

import json

import pytest

from realscale.reward.code_tests import (CallTests, CheckTests, StdioTests, answer_matches, free_names, parse_tests,
                                         stdout_matches)


def test_humaneval_row_is_check_form_with_its_prompt() -> None:
    form = parse_tests({"test": "def check(candidate):\n    assert candidate(poly, 1) == 2\n",
                        "entry_point": "find_zero", "prompt": "def poly(xs, x):\n    return 0\n"})
    assert isinstance(form, CheckTests)
    assert form.entry_point == "find_zero" and form.prelude.startswith("def poly")
    assert form.names == ["find_zero", "poly"]


def test_assert_lists_and_programs_are_check_form() -> None:
    form = parse_tests(["assert add(1, 2) == 3", "import math\nassert math.isclose(mul(2, 3), 6)"])
    assert isinstance(form, CheckTests) and form.names == ["add", "mul"] and form.entry_point is None
    assert parse_tests("[x for x in f()] == [1]").names == ["f"]  # a bracket, but Python, not JSON


def test_free_names_skip_what_the_test_binds() -> None:
    src = ("import random as r\nfrom math import *\ndef check(c):\n    for i in range(3):\n"
           "        assert c(i) == helper(i)\n    try:\n        pass\n    except E as e:\n        print(e)\n")
    assert free_names(src) == ["E", "helper"]


def test_stdin_cases_in_each_dataset_shape() -> None:
    lcb = [{"input": "1\n", "output": "2\n", "testtype": "stdin"}]
    pi = [{"type": "stdin_stdout", "input": "1\n", "output": "2\n"}]
    apps = {"inputs": ["1\n"], "outputs": ["2\n"]}
    for raw in (lcb, pi, apps, json.dumps(lcb)):
        assert parse_tests(raw) == StdioTests(["1\n"], ["2\n"])
    assert parse_tests({"inputs": [["1", "2"]], "outputs": [["3"]]}) == StdioTests(["1\n2"], ["3"])


def test_functional_cases() -> None:
    lcb = parse_tests([{"input": "[1, 2]\n3", "output": "[0, 1]", "testtype": "functional",
                        "metadata": {"func_name": "f"}}])
    assert lcb == CallTests("f", [([[1, 2], 3], {})], [[0, 1]], lenient=False)
    apps = parse_tests({"fn_name": "g", "inputs": [[1, 2]], "outputs": [[3]]})
    assert apps == CallTests("g", [([1, 2], {})], [[3]], lenient=True)


@pytest.mark.parametrize("bad, why", [(None, "tests must be"), ({"x": 1}, "tests must be"), ("def (", "not Python"),
                                      ([{"input": "1"}], "needs 'input' and 'output'"),
                                      ([{"input": "1", "output": "1", "testtype": "functional"}], "fn_name"),
                                      ({"inputs": [1], "outputs": []}, "1 inputs for 0 outputs")])
def test_bad_tests_are_named(bad: object, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_tests(bad)


def test_stdout_comparison() -> None:
    assert stdout_matches("3\n", "3")
    assert stdout_matches("1 2  \n3\n\n", "1 2\n3")
    assert stdout_matches("0.3333333", "0.33333333")  # numbers to 1e-6
    assert not stdout_matches("0.34", "0.33")
    assert not stdout_matches("", "3")
    assert not stdout_matches("3 4", "3")
    assert not stdout_matches("inf", "1e400x")


def test_answer_comparison_is_strict_about_types() -> None:
    assert answer_matches([0, 1], [0, 1]) and answer_matches((0, 1), [0, 1])
    assert not answer_matches(True, 1) and not answer_matches(1, True)
    assert answer_matches(0.1 + 0.2, 0.3) and not answer_matches(0.31, 0.3)
    assert not answer_matches("1", 1) and not answer_matches(None, [])
    assert answer_matches(3, [3], lenient=True) and not answer_matches(3, [3])
    assert answer_matches({"a": [1]}, {"a": [1]}) and not answer_matches({"a": 1}, {"b": 1})


def test_prompt_becomes_a_prelude_only_when_it_is_code() -> None:
    assert parse_tests({"test": "assert f(1) == 1", "prompt": "def f(x):\n"}).prelude == "def f(x):\n    pass\n"
    assert parse_tests({"test": "assert f(1) == 1", "prompt": "Write f, please."}).prelude == ""
    humaneval = 'import math\n\ndef f(x):\n    """Doc."""\n'
    assert parse_tests({"test": "assert f(1) == 1", "prompt": humaneval}).prelude == humaneval

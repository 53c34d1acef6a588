"""The forms a sample's code tests come in, and how each is judged outside the candidate.

Three forms; in none does the candidate's exit status, output format or objects decide:

- :class:`StdioTests` (LiveCodeBench / DeepCoder / APPS "standard input"): the program runs
  once per case with the case's input on stdin; the trainer compares stdout with the
  expected output (:func:`stdout_matches`). Defeats: ``os._exit(0)`` / ``sys.exit(256)`` /
  ``atexit`` / ``SystemExit`` (an exit status is never a pass: the output must match and
  the status be 0), rebinding builtins and tampering with anything in the process (only the
  bytes it printed count), reading the tests (the expected outputs never enter the sandbox;
  each case's input is given only to its own process).
- :class:`CallTests` (LiveCodeBench "functional", APPS/TACO ``fn_name``): the function is
  called with each case's arguments; its return value crosses back as plain data
  (:mod:`realscale.reward.plain`) and the trainer compares it (:func:`answer_matches`).
  Defeats: everything above, plus objects with a rigged ``__eq__`` (only builtin values are
  rebuilt from the text; a non-plain return value fails), and exiting before or during the
  calls (a missing answer fails).
- :class:`CheckTests` (HumanEval ``check(candidate)``, MBPP assert lists, any test program):
  the test code is *trusted* and runs in the judge process, outside the sandbox, as its own
  unprivileged uid. Each name it takes from the candidate (its free names: ``candidate``'s
  function, helpers it calls) is a proxy that sends plain-data arguments to the candidate
  and gets a plain-data value back. Helpers defined by the sample's prompt (``prelude``,
  e.g. HumanEval/32's ``poly``) are the prompt's, not the candidate's, and a free name that
  is a standard module (MBPP's ``math.isclose`` without an import) is that module, the
  judge's own. Defeats: everything
  above, plus rebinding the builtins or helpers the test uses (they live in the judge),
  ``SystemExit`` inside the function (an exception of the call, not an exit of the test),
  and reading the test code (it never enters the sandbox). Limits: arguments must be plain
  data (a test that passes a lambda is refused as ``error``), and a mutation of an argument
  by the candidate is not seen by the test.
"""

from __future__ import annotations

import ast
import builtins
import json
import math
from dataclasses import dataclass
from typing import Any, Union

from realscale._pyast import parse


@dataclass(frozen=True)
class StdioTests:
    """Cases of (stdin, expected stdout)."""

    inputs: list[str]
    outputs: list[str]


@dataclass(frozen=True)
class CallTests:
    """Cases of ``fn(*args, **kwargs) == expected``; ``lenient``: APPS style, where the
    expected value may also be wrapped in a one-element list."""

    fn: str
    calls: list[tuple[list[Any], dict[str, Any]]]
    expected: list[Any]
    lenient: bool = False


@dataclass(frozen=True)
class CheckTests:
    """A trusted test program; ``names`` are the free names it takes from the candidate."""

    test: str
    entry_point: str | None
    prelude: str
    names: list[str]


CodeTests = Union[StdioTests, CallTests, CheckTests]


def parse_tests(tests: object) -> CodeTests:
    """A sample's ``tests`` as one of the three forms, or ValueError naming what is wrong."""
    if isinstance(tests, str):
        text = tests.strip()
        if text[:1] in "[{":
            try:
                return parse_tests(json.loads(text))
            except json.JSONDecodeError:
                pass  # a Python test program that starts with a bracket
        return _check(tests, None, "")
    if isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests):
        return _check("\n".join(tests), None, "")
    if isinstance(tests, list) and tests and all(isinstance(t, dict) for t in tests):
        return _cases(tests)
    if isinstance(tests, dict):
        if isinstance(tests.get("test"), str):
            prelude = tests.get("prelude", tests.get("prompt", "")) or ""
            return _check(tests["test"], tests.get("entry_point") or None, prelude)
        if isinstance(tests.get("inputs"), list) and isinstance(tests.get("outputs"), list):
            return _apps(tests)
        if "input" in tests and "output" in tests:
            return _cases([tests])
    raise ValueError("tests must be a test program, a list of asserts, a list of {input, output} cases, "
                     f"{{inputs, outputs[, fn_name]}} or {{test[, entry_point, prompt]}}; got {type(tests).__name__}")


def _check(test: str, entry_point: str | None, prelude: str) -> CheckTests:
    names = sorted(set(free_names(test)) | ({entry_point} if entry_point else set()))
    return CheckTests(test, entry_point, _prelude(prelude), names)


def _prelude(prompt: str) -> str:
    """The prompt as code the judge runs first (its imports and helpers): as it is, or with
    the body of its last, open ``def`` stubbed; a prose prompt is no prelude."""
    lines = prompt.rstrip().splitlines()
    indent = len(lines[-1]) - len(lines[-1].lstrip()) if lines else 0
    for text in (prompt, prompt.rstrip() + "\n" + " " * (indent + 4) + "pass\n"):
        try:
            parse(text)
            return text
        except SyntaxError:
            continue
    return ""


def free_names(test: str) -> list[str]:
    """Names the test code reads but never binds (and that are not builtins): the ones it
    must take from the candidate."""
    try:
        tree = parse(test)
    except SyntaxError as exc:
        raise ValueError(f"tests: not Python: {exc}") from None
    loaded, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return sorted(loaded - bound - set(dir(builtins)))


def _kind(case: dict) -> str:
    kind = str(case.get("testtype", case.get("type", "stdin")))
    return "call" if kind in ("functional", "function_call", "call") else "stdio"


def _cases(cases: list[dict]) -> CodeTests:
    kinds = {_kind(c) for c in cases}
    if len(kinds) != 1:
        raise ValueError("tests mix stdin and functional cases")
    if not all("input" in c and "output" in c for c in cases):
        raise ValueError("every test case needs 'input' and 'output'")
    if kinds == {"stdio"}:
        return StdioTests([_text(c["input"]) for c in cases], [_text(c["output"]) for c in cases])
    fn = cases[0].get("fn_name") or (cases[0].get("metadata") or {}).get("func_name")
    if not isinstance(fn, str) or not fn:
        raise ValueError("functional test cases need 'fn_name' (or metadata.func_name)")
    calls = [(_args(c["input"]), {}) for c in cases]
    expected = [json.loads(c["output"]) if isinstance(c["output"], str) else c["output"] for c in cases]
    return CallTests(fn, calls, expected, lenient=not isinstance(cases[0]["output"], str))


def _apps(tests: dict) -> CodeTests:
    inputs, outputs = tests["inputs"], tests["outputs"]
    if len(inputs) != len(outputs) or not inputs:
        raise ValueError(f"tests: {len(inputs)} inputs for {len(outputs)} outputs")
    fn = tests.get("fn_name")
    if fn:
        calls = [(list(a) if isinstance(a, list) else [a], {}) for a in inputs]
        return CallTests(str(fn), calls, list(outputs), lenient=True)
    return StdioTests([_text(i) for i in inputs], [_text(o) for o in outputs])


def _text(value: object) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return str(value)


def _args(value: object) -> list[Any]:
    """LiveCodeBench functional input: one JSON value per line; or already a list of args."""
    if isinstance(value, list):
        return value
    try:
        return [json.loads(line) for line in str(value).split("\n") if line.strip()]
    except json.JSONDecodeError as exc:
        raise ValueError(f"functional test input is not JSON lines: {exc}") from None


# ------------------------------------------------------------------ comparisons


def stdout_matches(got: str, want: str) -> bool:
    """Same lines up to trailing whitespace, or the same tokens with numbers equal to 1e-6."""
    if _lines(got) == _lines(want):
        return True
    a, b = got.split(), want.split()
    return len(a) == len(b) and all(x == y or _close(x, y) for x, y in zip(a, b))


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def _close(x: str, y: str) -> bool:
    try:
        fx, fy = float(x), float(y)
    except ValueError:
        return False
    return math.isfinite(fx) and math.isfinite(fy) and math.isclose(fx, fy, rel_tol=1e-6, abs_tol=1e-6)


def answer_matches(got: object, want: object, lenient: bool = False) -> bool:
    """``got`` (rebuilt from plain data) equals ``want`` (from the dataset's JSON): tuples
    count as lists (JSON has no tuples), bools are not numbers, floats equal to 1e-9."""
    if _same(got, want):
        return True
    return lenient and isinstance(want, list) and len(want) == 1 and _same(got, want[0])


def _same(a: object, b: object) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        return a == b or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b

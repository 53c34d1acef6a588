"""Every hostile program of tests/reward/hostile.py is contained: with the trainer's own
Python, and with a trainer running from a venv under /tmp whose base interpreter also
lives under /tmp (the case that used to drop the sandbox to root silently)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import hostile
import pytest

CASES = sorted(hostile.CASES)


@pytest.fixture(scope="module")
def system_python() -> dict[str, list[str]]:
    return hostile.run_battery()


@pytest.fixture(scope="module")
def python_under_tmp() -> dict[str, list[str]]:
    venv_python, root = hostile.make_python_under_tmp()
    try:
        env = {**os.environ, "PYTHONPATH": hostile.REPO}
        out = subprocess.run([venv_python, hostile.__file__, "battery"], capture_output=True, text=True, env=env,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        results = json.loads(out.stdout)
        results["_root"] = [root]
        return results
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("case", CASES)
def test_contained_with_the_system_python(system_python: dict[str, list[str]], case: str) -> None:
    assert system_python[case] == []


@pytest.mark.parametrize("case", CASES)
def test_contained_with_python_under_tmp(python_under_tmp: dict[str, list[str]], case: str) -> None:
    assert python_under_tmp[case] == []


def test_the_sandbox_ran_the_interpreter_under_tmp(python_under_tmp: dict[str, list[str]]) -> None:
    """The /tmp battery really ran programs with the /tmp interpreter (not a fallback)."""
    (exe,) = python_under_tmp["_python"]
    assert exe.startswith(python_under_tmp["_root"][0] + "/py/bin/python")
